"""Local files written with gaps that a copy from another file fills: a stream writes what
changed, the kernel copies what did not (``copy_file_range``: a reflink where the file
system shares blocks, XFS, Btrfs, NFS 4.2 server-side copy; an in-kernel copy elsewhere).

Call order: :func:`gapped_stream_fill` runs the producer with a sink and a ``skip``, then
hands the file to ``finish``, which fills the gaps (:func:`copy_range`, or a plain
``pwrite`` where a copy is refused) and checks them (:func:`read_back`) before the caller's
``fsync`` and rename. The source file is only read: copies never change it, and the new
file shares nothing with it that a later delete of the source could take away.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable, Iterator

from ckptcache.storage.base import Sink
from ckptcache.storage.direct import DirectWriter, direct_enabled, open_direct
from ckptcache.storage.writeback import BoundedWriteback

__all__ = [
    "COPY_ENV",
    "COPY_REFUSED",
    "GappedProducer",
    "Skip",
    "copy_pays",
    "copy_range",
    "gapped_stream_fill",
    "read_back",
    "server_side_copy",
    "shares_blocks",
]

#: Answers of ``copy_file_range`` that mean "not between these files" (other file systems,
#: no such call, a file system that refuses it): the range is written plainly instead.
COPY_REFUSED = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}
)
#: Bytes one ``copy_file_range`` call is asked for (the kernel may copy fewer).
_COPY_STEP = 1 << 30
#: Bytes read at a time when a range is read back.
_READ_STEP = 8 << 20

#: ``FICLONERANGE``: ``_IOW(0x94, 13, struct file_clone_range)``.
_FICLONERANGE = 0x4020940D
#: ``statfs.f_type`` of the network file systems whose ``copy_file_range`` is a copy made by
#: the server (NFS 4.2, SMB): the bytes never cross the wire.
_SERVER_COPY = frozenset({0x6969, 0xFF534D42, 0xFE534D42})
#: Environment switch: ``always`` copies where the file system neither shares blocks nor
#: copies on its server (an in-kernel copy: every byte still written, the source read too).
COPY_ENV = "CKPTCACHE_INCREMENTAL_COPY"

Skip = Callable[[int], None]
#: Streams the file into the sink, calling skip for each gap it leaves.
GappedProducer = Callable[[Sink, Skip], None]


def copy_range(source: int, dest: int, src_offset: int, dest_offset: int, size: int) -> None:
    """Copy ``size`` bytes at ``src_offset`` of ``source`` to ``dest_offset`` of ``dest`` in
    the kernel. Raises ``OSError`` (a refusal: its errno in :data:`COPY_REFUSED`; a source
    that ends early: ``ENODATA``)."""
    done = 0
    while done < size:
        n = os.copy_file_range(
            source, dest, min(_COPY_STEP, size - done), src_offset + done, dest_offset + done
        )
        if n == 0:
            raise OSError(errno.ENODATA, f"the source ended after {done} of {size} bytes")
        done += n


def shares_blocks(source: int, dest: int) -> bool:
    """Whether the file system shares blocks between ``source`` and ``dest`` (a reflink):
    their first block is cloned (``FICLONERANGE``) into ``dest``, which the caller then writes
    over (a shared block is copied on write; ``source`` never changes)."""
    arg = struct.pack("=qQQQ", source, 0, 4096, 0)
    try:
        fcntl.ioctl(dest, _FICLONERANGE, arg)
    except OSError:
        return False
    return True


def _fs_type(fd: int) -> int | None:
    """``statfs.f_type`` of the file system holding ``fd`` (None where it cannot be read)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
        if libc.fstatfs(fd, buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(struct.unpack_from("l", buf.raw)[0]) & 0xFFFFFFFF


def server_side_copy(fd: int) -> bool:
    """Whether ``copy_file_range`` on the file system of ``fd`` is a copy on its server."""
    return _fs_type(fd) in _SERVER_COPY


def copy_pays(source: int, dest: int) -> bool:
    """Whether copying ranges from ``source`` into ``dest`` saves writing them: the file
    system shares blocks, or copies on its server; or :data:`COPY_ENV` is ``always``. An
    in-kernel copy on a local file system that does neither writes every byte anyway and
    reads the source too (slower than writing from memory)."""
    if os.environ.get(COPY_ENV, "").strip().lower() == "always":
        return True
    return shares_blocks(source, dest) or server_side_copy(dest)


def read_back(fd: int, offset: int, size: int, buf: memoryview) -> Iterator[memoryview]:
    """The ``size`` bytes at ``offset`` of ``fd`` as they are in the file now, in pieces read
    into ``buf`` (each valid until the next is read); raises ``OSError`` if the file ends
    first."""
    done = 0
    while done < size:
        want = buf[: min(len(buf), size - done)]
        n = os.preadv(fd, [want], offset + done)
        if n == 0:
            raise OSError(errno.ENODATA, f"the file ended after {done} of {size} bytes")
        yield want[:n]
        done += n


class _GappedBuffered:
    """Buffered writes in order, with gaps: bounded write-back as for any streamed file."""

    def __init__(self, fd: int):
        self.fd = fd
        self.writeback = BoundedWriteback(fd)

    def write(self, data: bytes | memoryview) -> None:
        self.writeback.write(data)

    def skip(self, n: int) -> None:
        os.lseek(self.fd, n, os.SEEK_CUR)
        self.writeback.offset += n


def _clear_direct(fd: int) -> None:
    """Make ``fd`` take unaligned writes again (the gaps are filled through it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if hasattr(os, "O_DIRECT") and flags & os.O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def gapped_stream_fill(
    produce: GappedProducer, finish: Callable[[int], None]
) -> Callable[[int], None]:
    """A ``fill(fd)`` that writes what ``produce`` streams, leaving the gaps it skips
    (``O_DIRECT`` where the file system takes it, as
    :func:`~ckptcache.storage.fs.direct_stream_fill`; gaps then start and end on block
    boundaries), then calls ``finish(fd)`` to fill and check them."""

    def fill(fd: int) -> None:
        if direct_enabled() and open_direct(fd):
            writer = DirectWriter(fd)
            try:
                produce(writer.write, writer.skip)
            except BaseException:
                writer.abort()
                raise
            writer.close()
            _clear_direct(fd)
        else:
            buffered = _GappedBuffered(fd)
            produce(buffered.write, buffered.skip)
        finish(fd)

    return fill
