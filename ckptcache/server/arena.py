"""The arena: segment files in shared memory, a free pool for reuse, and the memory budget.

Segment files are created with ``fallocate`` (pages allocated up front, so a full tmpfs fails
here with a clear error instead of SIGBUS in a trainer mid-copy) and are reused across
generations: a client that keeps its mapping of a reused segment writes at memcpy speed.

The arena never holds more than ``limit`` bytes of segment files. It is not thread-safe on its
own; the daemon core calls it under its lock.

Names are unique per daemon incarnation (``<incarnation>-<counter>``) so that a client's cached
mapping can never silently point at a different file that reused a name.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptcache.layout import (
    HEADER_SIZE,
    SEGMENT_GRANULE,
    DigestState,
    SegmentHeader,
    SegmentState,
    align,
)
from ckptcache.shm import mapped_by_others

__all__ = ["Arena", "Segment"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Segment:
    """One segment file and the daemon's own mapping of it."""

    name: str
    path: str
    capacity: int
    mapping: mmap.mmap
    #: Found on disk at startup: clients of an earlier incarnation may still map it, so it is
    #: unlinked rather than reused once free (unlinking never disturbs an existing mapping).
    inherited: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def read_header(self) -> SegmentHeader:
        """Decode the header from the daemon's mapping."""
        return SegmentHeader.unpack(memoryview(self.mapping)[:HEADER_SIZE])

    def write_header(self, header: SegmentHeader) -> None:
        """Write the header; the state field lands last in one store of the packed struct."""
        packed = header.pack()
        self.mapping[: len(packed)] = packed

    def view(self) -> memoryview:
        """A memoryview of the whole segment (zero copy)."""
        return memoryview(self.mapping)


def _empty_header(state: SegmentState) -> SegmentHeader:
    return SegmentHeader(
        state, 0, HEADER_SIZE, 0, 0, 0, 0, 0, DigestState.PENDING, time.time_ns(), 0
    )


class Arena:
    """Segment files under ``directory`` within a budget of ``limit`` bytes."""

    def __init__(self, directory: str, limit: int):
        self.directory = directory
        self.limit = limit
        self.incarnation = f"{int(time.time()):x}{os.getpid():x}"
        self._counter = 0
        self.segments: dict[str, Segment] = {}
        self.free: dict[str, Segment] = {}
        os.makedirs(directory, mode=0o700, exist_ok=True)

    @property
    def used(self) -> int:
        """Bytes of all segment files (in use, reserved and free)."""
        return sum(s.capacity for s in self.segments.values())

    @property
    def free_bytes(self) -> int:
        """Bytes held by the free pool (reclaimable at once)."""
        return sum(s.capacity for s in self.free.values())

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        """Capacity of a new segment for ``nbytes``: rounded up so near sizes share segments."""
        return align(max(nbytes, HEADER_SIZE), SEGMENT_GRANULE)

    def take_free(self, nbytes: int, *, tight: bool) -> Segment | None:
        """Best-fit free segment for ``nbytes``.

        Unless ``tight`` (no room to create a new one), a segment more than twice too big is
        left alone: it would waste memory that a later large save needs.
        """
        fits = [s for s in self.free.values() if s.capacity >= nbytes]
        while fits:
            best = min(fits, key=lambda s: s.capacity)
            if not mapped_by_others(best.path):
                break
            # A load mapping outlived its pin (its connection dropped): its zero-copy tensors
            # still read this segment, so it is not reused until the mapping goes.
            fits.remove(best)
        if not fits:
            return None
        if not tight and best.capacity > 2 * self.capacity_for(nbytes):
            return None
        del self.free[best.name]
        best.write_header(_empty_header(SegmentState.WRITING))
        best.last_used = time.monotonic()
        return best

    def create(self, nbytes: int) -> Segment:
        """Create, allocate and map a new segment; raises ``OSError`` if tmpfs is full."""
        capacity = self.capacity_for(nbytes)
        self._counter += 1
        name = f"seg-{self.incarnation}-{self._counter:06d}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)
            mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        segment = Segment(name, path, capacity, mapping)
        segment.write_header(_empty_header(SegmentState.WRITING))
        self.segments[name] = segment
        return segment

    def release(self, segment: Segment) -> None:
        """Return a segment to the free pool (or unlink it if inherited from a crash)."""
        if segment.inherited:
            self.destroy(segment)
            return
        segment.write_header(_empty_header(SegmentState.FREE))
        segment.last_used = time.monotonic()
        self.free[segment.name] = segment

    def destroy(self, segment: Segment) -> None:
        """Unlink a segment and forget it."""
        self.segments.pop(segment.name, None)
        self.free.pop(segment.name, None)
        try:
            segment.mapping.close()
        except BufferError:
            # A memoryview still exports it (a persist in flight); the GC closes it later.
            pass
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass

    def shrink_free(self, needed: int) -> None:
        """Unlink free segments, least recently used first, until ``needed`` bytes fit."""
        for segment in sorted(self.free.values(), key=lambda s: s.last_used):
            if self.used + needed <= self.limit:
                return
            self.destroy(segment)

    def scan(self) -> Iterator[tuple[Segment, SegmentHeader | None]]:
        """Adopt the segment files left by an earlier incarnation.

        Yields each with its header (``None`` if unreadable); the caller keeps committed ones
        and gives the rest to :meth:`release` or :meth:`destroy`.
        """
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if not name.startswith("seg-") or not os.path.isfile(path):
                continue
            size = os.path.getsize(path)
            if size < HEADER_SIZE:
                log.error("removing segment %s: truncated to %d bytes", name, size)
                os.unlink(path)
                continue
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            segment = Segment(name, path, size, mapping, inherited=True)
            self.segments[name] = segment
            try:
                header: SegmentHeader | None = segment.read_header()
            except ValueError as e:
                log.error("segment %s has an unreadable header (%s)", name, e)
                header = None
            yield segment, header
