"""Direct writes (``O_DIRECT``) for local files: large runs go from the caller's pages to the
disk with no copy into the page cache.

A buffered write costs the kernel a copy of every byte into the page cache, the persist's
main cost (``benchmarks/persist/README.md``). With ``O_DIRECT``
the disk reads the bytes from the caller's memory, but every write must start at a file
offset, from an address and with a length that are multiples of the block size
(:data:`BLOCK`). :class:`DirectWriter` takes pieces in file order and:

* writes a large piece whose address lies at the same place in its page as its file offset
  (a segment's archive does: the segment is page-aligned ``mmap`` and its payload starts at
  a page, so the file image is the segment's bytes at a fixed offset) straight from its pages;
* copies everything else (headers, data descriptors with their CRC-32s, the central
  directory, a large piece's unaligned edges) into a small page-aligned bounce buffer
  (``mmap``), written in whole blocks;
* pads the last block with zeros and cuts the file back to its length (``ftruncate``).

The caller's thread does the copying; the writes run on a writer thread of their own
(:class:`~ckptcache.storage.handoff.Handoff`), each a bounce buffer's blocks and the large
piece after them in one ``pwritev``. A direct write holds its thread until the disk has the
bytes, so every copy made on the writing thread would be time the disk sits idle.

Where the file system refuses a direct write (``EINVAL``: tmpfs on older kernels, some
FUSE/NFS mounts, a block size over :data:`BLOCK`), the writer clears ``O_DIRECT`` and writes
that piece and the rest buffered, with bounded write-back (see
:class:`~ckptcache.storage.writeback.BoundedWriteback`): the file's bytes are the same.
Durability is unchanged: the caller's ``fsync`` flushes the disk's cache and the metadata.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from ckptcache.storage.handoff import Handoff
from ckptcache.storage.writeback import BoundedWriteback

__all__ = ["BLOCK", "BOUNCE", "DIRECT_ENV", "DirectWriter", "direct_enabled", "open_direct"]

log = logging.getLogger(__name__)

#: Alignment of every direct write (file offset, address, length). 4096 covers the logical
#: block size of common disks; a device with larger blocks refuses, and the writer falls back.
BLOCK = 4096
#: Bounce buffer size: the pieces the writer copies are gathered into writes of this size.
BOUNCE = 8 << 20
#: Pieces at least this long go straight from their pages (shorter ones are cheaper copied).
_DIRECT_MIN = 1 << 20
#: Environment switch: ``0`` turns direct writes off (every file is written buffered).
DIRECT_ENV = "CKPTCACHE_DIRECT_IO"

#: How many files fell back to buffered writes since the process started (for tests, logs).
fallbacks = 0


def direct_enabled() -> bool:
    """Whether direct writes are on (:data:`DIRECT_ENV` is unset or not ``0``)."""
    return os.environ.get(DIRECT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def open_direct(fd: int) -> bool:
    """Set ``O_DIRECT`` on the open file ``fd``; False where the file system refuses."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _count_fallback(f"O_DIRECT refused on open ({e.strerror})")
        return False
    return True


def _count_fallback(why: str) -> None:
    global fallbacks
    fallbacks += 1
    log.debug("direct write off for this file, writing buffered: %s", why)


def _address(piece: memoryview) -> int:
    """The address of ``piece``'s first byte (read-only buffers too)."""
    return int(np.frombuffer(piece, np.uint8).ctypes.data)


@dataclass(eq=False)
class _Bounce:
    """A page-aligned buffer the small pieces are copied into."""

    map: mmap.mmap = field(default_factory=lambda: mmap.mmap(-1, BOUNCE))

    def __post_init__(self) -> None:
        self.view = memoryview(self.map)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass  # a slice lives on in an error's traceback: unmapped when it is collected


@dataclass
class _Run:
    """Contiguous bytes for the writer thread: ``views`` at file ``offset``, whole blocks each;
    ``bounce`` goes back to the spares once written."""

    views: list[memoryview]
    offset: int
    bounce: _Bounce | None
    direct: int  # bytes of ``views`` that are the caller's pages

    def cost(self) -> int:
        """What the run holds against the queue's bound: a bounce buffer counts whole (so at
        most ``QUEUED // BOUNCE + 1`` of them exist), the caller's pages by their length."""
        return (BOUNCE if self.bounce is not None else 0) + self.direct


