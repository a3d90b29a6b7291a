"""The storage backend contract.

Call order for a persist (daemon side)::

    backend.cleanup(path)                      # drop debris of an earlier, interrupted attempt
    backend.write(path, source, offset, size)  # atomic: complete object or nothing

and for a load without a daemon (client side)::

    backend.exists(path)
    backend.open_read(path)                    # a readable, seekable binary file object

and for a group load into the daemon's memory (ranges fetched in parallel)::

    backend.size(path)
    backend.read_into(path, offset, view)      # one ranged read straight into a segment

``write`` must never leave a partial object visible under ``path``: file systems write a
temporary name, fsync and rename; S3 completes a multipart upload only after every part.
Failures raise ``OSError`` subclasses (``PermissionError``, ``FileNotFoundError``, or a plain
``OSError`` carrying the cause) so the persister can classify and retry them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

__all__ = [
    "COMMIT_NS_KEY",
    "NewerObjectExists",
    "Producer",
    "Sink",
    "StorageBackend",
    "StorageOptions",
]

#: User-metadata key (S3) recording the commit time, in ns of the saving node's wall clock,
#: of the generation ckptcache persisted; files carry it as their mtime.
COMMIT_NS_KEY = "ckptcache-commit-ns"


class NewerObjectExists(OSError):
    """The object on storage is newer than the generation being written: it is never replaced
    (not retried: the generation is superseded)."""


#: Takes the next piece of an object being streamed to storage (in order).
Sink = Callable[[bytes | memoryview], None]
#: Streams a whole object into the sink it is given (and may raise to abandon the write).
Producer = Callable[[Sink], None]


@dataclass(frozen=True)
class StorageOptions:
    """Backend settings from the daemon config (S3 endpoint and tuning)."""

    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_part_size: int = 64 << 20
    s3_max_concurrency: int = 4
    #: Attempts made inside one backend call for transient S3 errors (botocore's own retries).
    s3_attempts: int = 3


class StorageBackend(abc.ABC):
    """One family of destinations (a URL scheme)."""

    @abc.abstractmethod
    def write(
        self,
        path: str,
        source: int,
        offset: int,
        size: int,
        *,
        commit_ns: int | None = None,
    ) -> None:
        """Atomically make ``size`` bytes at ``offset`` of file descriptor ``source`` the
        content of ``path`` (creating missing parent directories).

        With ``commit_ns`` (the generation's commit time, wall-clock ns), an object already at
        ``path`` that is newer is never replaced (:class:`NewerObjectExists`), and the new
        object records ``commit_ns`` (see :meth:`commit_time_ns`)."""

    def commit_time_ns(self, path: str) -> int | None:
        """When the object at ``path`` was committed (ns), ``None`` when absent or unknown:
        the recorded commit time of a ckptcache persist, else the modification time."""
        return None

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        """Atomically store ``data`` at ``path``."""

    def write_stream(self, path: str, produce: Producer, *, commit_ns: int | None = None) -> None:
        """Atomically store what ``produce`` feeds its sink, in order; if ``produce`` raises,
        nothing becomes visible under ``path``. Backends that record commit times (files,
        S3) stamp ``commit_ns`` and raise :class:`NewerObjectExists` instead of replacing a
        newer object. (Default: collect, then :meth:`write_bytes`; no commit time.)"""
        buf = bytearray()
        produce(buf.extend)
        self.write_bytes(path, memoryview(buf))

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a complete object is visible at ``path``."""

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open ``path`` for reading; raises ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Bytes of the object at ``path``; raises ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes of ``path`` starting at ``offset`` (one ranged read)."""

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, view)`` of ``ranges`` with the bytes of ``path`` at ``offset``.

        Raises as :meth:`read_into` does (the first failure; the other views are then
        undefined). Default: one :meth:`read_into` after another; backends where requests
        are latency-bound (S3) issue them in parallel."""
        for offset, view in ranges:
            self.read_into(path, offset, view)

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path`` (missing is fine)."""

    def cleanup(self, path: str) -> None:  # noqa: B027 - optional hook
        """Remove leftovers of interrupted writes to ``path`` (temp files, open uploads)."""
