"""The daemon's own record of each committed segment, kept where no client can write it.

A restarted daemon rebuilds its index from the segments left in shared memory. What it must
believe about a generation (its header: state, number, stamp, persisted; its saver: uid, gid,
umask; its provenance: anchor, base, memory-only, dropped; its key) cannot lie in the
segment's header page alone: an admitted user's segment is that user's file, and the user
could rewrite its umask, or claim another path, before a restart. So the daemon writes these
facts to a file of its own, ``<segments>/.records/<segment>``, in a 0700 directory of the
daemon's (the segments directory is the daemon's, so the name cannot be swapped), and reads
them back from there alone. The segment's header page carries the header for the trainer's
loads.

Layout of a record file (that of the header page, then the key)::

    [0, 1024)      the segment header, as the daemon last wrote it (committed segments only)
    [1024, 3072)   the provenance record (ckptcache.server.persist.provenance)
    [3072, 4096)   the saver record (ckptcache.server.ownership)
    [4096, ...)    the key: magic, two lengths, namespace and path (UTF-8)

Each write is one ``pwrite`` of a few hundred bytes: a daemon killed with ``-9`` leaves it
whole. The record is removed when the segment stops holding a committed generation, and
written again (saver, provenance, key, then the header last) at the next commit. Its blocks
are allocated at the reservation (:func:`prepare`): the record lies on the same tmpfs as the
segments, which any local user can fill, and a commit must not fail for want of a page after
the trainer's copy is done (a full file system refuses the reservation instead).

A segment of root or of the daemon's own uid that has no record is read from its header page,
which nobody else can write; an admitted user's segment without a record is not adopted.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import Protocol

from ckptcache.format.layout import HEADER_SIZE

__all__ = ["Segment", "drop", "is_staging", "page", "prepare", "read_key", "write", "write_key"]


class Segment(Protocol):
    """What a record is kept for: the arena's segment as this module sees it."""

    @property
    def mapping(self) -> mmap.mmap:
        """The daemon's mapping of the segment."""

    @property
    def record_path(self) -> str | None:
        """The segment's record file (``None``: the daemon keeps none for it)."""

    @property
    def sealable(self) -> bool:
        """Whether the segment is an admitted user's (its header page is not ours)."""


_KEY = struct.Struct("<8sHH")
_KEY_MAGIC = b"CKPTKEY\x00"
#: The key of a staging copy (``commit_pinned``): it lives for its stager's lease, which no
#: restart keeps, so a restarted daemon reclaims it instead of adopting it.
_STAGING_MAGIC = b"CKPTSTG\x00"


def write(segment: Segment, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of ``segment``'s record; a segment the daemon keeps no
    record for (a test's bare mapping) keeps it in its header page, as before."""
    if segment.record_path is None:
        segment.mapping[offset : offset + len(data)] = data
        return
    fd = os.open(
        segment.record_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
    )
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def prepare(segment: Segment, namespace: str, path: str) -> None:
    """Allocate the blocks of ``segment``'s record for a commit of (``namespace``, ``path``)
    now, so that the commit's writes never meet a full file system; ``OSError`` (``ENOSPC``)
    where it is full. A record left by a reservation that is never committed is dropped with
    the segment's next header (see :meth:`~ckptcache.server.memory.arena.Segment.write_header`) or
    at the next start (a record of a segment that is not committed)."""
    if segment.record_path is None:
        return
    size = HEADER_SIZE + _KEY.size + len(namespace.encode()) + len(path.encode())
    fd = os.open(
        segment.record_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
    )
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def page(segment: Segment) -> bytes | memoryview | None:
    """What the daemon wrote about ``segment``: its record file, or the segment's header page
    where the segment is the daemon's and has no record (nobody else can write it); None for
    an admitted user's segment without one."""
    if segment.record_path is not None:
        try:
            fd = os.open(segment.record_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            pass
        else:
            try:
                data = os.pread(fd, 1 << 16, 0)
            finally:
                os.close(fd)
            return data.ljust(HEADER_SIZE, b"\0")
    if segment.sealable:
        return None
    return memoryview(segment.mapping)[:HEADER_SIZE]


def drop(segment: Segment) -> None:
    """Forget ``segment``'s record (it holds no committed generation any more)."""
    if segment.record_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.record_path)


def write_key(segment: Segment, namespace: str, path: str, *, staging: bool = False) -> None:
    """Record the (namespace, path) committed into ``segment``, and whether it is a staging
    copy (see :func:`is_staging`)."""
    ns, p = namespace.encode(), path.encode()
    magic = _STAGING_MAGIC if staging else _KEY_MAGIC
    write(segment, HEADER_SIZE, _KEY.pack(magic, len(ns), len(p)) + ns + p)


def is_staging(segment: Segment) -> bool:
    """Whether ``segment``'s record says it holds a staging copy."""
    data = page(segment) if segment.record_path is not None else None
    if data is None or len(data) < HEADER_SIZE + _KEY.size:
        return False
    return bytes(data[HEADER_SIZE : HEADER_SIZE + len(_STAGING_MAGIC)]) == _STAGING_MAGIC


def read_key(data: bytes | memoryview) -> tuple[str, str] | None:
    """The key recorded in ``data`` (a record file's bytes); None when there is none."""
    if len(data) < HEADER_SIZE + _KEY.size:
        return None
    magic, n_ns, n_path = _KEY.unpack_from(data, HEADER_SIZE)
    start = HEADER_SIZE + _KEY.size
    if magic not in (_KEY_MAGIC, _STAGING_MAGIC) or len(data) < start + n_ns + n_path:
        return None
    try:
        ns = bytes(data[start : start + n_ns]).decode()
        path = bytes(data[start + n_ns : start + n_ns + n_path]).decode()
    except UnicodeDecodeError:
        return None
    return ns, path
