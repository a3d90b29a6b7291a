"""Checkpoint names, and whether storage holds one: what every part of the client asks of a
path before (or instead of) asking the daemon."""

from __future__ import annotations

import os
from typing import Any

from ckptcache.errors import InvalidPath, PathNotAllowed
from ckptcache.format.persisted import stored_archive_complete
from ckptcache.storage import backend_for

__all__ = ["complete_in_storage", "in_storage", "is_url", "normalize_path"]


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
    return os.path.abspath(path)


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
