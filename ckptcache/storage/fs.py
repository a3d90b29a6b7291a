"""Local and NFS paths: temp file + fsync + rename, bytes moved by the kernel (sendfile)."""

from __future__ import annotations

import glob
import os
import secrets
from collections.abc import Callable
from typing import BinaryIO

from ckptcache.storage.base import Producer, StorageBackend

__all__ = ["TEMP_MARK", "FileBackend"]

#: Temporary names look like ``.<name>.ckptcache-tmp-<random>``: hidden, and never a
#: checkpoint name a framework would look for.
TEMP_MARK = ".ckptcache-tmp-"
_CHUNK = 1 << 30  # sendfile moves at most ~2 GiB per call


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}{TEMP_MARK}{secrets.token_hex(4)}")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class FileBackend(StorageBackend):
    """POSIX file systems (local disks, NFS, Lustre mounts)."""

    def _atomic(self, path: str, fill: Callable[[int], None]) -> None:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = _temp_name(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(directory)

    def write(self, path: str, source: int, offset: int, size: int) -> None:
        def fill(fd: int) -> None:
            done = 0
            while done < size:
                sent = os.sendfile(fd, source, offset + done, min(_CHUNK, size - done))
                if sent == 0:
                    raise OSError(f"source ended after {done} of {size} bytes")
                done += sent

        self._atomic(path, fill)

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        self._atomic(path, lambda fd: _write_all(fd, data))

    def write_stream(self, path: str, produce: Producer) -> None:
        self._atomic(path, lambda fd: produce(lambda chunk: _write_all(fd, chunk)))

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

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
