"""What the user deleted stays deleted: the directories a save found, and whether they remain.

At save time the daemon records the *anchor* of a local path: its deepest ancestor directory
that existed then. Every directory between the anchor and the file was missing at save time,
so a persist may create those, and only those (``server.safe_write`` walks the path below
its root and raises :class:`DirectoryRemoved` for a missing level the anchor covers). If the
anchor itself is gone later, the user removed the directory the checkpoint was saved into
(``shutil.rmtree`` of a checkpoint directory, an adapter's rotation): the generation is
treated as deleted by the user. It is never persisted (that would resurrect the directory)
and its memory becomes evictable.

URLs (S3 and other object stores) have no directories; their anchor is empty and never gone.
"""

from __future__ import annotations

import os

from ckptcache.errors import NameTooLong, ParentNotADirectory, PathIsADirectory
from ckptcache.storage.fs import file_version

#: The longest name a component may have on common Linux file systems (ext4, xfs, tmpfs, NFS).
_NAME_MAX = 255

__all__ = [
    "DirectoryRemoved",
    "anchor_of",
    "check_persistable",
    "is_orphaned",
    "observe_base",
    "removed_reason",
]


class DirectoryRemoved(OSError):
    """A directory that existed when the checkpoint was saved has been removed since."""


def _is_url(path: str) -> bool:
    return "://" in path


def anchor_of(path: str) -> str:
    """The deepest existing ancestor directory of ``path`` ("" for a URL)."""
    if _is_url(path):
        return ""
    head = os.path.dirname(path)
    while head and not os.path.isdir(head):
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    return head or "/"


def observe_base(path: str) -> tuple[str | None, int]:
    """The file on storage at ``path`` when a save of it is made: its identity ("" when there
    is none) and stamp (see :class:`ckptcache.storage.base.WriteGuard`). One ``stat`` and a
    read of the file's last page; ``(None, 0)`` (not known) for URLs, whose persist takes the
    base when it starts, and for a file that cannot be inspected."""
    if _is_url(path):
        return None, 0
    try:
        version = file_version(path, inspect=False)
    except OSError:
        return None, 0
    return ("", 0) if version is None else (version.identity, version.stamp_ns)


def check_persistable(path: str) -> None:
    """Refuse, before any byte is copied, a local path that could never be written: what a
    ``torch.save`` to it would raise (a directory there, a file as a parent, a name over
    ``NAME_MAX``). A few ``stat`` calls; anything else is found by the persist itself."""
    for part in path.split("/"):
        if len(part.encode()) > _NAME_MAX:
            raise NameTooLong(
                f"cannot save {path!r}: the name {part[:40]!r}... is {len(part.encode())} bytes, "
                f"more than the {_NAME_MAX} a file system allows"
            )
    if os.path.isdir(path):
        raise PathIsADirectory(f"cannot save {path!r}: it is an existing directory")
    head = os.path.dirname(path)
    while head and not os.path.isdir(head):
        # Asked again after the existence test: a directory made between the two tests (the
        # persist of this path's previous save making its directories) is not a refusal.
        if os.path.lexists(head) and not os.path.isdir(head):
            raise ParentNotADirectory(f"cannot save {path!r}: {head!r} is not a directory")
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent


def is_orphaned(anchor: str) -> bool:
    """Whether the directory a checkpoint was saved into has been removed since."""
    return bool(anchor) and not os.path.isdir(anchor)


def removed_reason(anchor: str) -> str:
    """The status text of a generation whose directory the user removed."""
    return (
        f"directory {anchor} existed at save time and was removed since: treated as deleted "
        "by the user, not persisted"
    )
