"""Reading a stored checkpoint archive into memory with its integrity checked as it lands.

Two readers use it: the daemon's storage read for its group (into a segment) and the client's own
read of a stored file (into private memory, :func:`ckptcache.codec.stored_load.load_from_storage`
and :func:`ckptcache.open`). Checking after the read would be a second pass:
:func:`~ckptcache.format.persisted.check_archive` over all of it (the xxh3 of every record, and
zip's CRC-32 for archives that carry no digest record, as plain ``torch.save`` files do), which on
one core costs more than the read. Here the checks ride on the reads:

1. the archive's tail (end records and central directory) is read first, so every record's
   place and name are known before the bulk arrives, and with them whether CRC-32 is needed
   (no digest record) or not;
2. each reader thread reads its range and, while those bytes are still in cache, takes the
   CRC-32 of each block of it (``zlib`` releases the interpreter lock, so the threads
   checksum in parallel); a record's CRC is combined from its blocks
   (:func:`~ckptcache.format.crc.crc32_combine`) plus its unaligned ends;
3. whichever thread extends the contiguous prefix of landed bytes also advances an xxh3 of
   the record being crossed, in file order (a streaming hash, fed as the bytes land);
4. at the end :func:`check_archive` runs its usual structural checks and compares the
   recorded digests (or CRC-32s) with these values instead of hashing again.

Nothing is weakened: every record is hashed and compared before the copy is served, and a
damaged or truncated file is refused as before.
"""

from __future__ import annotations

import functools
import io
import struct
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import PARSE_ERRORS, ViewReader
from ckptcache.format.crc import crc32, crc32_combine
from ckptcache.format.persisted import DIGESTS_MEMBER, central_offset, check_archive
from ckptcache.format.prefix_read import PrefixReads, plan_ranges, probe_streams
from ckptcache.storage import StorageBackend
from ckptcache.storage.reporting import read_into_reporting

__all__ = ["BLOCK", "read_archive"]

#: CRC granule of the reader threads: a record's CRC-32 combines one value per block.
BLOCK = 1 << 20
_TAIL = 64 << 10
_LOCAL_FIXED = 30


def _corrupt(path: str, what: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"checkpoint file {path!r} is corrupt in the storage tier: {what}", tier="storage"
    )


@dataclass
class _Record:
    header_offset: int
    size: int
    data_offset: int = -1  # from the local header, once it has landed
    xxh: xxhash.xxh3_64 = field(default_factory=xxhash.xxh3_64)
    hashed: int = 0  # bytes of the data fed to ``xxh``


class _Follower:
    """Hashes records in file order as the contiguous prefix of landed bytes grows."""

    def __init__(self, view: memoryview, records: list[_Record], path: str):
        self.view, self.records, self.path = view, records, path
        self.prefix = 0
        self.digests: dict[int, int] = {}  # data offset -> xxh3
        self._next = 0  # index of the record being hashed
        self._lock = threading.Lock()  # one hasher at a time; others leave their progress

    def follow(self) -> None:
        """Hash what :attr:`prefix` (set by the caller, under its lock) completes, unless
        another thread is hashing: that one picks the new prefix up before it stops."""
        while self._lock.acquire(blocking=False):
            try:
                target = self.prefix
                self._hash_to(target)
            finally:
                self._lock.release()
            if self.prefix == target:  # nobody moved it while we hashed
                return

    def _hash_to(self, end: int) -> None:
        while self._next < len(self.records):
            record = self.records[self._next]
            if record.data_offset < 0:
                fixed_end = record.header_offset + _LOCAL_FIXED
                if fixed_end > end:
                    return
                local = bytes(self.view[record.header_offset : fixed_end])
                if local[:4] != b"PK\x03\x04":
                    raise _corrupt(self.path, f"bad local header at offset {record.header_offset}")
                name_len, extra_len = struct.unpack_from("<HH", local, 26)
                record.data_offset = fixed_end + name_len + extra_len
            start = record.data_offset + record.hashed
            stop = min(end, record.data_offset + record.size)
            if stop > start:
                record.xxh.update(self.view[start:stop])
                record.hashed += stop - start
            if record.hashed < record.size:
                return
            self.digests[record.data_offset] = record.xxh.intdigest()
            self._next += 1


