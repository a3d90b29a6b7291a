"""Local and NFS paths: temp file + fsync + rename, bytes moved by the kernel (sendfile)."""

from __future__ import annotations

import errno
import glob
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO

from ckptcache.storage.base import (
    CKPTCACHE_RECORD,
    AlreadyStored,
    Producer,
    StorageBackend,
    StoredVersion,
    WriteGuard,
)
from ckptcache.storage.direct import DirectWriter, direct_enabled, open_direct
from ckptcache.storage.handoff import threaded
from ckptcache.storage.writeback import BoundedWriteback

__all__ = [
    "TEMP_MARK",
    "FileBackend",
    "check_guard",
    "direct_stream_fill",
    "file_version",
    "link_unnamed",
    "open_unnamed",
    "sendfile_fill",
    "stream_fill",
]

#: Temporary names look like ``.<name>.ckptcache-tmp-<random>``: hidden, and never a
#: checkpoint name a framework would look for.
TEMP_MARK = ".ckptcache-tmp-"
_CHUNK = 1 << 30  # sendfile moves at most ~2 GiB per call
#: The digest record is the last member of a ckptcache archive: its name sits in the last
#: central-directory entry, within this many bytes of the end (zip64 records included).
_TAIL = 4096


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}{TEMP_MARK}{secrets.token_hex(4)}")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sendfile_fill(source: int, offset: int, size: int) -> Callable[[int], None]:
    """A ``fill(fd)`` that copies ``size`` bytes at ``offset`` of ``source`` in the kernel."""

    def fill(fd: int) -> None:
        done = 0
        while done < size:
            sent = os.sendfile(fd, source, offset + done, min(_CHUNK, size - done))
            if sent == 0:
                raise OSError(f"source ended after {done} of {size} bytes")
            done += sent

    return fill


def open_unnamed(directory: str, *, dir_fd: int | None = None, mode: int = 0o644) -> int | None:
    """An unnamed file (``O_TMPFILE``) in ``directory``, or None where the file system has
    none: nothing shows in the directory while bytes are written (a concurrent ``rmtree`` of
    it never trips over a temp file)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    return None


def _open_temp(directory: str, path: str) -> tuple[int, str | None]:
    """A file to write ``path``'s new content into: unnamed where possible, else a hidden
    temp name."""
    fd = open_unnamed(directory)
    if fd is not None:
        return fd, None
    tmp = _temp_name(path)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), tmp


def link_unnamed(fd: int, name: str, *, dir_fd: int | None = None) -> None:
    """Give an ``O_TMPFILE`` file a name (``linkat`` following the /proc link: a directory fd
    argument makes Python call ``linkat`` with ``AT_SYMLINK_FOLLOW`` instead of ``link``)."""
    anchor = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if dir_fd is None else None
    try:
        os.link(
            f"/proc/self/fd/{fd}", name, src_dir_fd=anchor,
            dst_dir_fd=dir_fd, follow_symlinks=True,
        )  # fmt: skip
    finally:
        if anchor is not None:
            os.close(anchor)


def file_version(
    path: str, *, dir_fd: int | None = None, inspect: bool = True
) -> StoredVersion | None:
    """The file at ``path`` (relative to ``dir_fd`` when given) as a :class:`StoredVersion`,
    ``None`` when absent; ``inspect=False`` skips reading its last page (``by_ckptcache``
    is then False). The identity leaves out ``ctime`` on purpose: a ``chmod`` or ``chown``
    by the user does not make the file a newer checkpoint."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)  # fmt: skip
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None  # no object: whatever sits there (a directory) fails the write itself
        identity = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        tail = b""
        if inspect and st.st_size:
            tail = os.pread(fd, min(_TAIL, st.st_size), max(0, st.st_size - _TAIL))
        return StoredVersion(st.st_mtime_ns, identity, CKPTCACHE_RECORD.encode() in tail)
    finally:
        os.close(fd)


def check_guard(path: str, guard: WriteGuard | None, *, dir_fd: int | None = None) -> None:
    """Raise unless ``guard`` allows replacing the file at ``path`` (see :class:`WriteGuard`).

    A file that is this generation already (:class:`AlreadyStored`) is written again: an
    earlier attempt named it and then failed, possibly at its directory's fsync, and an fsync
    through a new descriptor does not report a write-back error the failed one already
    reported. A new write and its own fsyncs prove the file durable. (On an object store the
    object is durable once visible: there it is not written again.)"""
    if guard is None:
        return
    try:
        guard.check(path, file_version(path, dir_fd=dir_fd))
    except AlreadyStored:
        return


def stream_fill(produce: Producer) -> Callable[[int], None]:
    """A ``fill(fd)`` that writes what ``produce`` streams, in order, on a writer thread
    (:func:`threaded`: the producer's work overlaps the writes), with the disk's write-back
    started as it goes and bounded (see :class:`BoundedWriteback`)."""
    return lambda fd: threaded(produce, BoundedWriteback(fd).write)


def direct_stream_fill(produce: Producer) -> Callable[[int], None]:
    """A ``fill(fd)`` like :func:`stream_fill`, but with ``O_DIRECT`` where the file system
    takes it (see :mod:`ckptcache.storage.direct`): large runs go from the producer's pages
    to the disk without a copy into the page cache. Where direct writes are off
    (``CKPTCACHE_DIRECT_IO=0``) or refused, the same bytes are written buffered."""

    def fill(fd: int) -> None:
        if not (direct_enabled() and open_direct(fd)):
            stream_fill(produce)(fd)
            return
        writer = DirectWriter(fd)
        try:
            produce(writer.write)  # copies here, writes on the writer's own thread
        except BaseException:
            writer.abort()
            raise
        writer.close()

    return fill


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class FileBackend(StorageBackend):
    """POSIX file systems (local disks, NFS, Lustre mounts)."""

    def _atomic(
        self,
        path: str,
        fill: Callable[[int], None],
        guard: WriteGuard | None = None,
    ) -> None:
        check_guard(path, guard)  # before the bytes move: a refused write costs nothing
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = _open_temp(directory, path)
        try:
            try:
                fill(fd)
                if guard is not None:
                    os.utime(fd, ns=(guard.stamp_ns, guard.stamp_ns))
                os.fsync(fd)
                if tmp is None:  # unnamed until complete: named only for the rename
                    tmp = _temp_name(path)
                    link_unnamed(fd, tmp)
            finally:
                os.close(fd)
            check_guard(path, guard)  # again right before the rename
            os.rename(tmp, path)
        except BaseException:
            try:
                if tmp is not None:
                    os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(directory)

    def write(
        self, path: str, source: int, offset: int, size: int, *, guard: WriteGuard | None = None
    ) -> None:
        self._atomic(path, sendfile_fill(source, offset, size), guard)

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        self._atomic(path, lambda fd: _write_all(fd, data))

    def write_stream(
        self, path: str, produce: Producer, *, guard: WriteGuard | None = None
    ) -> None:
        self._atomic(path, direct_stream_fill(produce), guard)

    def version(self, path: str) -> StoredVersion | None:
        return file_version(path)

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def commit_time_ns(self, path: str) -> int | None:
        try:
            return os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return None

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while view:
                n = os.preadv(fd, [view], offset)
                if n == 0:
                    raise OSError(f"{path} ended early (truncated while reading?)")
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)

    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def cleanup(self, path: str) -> None:
        head, tail = os.path.split(path)
        for leftover in glob.glob(
            os.path.join(glob.escape(head), f".{glob.escape(tail)}{TEMP_MARK}*")
        ):
            try:
                os.unlink(leftover)
            except OSError:
                pass
