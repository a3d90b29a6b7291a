"""Storage reads for a redundancy group: one member reads the persisted archive into its
memory with parallel ranged reads, checks it as it lands (every record against the digest
record or its CRC-32, and the zip structure: nothing damaged is ever committed, whatever the
load's ``verify``), and commits it; the others chain behind it. A daemon without a cluster
uses the same reader, alone, for prefetches (:class:`ckptcache.server.restore.loads.Loads`).

Call order: :meth:`StorageReader.warm` (once, at start, in the background),
:meth:`StorageReader.in_storage` (planning) -> :meth:`StorageReader.load`
(``started()`` once the first range is requested: the node announces itself in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ckptcache.errors import CorruptCheckpoint, PathNotAllowed
from ckptcache.format.archive import count_records, parse_archive
from ckptcache.format.archive_read import read_archive
from ckptcache.format.layout import HEADER_SIZE, plan_segment
from ckptcache.format.manifest import manifest_from_archive, pack_digests
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.index import Generation
from ckptcache.server.metrics import Metrics
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.state import Incoming
from ckptcache.storage import StorageOptions, backend_for
from ckptcache.wire.states import Tier

__all__ = ["StorageReader"]

log = logging.getLogger(__name__)


def read_chunk(size: int, concurrency: int) -> int:
    """The range size of a group's storage read of ``size`` bytes on ``concurrency`` threads.

    Relays follow the contiguous prefix that has landed, and the ranges in flight share the
    storage link, so joiners trail the reader by about ``concurrency`` ranges: at most 8 MiB
    each (a quarter of the object split over the threads, at least one 1 MiB block) keeps
    that lag a small part of the read without a request per few bytes (the last ranges are
    smaller still: :func:`~ckptcache.format.prefix_read.plan_ranges`). Whole MiB: a range
    rounded up to the next block would leave a short one at the end.
    """
    return max(1, min(8, size // (4 * max(1, concurrency)) >> 20)) << 20


class StorageReader:
    """Reads a persisted archive into this node's memory for the group."""

    def __init__(
        self,
        config: DaemonConfig,
        metrics: Metrics,
        *,
        roots: PersistRoots,
        options: StorageOptions,
        receive: Callable[[Incoming], Generation],
    ):
        self.config = config
        self.metrics = metrics
        self.roots = roots
        self.options = options
        self.receive = receive

    def warm(self) -> None:
        """Build the storage clients of the persist roots and ask each root once (in the
        background, at start). Building an S3 client loads botocore's service model, about a
        second of CPU that the first restore would otherwise pay on every node at once,
        before the group's read could begin."""
        for root in self.roots.urls:  # local roots need no client
            try:
                backend_for(root, self.options).exists(root)
            except Exception as e:  # storage down at start: the first read reports it
                log.info("storage under %s not reachable yet: %s", root, e)

    def in_storage(self, path: str, newer_than: int = 0) -> bool:
        """Whether storage holds ``path`` (read only under this daemon's roots); with
        ``newer_than``, an object stamped at least that (ns): the newest save, persisted,
        or a write made after it."""
        try:
            if self.roots.root_for(path) is None:
                return False  # the daemon reads storage only under its roots
        except PathNotAllowed:
            return False
        try:
            backend = backend_for(path, self.options)
            if not newer_than:
                return backend.exists(path)
            stamp = backend.commit_time_ns(path)
            return stamp is not None and stamp >= newer_than
        except (OSError, ValueError, ImportError):
            return False

    def load(
        self, namespace: str, path: str, started: Callable[[], None], *, relayed: bool = False
    ) -> Generation:
        """Read a persisted archive into the arena with parallel ranged reads: a group's read,
        which peers relay as it lands (``relayed``), on ``group_read_streams`` (by default
        as many as raise the read's rate, up to ``s3_max_concurrency``: see
        :func:`~ckptcache.format.prefix_read.probe_streams`); a lone node's on
        ``s3_max_concurrency``."""
        cfg = self.config
        streams = cfg.group_read_streams if relayed else cfg.s3_max_concurrency
        try:
            return self._read(namespace, path, started, streams)
        except ValueError as e:  # the end records or the archive are unreadable
            if not isinstance(e, CorruptCheckpoint) or path not in str(e):  # name the file
                e = CorruptCheckpoint(
                    f"checkpoint file {path!r} is corrupt in the storage tier: {e}",
                    tier=Tier.STORAGE,
                )
            self.metrics.corrupt.labels(tier=Tier.STORAGE).inc()
            log.error("not serving %s from storage: %s", path, e)
            raise e from None

    def _read(
        self, namespace: str, path: str, started: Callable[[], None], streams: int
    ) -> Generation:
        backend = backend_for(path, self.options)
        # The stored save's stamp, which the copy keeps: a load compares it with the
        # cluster's newest save of the path (``server/cluster/truth.py``).
        stamp = backend.commit_time_ns(path) or 0
        size = backend.size(path)

        took: list[float] = []  # the end records' small reads: the store's request latency

        def read(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            t = time.perf_counter()
            backend.read_into(path, offset, memoryview(buf))
            took.append(time.perf_counter() - t)
            return bytes(buf)

        adapt = not streams  # 0: "auto"
        most = streams or self.config.s3_max_concurrency
        if adapt:
            log.info("reading %s from storage (streams: auto, at most %d)", path, most)
        else:
            log.info("reading %s from storage (%d stream(s))", path, most)
        entries = count_records(size, read)
        capacity = 256 * entries + 4096  # manifest JSON, padded to this exact size
        layout = plan_segment(size, capacity, entries)
        t0 = time.perf_counter()

        table: list[int] = []

        def chose(k: int) -> None:
            log.info("reading %s from storage on %d of at most %d stream(s)", path, k, most)

        def fill(view: memoryview, advance: Callable[[int], None]) -> None:
            started()  # registered as in flight here: joiners may chain behind us now
            # Ranges are read in parallel, each record's digest (or CRC-32) computed as its
            # bytes land; relays follow the contiguous prefix that is done. A damaged file
            # is not served.
            computed = read_archive(
                backend, path, view[:size], advance=advance, prefix_first=True,
                concurrency=most, chunk=lambda k: read_chunk(size, k),
                adapt=adapt, latency=min(took, default=0.0), chosen=chose,
            )  # fmt: skip
            parsed = parse_archive(view[:size])
            manifest = manifest_from_archive(parsed, path, namespace, size)
            encoded = manifest.to_json()
            if len(encoded) > capacity:
                raise CorruptCheckpoint(
                    f"{path!r}: manifest larger than planned", tier=Tier.STORAGE
                )
            start = layout.manifest_offset - HEADER_SIZE
            view[start : start + capacity] = encoded.ljust(capacity)
            # Digests of what storage holds (its own integrity is the storage's business).
            table.extend(computed[r.offset - HEADER_SIZE] for r in manifest.storages)
            dstart = layout.digest_offset - HEADER_SIZE
            view[dstart : dstart + 8 * len(table)] = pack_digests(table)
            advance(layout.nbytes - HEADER_SIZE)

        gen = self.receive(Incoming(
            namespace, path, layout.nbytes, layout.manifest_offset, capacity, fill,
            origin="storage", persisted=True, digests=lambda: table, content_ns=stamp,
        ))  # fmt: skip
        self.metrics.storage_reads.inc()
        log.info("read %s from storage for the group (%.0f MB/s)", path,
                 size / max(time.perf_counter() - t0, 1e-9) / 1e6)  # fmt: skip
        return gen