def _read_tail(backend: StorageBackend, path: str, view: memoryview) -> int:
    """Read the end records and the central directory into place; returns the directory's
    offset (the bulk reads fetch these bytes again: they are a few KiB)."""
    size = len(view)
    if size < 22:
        raise _corrupt(path, "too short to be a zip archive")
    tail = min(size, _TAIL)
    backend.read_into(path, size - tail, view[size - tail :])
    if struct.unpack_from("<I", view, size - 22 + 16)[0] == 0xFFFFFFFF and size >= 42:
        (eocd64,) = struct.unpack_from("<Q", view, size - 42 + 8)
        if eocd64 + 56 > size:
            raise _corrupt(path, "zip64 end record past the end of the file (truncated)")
        if eocd64 < size - tail:
            backend.read_into(path, eocd64, view[eocd64 : eocd64 + 56])
    try:
        cd = central_offset(view, path)
    except struct.error as e:
        raise _corrupt(path, f"truncated zip end records: {e}") from e
    if not 0 <= cd < size:
        raise _corrupt(path, "central directory outside the file (truncated)")
    if cd < size - tail:
        backend.read_into(path, cd, view[cd : size - tail])
    return cd


def _central_entries(view: memoryview, path: str) -> list[zipfile.ZipInfo]:
    try:  # zipfile reads only the end records and the central directory, both in place
        infos = zipfile.ZipFile(io.BufferedReader(ViewReader(view))).infolist()
    except PARSE_ERRORS as e:
        raise _corrupt(path, f"{e} (truncated, or not a checkpoint archive)") from e
    return sorted(infos, key=lambda i: i.header_offset)


