"""Publish a file whole or not at all: write a temporary name, then rename it into place.

A reader sees the old file or the complete new one, never a partial write, and a failed write
leaves nothing behind. The daemon's persist path has its own, stricter variant
(``O_TMPFILE`` + ``linkat`` relative to a held directory:
:mod:`ckptcache.server.persist.safe_write`);
everything else that writes files goes through here. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["atomic_write", "publish", "temp_name"]


def temp_name(path: str) -> str:
    """A fresh temporary name next to ``path`` (same directory, so the rename stays atomic)."""
    return f"{path}.ckptcache-{uuid.uuid4().hex[:8]}.tmp"


def publish(
    tmp: str,
    path: str,
    write: Callable[[str], None],
    move: Callable[[str, str], object],
    remove: Callable[[str], object],
) -> None:
    """The protocol on any file system: ``write(tmp)``, then ``move(tmp, path)``; on any
    failure (interrupts included) ``remove(tmp)`` best-effort and re-raise.

    :func:`atomic_write` is this on the local file system; the fsspec backend passes its
    file system's ``mv``/``rm``.
    """
    try:
        write(tmp)
        move(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            remove(tmp)
        raise


def atomic_write(
    path: str,
    write: Callable[[BinaryIO], object],
    *,
    tmp: str | None = None,
    fsync: bool = True,
    mode: int = 0o666,
    exclusive: bool = False,
) -> None:
    """Write ``path`` through ``write(file)`` atomically (temp name, optional fsync, rename).

    ``tmp`` names the temporary file (default :func:`temp_name`): callers that reclaim a dead
    writer's leftovers by name pass their own. It is created with ``mode`` (before the umask);
    a leftover of the same name is truncated, or with ``exclusive`` refused
    (``FileExistsError``). ``fsync=False`` suits tmpfs, where there is no disk to reach.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)

    def write_tmp(name: str) -> None:
        fd = os.open(name, flags, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    publish(tmp or temp_name(path), path, write_tmp, os.replace, os.unlink)