class DirectWriter:
    """Writes pieces in file order to ``fd`` (opened, ``O_DIRECT`` set by :func:`open_direct`);
    call :meth:`close` after the last piece (writes the tail, waits for every write, sets the
    file's length), or :meth:`abort` if the producer failed. A piece must not change once
    passed (it may be written after the call returns)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._spares: list[_Bounce] = []  # written and free again (the writer thread returns them)
        self._made: list[_Bounce] = []
        self._bounce = self._take()
        self._offset = 0  # file offset of the bounce buffer's first byte (a block boundary)
        self._pending = 0  # bytes in the bounce buffer
        self._buffered: BoundedWriteback | None = None  # set once direct writes are refused
        self.direct_bytes = 0  # written straight from the caller's pages
        self._handoff: Handoff[_Run] = Handoff(self._write_run, size=_Run.cost)

    @property
    def buffered(self) -> bool:
        """Whether the file system refused direct writes (the rest went buffered)."""
        return self._buffered is not None

    def write(self, data: bytes | memoryview) -> None:
        """Take the next ``len(data)`` bytes of the file."""
        piece = memoryview(data).cast("B")
        if len(piece) >= _DIRECT_MIN:
            lead = (-(self._offset + self._pending)) % BLOCK  # bytes to the next block
            if (_address(piece) + lead) % BLOCK == 0:
                body = (len(piece) - lead) // BLOCK * BLOCK
                self._copy(piece[:lead])  # the bounce buffer holds whole blocks now
                self._submit(piece[lead : lead + body])
                piece = piece[lead + body :]
        self._copy(piece)

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` bytes of the file without writing them (the caller fills
        them afterwards, e.g. by a copy in the kernel). Both ends must be block boundaries:
        a direct write covers whole blocks, so one sharing a block with the gap would
        overwrite what the caller put there."""
        if (self._offset + self._pending) % BLOCK or n % BLOCK:
            raise ValueError(f"a skip must cover whole blocks of {BLOCK} bytes")
        self._submit(None)  # what comes before the gap, in whole blocks
        self._offset += n

    def close(self) -> None:
        """Write what is left (its last block padded with zeros, then cut off by
        ``ftruncate``) and wait for every write; raises the first write's error. Releases
        the bounce buffers."""
        try:
            size = self._offset + self._pending
            padded = -(-self._pending // BLOCK) * BLOCK
            self._bounce.view[self._pending : padded] = bytes(padded - self._pending)
            self._pending = padded
            self._submit(None)
            self._handoff.finish()
            os.ftruncate(self.fd, size)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop: drop what is queued, wait for the write under way, free the bounce buffers
        (the write failed, or is over: nothing more is written)."""
        self._handoff.abort()
        for bounce in self._made:
            bounce.close()
        self._made.clear()
        self._spares.clear()

    def _take(self) -> _Bounce:
        if self._spares:
            return self._spares.pop()
        bounce = _Bounce()
        self._made.append(bounce)
        return bounce

    def _copy(self, piece: memoryview) -> None:
        while piece:
            n = min(len(piece), BOUNCE - self._pending)
            self._bounce.view[self._pending : self._pending + n] = piece[:n]
            self._pending += n
            piece = piece[n:]
            if self._pending == BOUNCE:
                self._submit(None)

    def _submit(self, direct: memoryview | None) -> None:
        """Hand the bounce buffer's bytes (whole blocks) and then ``direct`` to the writer
        thread as one run; the next small pieces go into a spare bounce buffer."""
        views = []
        bounce = None
        if self._pending:
            bounce = self._bounce
            views.append(bounce.view[: self._pending])
        if direct is not None and len(direct):
            views.append(direct)
        if not views:
            return
        run = _Run(views, self._offset, bounce, len(direct) if direct is not None else 0)
        self._offset += self._pending + run.direct
        self._handoff.put(run)
        if bounce is not None:  # taken after the wait: one of the queued ones may be free
            self._bounce, self._pending = self._take(), 0

    def _write_run(self, run: _Run) -> None:
        """On the writer thread: write ``run`` directly; on ``EINVAL`` switch the file to
        buffered writes and write the rest that way. Other errors (ENOSPC, EIO) are raised
        (on the producer's side, by the handoff)."""
        views, at = run.views, run.offset
        while views and self._buffered is None:
            try:
                done = os.pwritev(self.fd, views, at)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._go_buffered(at, f"direct write refused ({e.strerror})")
                break
            at += done
            views = _after(views, done)
        if self._buffered is None:
            self.direct_bytes += run.direct
        else:
            if self._buffered.offset != at:  # past a gap left by :meth:`skip`
                os.lseek(self.fd, at, os.SEEK_SET)
                self._buffered.offset = at
            for view in views:
                self._buffered.write(view)
        if run.bounce is not None:
            self._spares.append(run.bounce)

    def _go_buffered(self, at: int, why: str) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        os.lseek(self.fd, at, os.SEEK_SET)
        buffered = BoundedWriteback(self.fd)
        # Write-back is started and waited for from here on (what is before went direct).
        buffered.offset = buffered.started = buffered.settled = at
        self._buffered = buffered
        _count_fallback(why)


def _after(views: list[memoryview], done: int) -> list[memoryview]:
    """``views`` less their first ``done`` bytes (a short write)."""
    rest = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest
