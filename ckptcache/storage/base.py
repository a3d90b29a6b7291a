"""The storage backend contract.

Call order for a persist (daemon side)::

    backend.cleanup(path)                      # drop debris of an earlier, interrupted attempt
    backend.write_stream(path, produce, guard=guard)  # atomic: complete object or nothing

and for a load without a daemon (client side)::

    backend.exists(path)
    backend.open_read(path)                    # a readable, seekable binary file object

and for a group load into the daemon's memory (ranges fetched in parallel)::

    backend.size(path)
    backend.read_into(path, offset, view)      # one ranged read straight into a segment

No write (``write_stream``, ``write``, ``write_bytes``) may leave a partial object visible
under ``path``: file systems write a
temporary name, fsync and rename; S3 completes a multipart upload only after every part.
Failures raise ``OSError`` subclasses (``PermissionError``, ``FileNotFoundError``, or a plain
``OSError`` carrying the cause) so the persister can classify and retry them.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

__all__ = [
    "CKPTCACHE_RECORD",
    "COMMIT_NS_KEY",
    "AlreadyStored",
    "NewerObjectExists",
    "Producer",
    "Sink",
    "StorageBackend",
    "StorageConflict",
    "StorageOptions",
    "StoredVersion",
    "WriteGuard",
    "read_range",
]

#: User-metadata key (S3) recording the commit time, in ns of the saving node's wall clock,
#: of the generation ckptcache persisted; files carry it as their mtime.
COMMIT_NS_KEY = "ckptcache-commit-ns"


#: The record every archive ckptcache persists carries (``format.persisted`` writes it): its
#: name in a file's zip directory tells a ckptcache persist from a foreign write.
CKPTCACHE_RECORD = ".ckptcache/digests.json"


class NewerObjectExists(OSError):
    """The object on storage is newer than the generation being written: it is never replaced
    (not retried: the generation is superseded)."""


class AlreadyStored(OSError):
    """The object on storage is this very generation, written by a ckptcache persist with its
    stamp (an earlier attempt whose reply was lost, or another holder of the generation): the
    write is done, and writing it again would only store a second copy (not retried; reported
    persisted)."""


class StorageConflict(OSError):
    """Another ckptcache writer replaced the object after this generation was saved, and
    nothing but wall clocks could tell which save is newer: neither is overwritten (not
    retried; reported to the user as a conflict)."""


@dataclass(frozen=True)
class StoredVersion:
    """What a backend knows of the object now at a path, cheaply (a ``stat``, a ``HEAD``)."""

    #: The commit stamp ckptcache recorded (files: the mtime it set; S3: user metadata), else
    #: the modification time; ns.
    stamp_ns: int
    #: Changes whenever the object is replaced: ``dev:ino:size:mtime`` of a file, an ETag.
    identity: str
    #: Whether a ckptcache persist wrote it (its digest record or metadata is there).
    by_ckptcache: bool = False
    #: What a conditional write names to replace only this object (an S3 ETag; "" none).
    token: str = ""

    def holds(self, stamp_ns: int) -> bool:
        """Whether this object is the generation stamped ``stamp_ns``: a ckptcache persist
        wrote it with that stamp (every holder of a generation has the same stamp, to the
        nanosecond), complete (storage makes an object visible only whole)."""
        return self.by_ckptcache and self.stamp_ns == stamp_ns


@dataclass(frozen=True)
class WriteGuard:
    """When a generation may replace the object on storage: newest wins without trusting
    wall clocks.

    ``base`` is the identity of the object that was on storage when the generation was saved
    (``""``: none; ``None``: not known, as for a segment adopted without a record). An object
    still equal to ``base`` is older than the save (it was there before): replace it. One
    written by this daemon for an older generation of the path (its stamp is in ``own``) is
    older too. One a ckptcache persist wrote with this generation's own stamp is this
    generation, complete (:class:`AlreadyStored`: not written again). Anything else
    was written after the save was made: a foreign write (a ``torch.save`` written through,
    the user) is the newer one and wins (:class:`NewerObjectExists`); another ckptcache
    writer's persist is a conflict only clocks could order (:class:`StorageConflict`),
    unless the generation's cluster had ordered it: ``seen`` is the stamp of the newest save of
    the path, on any node of the cluster, when this one began (-1: not known), so a ckptcache
    object stamped no later was a save completed before this one, older whenever it landed.
    Without a ``base`` the stamps decide, as clocks allow.
    """

    stamp_ns: int
    base: str | None = None
    own: frozenset[int] = frozenset()
    #: Stamps of newer generations of the path this daemon holds: one of them on storage
    #: makes this generation the older one.
    newer: frozenset[int] = frozenset()
    seen: int = -1

    def check(self, path: str, current: StoredVersion | None) -> None:
        """Raise unless the generation may replace ``current`` (``None``: nothing there)."""
        if current is None or current.identity == self.base:
            return
        if current.holds(self.stamp_ns):
            raise AlreadyStored(
                f"{path} holds this generation already (stamped {self.stamp_ns} ns)"
            )
        if current.stamp_ns == self.stamp_ns or current.stamp_ns in self.own:
            return
        if current.by_ckptcache and 0 <= current.stamp_ns <= self.seen:
            return  # a save this one followed, persisted after this one began
        if current.stamp_ns in self.newer:
            raise NewerObjectExists(f"{path} holds a newer generation saved on this node")
        if self.base is None:
            if current.stamp_ns > self.stamp_ns:
                raise NewerObjectExists(
                    f"{path} is newer on storage (stamped {current.stamp_ns} ns) than this "
                    f"generation ({self.stamp_ns} ns)"
                )
            return
        if current.by_ckptcache:
            raise StorageConflict(
                f"{path} was persisted by another ckptcache writer after this save was made "
                "(a save of the same path on another node, or by another daemon); only wall "
                "clocks could tell which is newer, so neither replaces the other. Save it "
                "again to make one the newest"
            )
        raise NewerObjectExists(
            f"{path} was replaced on storage after this save was made (by a write outside "
            "the cache, such as a save written through): that write is the newer one"
        )


#: Takes the next piece of an object being streamed to storage (in order).
Sink = Callable[[bytes | memoryview], None]
#: Streams a whole object into the sink it is given (and may raise to abandon the write).
Producer = Callable[[Sink], None]


#: Bytes :func:`read_range` reads at a time.
_PIECE = 16 << 20


def read_range(source: int, offset: int, size: int) -> Iterator[bytes]:
    """The ``size`` bytes at ``offset`` of file descriptor ``source``, in pieces of at most
    16 MiB; raises ``OSError`` if the source ends first."""
    done = 0
    while done < size:
        piece = os.pread(source, min(_PIECE, size - done), offset + done)
        if not piece:
            raise OSError(f"source ended after {done} of {size} bytes")
        done += len(piece)
        yield piece


@dataclass(frozen=True)
class StorageOptions:
    """Backend settings from the daemon config (S3 endpoint and tuning)."""

    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_part_size: int = 64 << 20
    s3_max_concurrency: int = 4
    #: The most requests one backend has in flight at once (the larger of
    #: ``s3_max_concurrency`` and a group read's streams): the client's connection pool is
    #: sized for it, so no stream waits for or discards a connection.
    s3_connections: int = 4
    #: Attempts made inside one backend call for transient S3 errors (botocore's own retries).
    s3_attempts: int = 3


class StorageBackend(abc.ABC):
    """One family of destinations (a URL scheme)."""

    def write(
        self, path: str, source: int, offset: int, size: int, *, guard: WriteGuard | None = None
    ) -> None:
        """Atomically make ``size`` bytes at ``offset`` of file descriptor ``source`` the
        content of ``path`` (creating missing parent directories).

        With a ``guard``, the object already at ``path`` is replaced only if
        :meth:`WriteGuard.check` allows it (checked before the write and again right before
        it becomes visible), and the new object records ``guard.stamp_ns`` (see
        :meth:`commit_time_ns`). (Default: the range read in pieces into
        :meth:`write_stream`, which keeps these promises; a source that ends early raises
        ``OSError`` and nothing becomes visible.)"""

        def produce(sink: Sink) -> None:
            for piece in read_range(source, offset, size):
                sink(piece)

        self.write_stream(path, produce, guard=guard)

    def version(self, path: str) -> StoredVersion | None:
        """The object now at ``path`` (``None`` when absent), for :class:`WriteGuard`.
        Backends that cannot tell (generic fsspec) return ``None``."""
        return None

    def commit_time_ns(self, path: str) -> int | None:
        """When the object at ``path`` was committed (ns), ``None`` when absent or unknown:
        the recorded commit time of a ckptcache persist, else the modification time."""
        return None

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        """Atomically store ``data`` at ``path``."""

    def write_stream(
        self, path: str, produce: Producer, *, guard: WriteGuard | None = None
    ) -> None:
        """Atomically store what ``produce`` feeds its sink, in order; if ``produce`` raises,
        nothing becomes visible under ``path``. Backends that record commit stamps (files,
        S3) honour ``guard`` as :meth:`write` does. (Default: collect, then
        :meth:`write_bytes`; no guard.)"""
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
