"""Segments of admitted users, sealed against changes of size the daemon could not survive.

An admitted user's segment is that user's file (mode 0600, in its own directory): its trainer
maps it read-write and keeps the mapping across saves, so a repeated save runs at memcpy
speed. The daemon maps it too, and a file truncated under a mapping turns the next access
into SIGBUS: a user could kill the root daemon for everyone by truncating its own segment.

The seal is the inode's append-only flag (``FS_APPEND_FL``, ``chattr +a``; tmpfs has it since
Linux 6.0). Only a process with ``CAP_LINUX_IMMUTABLE`` (a root daemon) may set or clear it,
and while it is set nobody, the owner included, can:

* shrink the file (``truncate``, ``ftruncate`` on any descriptor, even one opened before the
  seal), punch a hole in it (``fallocate``, ``madvise(MADV_REMOVE)``), or unlink or rename it;
* open it for writing, or map it shared-writable, anew (read-only opens and mappings, what a
  zero-copy load uses, are unaffected).

A mapping made before the seal keeps writing (that is how the trainer's warm mapping stays
valid): the bytes of a sealed segment remain the user's to change, its size and pages do not.
A daemon-side check after sealing (:func:`seal`) fills any hole punched and restores any
length cut before the seal, so every page the daemon maps is allocated and stays so: no
access of the daemon's can fault.

Life of an admitted user's segment (see :class:`ckptcache.server.memory.arena.Arena`)::

    created (daemon maps it) -> sealed -> unsealed for a client's save (reserve)
    -> sealed before the daemon reads it (commit, abort, a dropped connection)
    -> unsealed only to be unlinked, or adopted by a restarted daemon (re-sealed at once)

The flag is on the inode, in tmpfs: it survives a daemon crash with the segment, and the
next incarnation adopts the segment as it is.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import tempfile

from ckptcache.errors import ConfigError

__all__ = ["check_sealing", "is_sealed", "seal", "set_sealed", "unseal_tree"]

_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_APPEND_FL = 0x00000020


def _flags(fd: int) -> int:
    buf = array.array("l", [0])
    fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
    return buf[0]


def is_sealed(fd: int) -> bool:
    """Whether the file open at ``fd`` carries the seal."""
    return bool(_flags(fd) & _FS_APPEND_FL)


def set_sealed(fd: int, sealed: bool) -> None:
    """Set or clear the seal of the file open at ``fd`` (any access mode; needs
    ``CAP_LINUX_IMMUTABLE``)."""
    flags = _flags(fd)
    want = flags | _FS_APPEND_FL if sealed else flags & ~_FS_APPEND_FL
    if want != flags:
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, array.array("l", [want]))


def seal(fd: int, capacity: int) -> int:
    """Seal the file open at ``fd`` (opened with ``O_APPEND`` if writable: a sealed file
    refuses other writable opens) and make sure its first ``capacity`` bytes are allocated.

    Returns the size the file had once sealed: less than ``capacity`` means it was cut before
    the seal (the caller refuses what it held); the cut is restored, with zeros, either way.
    Raises ``OSError`` (``ENOSPC``) when the pages cannot be allocated.
    """
    set_sealed(fd, True)
    st = os.fstat(fd)
    # Every page allocated and nothing beyond: no hole (tmpfs counts allocated pages, swapped
    # ones included, in st_blocks). The usual case, checked without a walk over the pages.
    if st.st_size == capacity and st.st_blocks * 512 >= capacity:
        return st.st_size
    # A hole punched (or a tail cut) before the seal would be faulted in by the daemon's
    # first read, and fail with SIGBUS on a full tmpfs: allocate it now, as an error.
    os.posix_fallocate(fd, 0, capacity)
    return st.st_size


def check_sealing(directory: str) -> None:
    """Refuse to start with admitted users when segments in ``directory`` cannot be sealed
    (no ``CAP_LINUX_IMMUTABLE``, as in a container by default, or a file system without
    the flag)."""
    fd, path = tempfile.mkstemp(prefix=".seal-probe-", dir=directory)
    try:
        try:
            set_sealed(fd, True)
            set_sealed(fd, False)
        except OSError as e:
            why = (
                "the daemon lacks CAP_LINUX_IMMUTABLE"
                if e.errno == errno.EPERM
                else f"the file system does not support it ({e.strerror})"
            )
            raise ConfigError(
                f"allowed_uids needs segments sealed against truncation (the append-only "
                f"flag) in {directory}, but {why}. Run the daemon as root with that "
                "capability on a tmpfs (Linux 6.0 or later), or admit no other users"
            ) from e
    finally:
        os.close(fd)
        os.unlink(path)


def unseal_tree(directory: str) -> None:
    """Clear the seal of every file below ``directory`` (no links followed), so that it can
    be removed: what an operator's ``chattr -R -a`` does, for tests and tools."""
    for top, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(os.path.join(top, name), flags)
                try:
                    set_sealed(fd, False)
                finally:
                    os.close(fd)
