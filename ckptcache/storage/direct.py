"""Direct writes (``O_DIRECT``) for local files: large runs go from the caller's pages to the
disk with no copy into the page cache.

A buffered write costs the kernel a copy of every byte into the page cache (about 1 s of
system time per 2 GiB on this project's test VM: the persist's main cost). With ``O_DIRECT``
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

import numpy as np

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


class DirectWriter:
    """Writes pieces in file order to ``fd`` (opened, ``O_DIRECT`` set by :func:`open_direct`);
    call :meth:`close` after the last piece (writes the tail, sets the file's length)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._map = mmap.mmap(-1, BOUNCE)  # page-aligned
        self._bounce = memoryview(self._map)
        self._written = 0  # the file is written up to here (a block boundary while direct)
        self._pending = 0  # bytes in the bounce buffer, the file's next ones after _written
        self._buffered: BoundedWriteback | None = None  # set once direct writes are refused
        self.direct_bytes = 0  # written straight from the caller's pages

    @property
    def buffered(self) -> bool:
        """Whether the file system refused direct writes (the rest went buffered)."""
        return self._buffered is not None

    def write(self, data: bytes | memoryview) -> None:
        """Take the next ``len(data)`` bytes of the file."""
        piece = memoryview(data).cast("B")
        if self._buffered is not None:
            self._buffered.write(piece)
            return
        if len(piece) >= _DIRECT_MIN:
            lead = (-(self._written + self._pending)) % BLOCK  # bytes to the next block
            if (_address(piece) + lead) % BLOCK == 0:
                body = (len(piece) - lead) // BLOCK * BLOCK
                self._copy(piece[:lead])
                self._flush()  # the bounce buffer holds whole blocks now: it is emptied
                if self._buffered is not None:
                    self._buffered.write(piece[lead:])
                    return
                self._direct(piece[lead : lead + body])
                piece = piece[lead + body :]
        self._copy(piece)

    def close(self) -> None:
        """Write what is left (its last block padded with zeros, then cut off by
        ``ftruncate``); releases the bounce buffer."""
        try:
            if self._buffered is None and self._pending:
                size = self._written + self._pending
                padded = -(-self._pending // BLOCK) * BLOCK
                self._bounce[self._pending : padded] = bytes(padded - self._pending)
                self._write_at(self._bounce[:padded], self._written)
                os.ftruncate(self.fd, size)
                self._pending = 0
        finally:
            self.release()

    def release(self) -> None:
        """Free the bounce buffer (the write failed: nothing more is written)."""
        self._bounce.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a slice lives on in an error's traceback: unmapped when it is collected

    def _copy(self, piece: memoryview) -> None:
        while piece:
            if self._buffered is not None:  # refused on the way: the rest goes buffered
                self._buffered.write(piece)
                return
            n = min(len(piece), BOUNCE - self._pending)
            self._bounce[self._pending : self._pending + n] = piece[:n]
            self._pending += n
            piece = piece[n:]
            if self._pending == BOUNCE:
                self._flush()

    def _flush(self) -> None:
        """Write the bounce buffer's whole blocks; keep the rest (under a block) at its start
        (or, once writes are buffered, write all of it)."""
        whole = self._pending // BLOCK * BLOCK
        if not whole:
            return
        rest = self._pending - whole
        if self._write_at(self._bounce[:whole], self._written):
            self._written += whole
            self._bounce[:rest] = self._bounce[whole : whole + rest]
            self._pending = rest
        else:
            assert self._buffered is not None
            self._buffered.write(self._bounce[whole : whole + rest])
            self._pending = 0

    def _direct(self, piece: memoryview) -> None:
        assert self._pending == 0
        if self._write_at(piece, self._written):
            self.direct_bytes += len(piece)
        self._written += len(piece)

    def _write_at(self, view: memoryview, start: int) -> bool:
        """Write ``view`` at ``start`` directly; on ``EINVAL`` switch the file to buffered
        writes and write it that way (False). Other errors (ENOSPC, EIO) are raised."""
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], start + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._go_buffered(start + done, f"direct write refused ({e.strerror})")
                assert self._buffered is not None
                self._buffered.write(view[done:])
                return False
        return True

    def _go_buffered(self, at: int, why: str) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        os.lseek(self.fd, at, os.SEEK_SET)
        buffered = BoundedWriteback(self.fd)
        # Write-back is started and waited for from here on (what is before went direct).
        buffered.offset = buffered.started = buffered.settled = at
        self._buffered = buffered
        _count_fallback(why)
