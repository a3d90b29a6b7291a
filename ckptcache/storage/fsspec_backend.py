"""Any other fsspec file system: write to a temporary name, then move it into place."""

from __future__ import annotations

import secrets
from typing import Any, BinaryIO

from ckptcache._atomic import publish
from ckptcache.storage.base import Producer, StorageBackend, WriteGuard

__all__ = ["FsspecBackend"]


class FsspecBackend(StorageBackend):
    """A file system resolved by ``fsspec.core.url_to_fs`` (gcs://, abfs://, memory://, ...)."""

    def _fs(self, path: str) -> tuple[Any, str]:
        import fsspec

        return fsspec.core.url_to_fs(path)

    def _atomic(self, path: str, produce: Producer) -> None:
        fs, real = self._fs(path)
        head, tail = real.rsplit("/", 1) if "/" in real else ("", real)
        tmp = f"{head}/.{tail}.ckptcache-tmp-{secrets.token_hex(4)}" if head else f".{tail}.tmp"
        if head:
            fs.makedirs(head, exist_ok=True)

        def write(name: str) -> None:
            with fs.open(name, "wb") as f:
                produce(f.write)

        publish(tmp, real, write, fs.mv, fs.rm)

    # ``write`` is the base's: the range read in pieces into write_stream.

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        self._atomic(path, lambda sink: sink(bytes(data)))

    def write_stream(
        self, path: str, produce: Producer, *, guard: WriteGuard | None = None
    ) -> None:
        """Streamed to a temporary name, then moved into place. Generic file systems record
        no commit stamp: ``guard`` is not checked here."""
        self._atomic(path, produce)

    def exists(self, path: str) -> bool:
        fs, real = self._fs(path)
        return bool(fs.isfile(real))

    def open_read(self, path: str) -> BinaryIO:
        fs, real = self._fs(path)
        if not fs.isfile(real):
            raise FileNotFoundError(path)
        return fs.open(real, "rb")  # type: ignore[no-any-return]

    def size(self, path: str) -> int:
        fs, real = self._fs(path)
        if not fs.isfile(real):
            raise FileNotFoundError(path)
        return int(fs.size(real))

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        fs, real = self._fs(path)
        with fs.open(real, "rb") as f:
            f.seek(offset)
            while view:
                chunk = f.read(len(view))
                if not chunk:
                    raise OSError(f"{path} ended early")
                view[: len(chunk)] = chunk
                view = view[len(chunk) :]

    def delete(self, path: str) -> None:
        fs, real = self._fs(path)
        if fs.exists(real):
            fs.rm(real)