def read_archive(
    backend: StorageBackend,
    path: str,
    view: memoryview,
    *,
    concurrency: int,
    advance: Callable[[int], None],
    chunk: int | Callable[[int], int] = 8 << 20,
    prefix_first: bool = False,
    adapt: bool = False,
    latency: float = 0.0,
    chosen: Callable[[int], None] | None = None,
) -> dict[int, int]:
    """Fill ``view`` (exactly the object's size) with the archive stored at ``path`` by ranged
    reads on ``concurrency`` threads, check it as :func:`check_archive` with ``deep=True``
    does, and return the xxh3 of every record by data offset.

    ``advance(n)`` reports each time the first ``n`` bytes are in place (relays follow it;
    they are verified downstream). ``prefix_first``: keep that prefix moving when some
    requests are slower than others, and taper the ranges towards the end
    (:mod:`ckptcache.format.prefix_read`), for a read that is relayed as it lands.
    ``adapt`` (with ``prefix_first``): ``concurrency`` is the most; the count is chosen by
    :func:`~ckptcache.format.prefix_read.probe_streams` on the first bytes (``latency``: a
    small request's time, taken off its rounds), reported to ``chosen``, and ``chunk`` may
    be a function of it. Raises :class:`CorruptCheckpoint` for a damaged file.
    """
    size = len(view)
    _read_tail(backend, path, view)
    infos = _central_entries(view, path)
    records = [_Record(i.header_offset, i.file_size) for i in infos
               if not i.filename.endswith("/" + DIGESTS_MEMBER)]  # fmt: skip
    need_crc = not any(i.filename.endswith("/" + DIGESTS_MEMBER) for i in infos)
    follower = _Follower(view, records, path)

    def whole_blocks(streams: int) -> int:  # the range size, in whole blocks
        n = chunk(streams) if callable(chunk) else chunk
        return max(BLOCK, -(-n // BLOCK) * BLOCK)

    ranges: list[tuple[int, int]] = []  # planned before a read starts; the probe's first
    if prefix_first and not adapt:
        ranges = plan_ranges(size, whole_blocks(concurrency), concurrency, BLOCK)
    elif not prefix_first:
        step = whole_blocks(concurrency)
        ranges = [(off, min(step, size - off)) for off in range(0, size, step)]
    block_crcs: dict[int, int] = {}  # block start -> CRC-32 of the whole block
    done: set[int] = set()
    partial: dict[int, int] = {}  # range index -> its first bytes in place, before it lands
    lock = threading.Lock()

    def extend() -> None:  # with ``lock`` held: relays follow the contiguous landed bytes
        first = 0
        while first in done:
            first += 1
        # The ranges are contiguous: the first one not landed starts where the others end
        # (while the probe runs, the ones planned so far: the last ends before ``size``).
        if first < len(ranges):
            landed = ranges[first][0] + partial.get(first, 0)
        else:
            landed = ranges[-1][0] + ranges[-1][1] if ranges else 0
        if landed > follower.prefix:  # only grows: computed and stored under one lock
            follower.prefix = landed
            advance(landed)

    def land(index: int) -> None:  # range ``index`` is in place
        off, n = ranges[index]
        if need_crc:  # while the range is still in cache; in parallel with other threads
            crcs = {b: crc32(view[b : b + BLOCK]) for b in range(off, off + n, BLOCK)
                    if b + BLOCK <= size}  # fmt: skip
            with lock:
                block_crcs.update(crcs)
        with lock:
            done.add(index)
            partial.pop(index, None)
            extend()
        follower.follow()

    def landing(index: int, n: int) -> None:  # the first ``n`` bytes of range ``index`` are in
        # place: when it is the first range not landed, the relays need not wait for the rest
        with lock:
            if index in done or n >= ranges[index][1]:
                return  # the whole range: land() follows (its CRC-32s first)
            partial[index] = n
            extend()
        follower.follow()

    if prefix_first:
        base = 0  # the probe's ranges, read before the others are planned
        if adapt:
            index: dict[int, int] = {}  # offset -> range index

            def probe(off: int, n: int) -> None:
                i = index[off]
                read_into_reporting(backend, path, off, view[off : off + n],
                                    functools.partial(landing, i))  # fmt: skip
                land(i)

            def read_round(off: int, n: int) -> None:
                with lock:  # planned (in file order) before any of the round is read
                    index[off] = len(ranges)
                    ranges.append((off, n))
                probe(off, n)

            concurrency, probed = probe_streams(read_round, size, concurrency, latency=latency)
            base = len(probed)
            off = sum(n for _, n in probed)
            with lock:
                ranges.extend((off + o, n) for o, n in plan_ranges(
                    size - off, whole_blocks(concurrency), concurrency, BLOCK))  # fmt: skip
            if chosen is not None:
                chosen(concurrency)
        # One range of slack past the first: a worker that lands its range early starts the
        # next at once; more slack only lets it race ahead of a slow first range.
        # Progress inside a range moves the prefix too: with ``concurrency`` ranges sharing
        # the link, the first lands last, and the relays would trail by that many ranges.
        reads = PrefixReads(
            lambda off, part, progress: read_into_reporting(backend, path, off, part, progress),
            view, ranges[base:], workers=concurrency, lead=concurrency + 1,
            landed=lambda i: land(base + i), progress=lambda i, n: landing(base + i, n),
        )  # fmt: skip
        reads.run()
    else:

        def read(index: int) -> None:
            off, n = ranges[index]
            backend.read_into(path, off, view[off : off + n])
            land(index)

        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="storage-read") as pool:
            for future in [pool.submit(read, i) for i in range(len(ranges))]:
                future.result()  # the first failure, in range order
    follower.prefix = size
    follower.follow()  # a hasher may have left while the last prefix moved

    # Keyed by place and length: check_archive compares these only with the records it finds
    # in the final bytes (a file replaced between the tail and the bulk reads is refused).
    computed: dict[tuple[int, int], tuple[int, int | None]] = {}
    for record in records:
        digest = follower.digests.get(record.data_offset)
        if digest is None:
            continue  # check_archive hashes (or refuses) it
        crc = _record_crc(view, record.data_offset, record.size, block_crcs) if need_crc else None
        computed[record.data_offset, record.size] = (digest, crc)
    return check_archive(view, path, deep=True, computed=computed)


def _record_crc(view: memoryview, start: int, size: int, blocks: dict[int, int]) -> int:
    """CRC-32 of ``view[start : start + size]``: its unaligned ends directly, the whole blocks
    between them from ``blocks``."""
    end = start + size
    first = -(-start // BLOCK) * BLOCK
    if first + BLOCK > end:  # no whole block inside: small record
        return crc32(view[start:end])
    crc = crc32(view[start:first])
    pos = first
    while pos + BLOCK <= end:
        block = blocks.get(pos)
        crc = (
            crc32(view[pos : pos + BLOCK], crc)
            if block is None
            else crc32_combine(crc, block, BLOCK)
        )
        pos += BLOCK
    return crc32(view[pos:end], crc)
