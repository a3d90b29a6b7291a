"""Allowed storage roots: the daemon writes only under configured roots, never outside them.

A path is judged after normalisation *and* after resolving the symlinks of the part of it
that exists, so neither ``..`` nor a symlinked directory can carry a write out of a root.

A daemon running as an ordinary user with no root configured has an *implicit* root: every
absolute local path (the kernel checks that user's permissions on each write, as for the
user's own ``torch.save``). A root daemon never has one: it acts for other users, so it
writes only under the roots its administrator named.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from ckptcache.errors import PathNotAllowed

__all__ = ["PersistRoots"]


def _is_url(path: str) -> bool:
    return "://" in path


def _resolve_existing(path: str) -> str:
    """realpath of the deepest existing ancestor, with the rest of ``path`` appended."""
    head, tail = path, ""
    while head and not os.path.exists(head):
        head, part = os.path.split(head)
        tail = os.path.join(part, tail) if tail else part
        if head == os.path.dirname(head):
            break
    real = os.path.realpath(head or "/")
    return os.path.join(real, tail) if tail else real


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class PersistRoots:
    """The configured roots: local directories (symlinks resolved) and URL prefixes."""

    def __init__(self, roots: Iterable[str], *, implicit: bool = False):
        self.local: list[str] = []
        self.urls: list[str] = []
        #: No root configured and the daemon is an ordinary user: every local path persists.
        self.implicit = implicit
        for root in roots:
            if _is_url(root):
                self.urls.append(root.rstrip("/") + "/")
            else:
                self.local.append(os.path.realpath(os.path.abspath(root)))

    def __bool__(self) -> bool:
        return bool(self.local or self.urls or self.implicit)

    @classmethod
    def for_daemon(cls, roots: Iterable[str], euid: int) -> PersistRoots:
        """The roots of a daemon running as ``euid`` (see the module docstring)."""
        configured = tuple(roots)
        return cls(configured, implicit=not configured and euid != 0)

    def describe(self) -> str:
        """The roots for a log line or an error message."""
        if self.implicit:
            return "every local path (implicit root of a daemon running as a user)"
        return ", ".join(self) or "none"

    def __iter__(self) -> Iterator[str]:
        return iter([*self.local, *self.urls])

    def local_root(self, path: str) -> str | None:
        """The local root ``path`` lies under by name alone (no symlink resolved): the
        directory a write resolves ``path`` from, component by component."""
        lexical = os.path.normpath(path)
        if self.implicit:
            return "/"
        return next((r for r in self.local if _under(lexical, r)), None)

    def root_for(self, path: str) -> str | None:
        """The root ``path`` persists under, or ``None`` if it is under no root.

        Raises :class:`PathNotAllowed` when ``path`` names a root but escapes it (``..``,
        ``.`` segments, or a symlink pointing elsewhere).
        """
        if _is_url(path):
            rest = path.partition("://")[2]
            if any(seg in ("..", ".") for seg in rest.split("/")):
                raise PathNotAllowed(f"{path!r}: '..' and '.' segments are not allowed in URLs")
            return next((r for r in self.urls if path.startswith(r)), None)
        lexical = os.path.normpath(path)
        if lexical != path.rstrip("/") or "/../" in f"{path}/":
            raise PathNotAllowed(f"{path!r} is not a normalised absolute path ('..' refused)")
        if self.implicit:
            return "/"
        claimed = next((r for r in self.local if _under(lexical, r)), None)
        resolved = _resolve_existing(lexical)
        actual = next((r for r in self.local if _under(resolved, r)), None)
        if claimed is not None and actual is None:
            raise PathNotAllowed(
                f"{path!r} escapes the storage root {claimed!r} through a symlink "
                f"(it resolves to {resolved!r}); save it under a real directory of the root"
            )
        if actual is not None and claimed != actual:
            # Under a root only through a symlink: the persist resolves a path below its
            # root one directory at a time and follows no link, so it could never write it.
            raise PathNotAllowed(
                f"{path!r} reaches the storage root {actual!r} only through a symlink (it "
                f"resolves to {resolved!r}), which the persist does not follow; save it "
                "under its real path"
            )
        if actual is not None and resolved != lexical:
            raise PathNotAllowed(
                f"{path!r} goes through a symlink below the storage root {actual!r} (it "
                f"resolves to {resolved!r}), which the persist does not follow; save it "
                "under its real path"
            )
        return actual
