"""Checkpoint names, and whether storage holds one: what every part of the client asks of a
path before (or instead of) asking the daemon."""

from __future__ import annotations

import os
from typing import Any

from ckptcache.errors import InvalidPath, PathNotAllowed
from ckptcache.format.persisted import stored_archive_complete
from ckptcache.storage import backend_for

__all__ = ["complete_in_storage", "in_storage", "is_url", "normalize_path", "object_path"]


def normalize_path(path: Any) -> str:
    """The name of a checkpoint: an absolute local path, or a URL (``s3://...``) unchanged."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise InvalidPath(
            f"checkpoint path must be a str or os.PathLike, not {type(path).__name__}; "
            "ckptcache names objects by the path torch.save would write"
        )
    if not path or "\x00" in path:
        raise InvalidPath(f"invalid checkpoint path {path!r}")
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        return path
    if ".." in path.split(os.sep):
        # Refused rather than resolved: which directory ``..`` names depends on symlinks the
        # lexical resolution would not see, and a checkpoint's name must be one place.
        raise PathNotAllowed(
            f"checkpoint path {path!r} contains '..': give the path without it (for example "
            "os.path.realpath(path))"
        )
    path = os.path.abspath(path)
    # POSIX leaves a path's two leading slashes to the system (Linux: one); abspath keeps
    # them, and one file would have two names.
    return path[1:] if path.startswith("//") else path


def object_path(path: Any) -> str:
    """:func:`normalize_path` for one object (a save, a load): a local path that ends in a
    separator names a directory, which ``torch.save`` and ``torch.load`` refuse, not the
    file without it (:class:`InvalidPath`)."""
    name = normalize_path(path)
    raw = os.fspath(path)
    if "://" not in name and (raw.endswith(os.sep) or raw.endswith(os.sep + ".")):
        raise InvalidPath(
            f"checkpoint path {raw!r} ends in a separator: it names a directory, not a file "
            "to save to or load from"
        )
    return name


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in a remote store (``s3://...``), not a local file."""
    return "://" in path


def in_storage(path: str) -> bool:
    """Whether storage has anything at ``path`` (an unreachable store: no)."""
    try:
        return backend_for(path).exists(path)
    except (OSError, ValueError, ImportError):
        return False


def complete_in_storage(path: str) -> bool:
    """Whether storage holds a complete checkpoint at ``path`` (not empty, not cut short)."""
    try:
        return stored_archive_complete(backend_for(path), path)
    except (OSError, ValueError, ImportError):
        return False
