"""Incremental persists: a record whose bytes are already in the previous persisted file of the
same path is copied from that file in the kernel instead of being written from memory.

The proof that a record may be copied, and the check that it was copied right:

1. **Same bytes.** The generation's digests taken at commit (``gen.digests``) name, for each
   tensor record, its xxh3; the daemon kept, for the file it persisted last at the path, the
   xxh3, size, offset and CRC-32 its stream computed of every large record
   (:class:`PersistedLayout`). A record of the new generation with the digest and size of a
   record of that file is a candidate.
2. **Same file.** The file now at the path is opened read-only without following a link
   and its identity (``dev:ino:size:mtime``, as :func:`~ckptcache.storage.fs.file_version`
   reads it) must be the one recorded right after that persist; a file replaced, rewritten
   or touched since is not used at all.
3. **Checked where it lands.** The copy's bytes are read back from the new file and hashed;
   one that differs from the generation's digest (an old file damaged in place, its mtime
   restored) is written again from memory (after memory is checked against the digest) and
   read back once more; a record that still disagrees fails the attempt (retried), so a
   persisted file never disagrees with the acknowledged bytes.

The persisted file is the same ``torch.save`` archive a full persist writes, byte for byte.
The previous file is never written, and the copy shares nothing with it that deleting it
could take away (a reflink's blocks are copy-on-write; an in-kernel copy is a copy).

What is kept lives in the daemon's memory only (:class:`Layouts`, bounded): the first
persist of a path after a restart writes everything.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.crc import crc32
from ckptcache.format.digest import digest_hex
from ckptcache.format.persisted import ArchiveRecord, CopiedRange, WrittenRecord
from ckptcache.storage.direct import BLOCK
from ckptcache.storage.ranges import COPY_REFUSED, copy_range, read_back

__all__ = ["MIN_RECORD", "Layouts", "PersistedLayout", "Placed", "RecordReuse"]

log = logging.getLogger(__name__)

#: Records smaller than this are always written: a copy, its read-back and its bookkeeping
#: cost more than writing a few hundred KiB.
MIN_RECORD = 256 << 10
#: Paths whose last persisted layout is kept (least recently persisted dropped first).
_PATHS = 4096
#: Records kept over all paths, at most.
_RECORDS = 1 << 20


class Placed(NamedTuple):
    """A record of a persisted object, at its data offset (see :class:`WrittenRecord`)."""

    size: int
    digest: int
    crc: int
    lead: int


@dataclass(frozen=True)
class PersistedLayout:
    """The records of the object the daemon persisted last at a path, as its stream computed
    them, and the object's identity. ``records``: the large ones of a file,
    ``(xxh3, size) -> (data offset, CRC-32)``, copied from wherever they lie; ``placed``:
    every record of an object-store object by data offset (its ranges are copied from the
    same offsets, :mod:`ckptcache.server.persist.object_reuse`)."""

    identity: str
    records: Mapping[tuple[int, int], tuple[int, int]]
    placed: Mapping[int, Placed] = field(default_factory=dict)

    @classmethod
    def of(
        cls, identity: str, written: list[WrittenRecord], *, placed: bool = False
    ) -> PersistedLayout:
        """The layout of an object just written (``written``: its stream's records);
        ``placed``: keep every record by offset (an object store's) instead of the large
        ones by digest (a file's)."""
        if placed:
            every = {r.data_offset: Placed(r.size, r.digest, r.crc, r.lead) for r in written}
            return cls(identity, {}, every)
        records = {
            (r.digest, r.size): (r.data_offset, r.crc) for r in written if r.size >= MIN_RECORD
        }
        return cls(identity, records)

    @property
    def count(self) -> int:
        """Records kept (what :class:`Layouts` bounds)."""
        return len(self.records) + len(self.placed)


class Layouts:
    """The last persisted layout of each path (bounded by paths and by records)."""

    def __init__(self, paths: int = _PATHS, records: int = _RECORDS):
        self._paths, self._max_records = paths, records
        self._by_key: collections.OrderedDict[tuple[str, str], PersistedLayout] = (
            collections.OrderedDict()
        )
        self._records = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> PersistedLayout | None:
        """The layout recorded for ``key`` (None: none)."""
        with self._lock:
            return self._by_key.get(key)

    def put(self, key: tuple[str, str], layout: PersistedLayout | None) -> None:
        """Record ``layout`` as ``key``'s (None: forget it: the file is not known now)."""
        with self._lock:
            old = self._by_key.pop(key, None)
            if old is not None:
                self._records -= old.count
            if layout is None or not layout.count:
                return
            self._by_key[key] = layout
            self._records += layout.count
            while self._by_key and (
                len(self._by_key) > self._paths or self._records > self._max_records
            ):
                _, dropped = self._by_key.popitem(last=False)
                self._records -= dropped.count


def _identity(fd: int) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _advise(fd: int, offset: int, size: int) -> None:
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advice only


@dataclass(eq=False)
class _Copy:
    record: ArchiveRecord
    digest: int
    name: str
    src_offset: int  # of the range's start in the previous file
    range: CopiedRange
    refused: bool = False  # the copy was refused: written from memory


class RecordReuse:
    """One persist's reuse of the previous file's records.

    Call order: :meth:`attach` with the file now at the path (before the new file is
    written) -> :meth:`plan` (from the stream, with the archive's records) ->
    :meth:`finish` with the new file once the stream is written (copies and checks)."""

    def __init__(
        self,
        layout: PersistedLayout,
        expected: Mapping[int, tuple[int, str]],
        view: memoryview,
        path: str,
    ):
        self.layout, self.expected, self.view, self.path = layout, expected, view, path
        self.source: int | None = None
        self._copies: list[_Copy] = []
        #: Bytes copied from the previous file and read back equal.
        self.copied = 0
        #: Bytes of planned copies written from memory instead (refused, or read back wrong).
        self.rewritten = 0

    def candidates(self) -> bool:
        """Whether any record of the generation has the digest of one of the previous file's
        (if not, the persist is a plain one)."""
        digests = {digest for digest, _ in self.layout.records}
        return any(digest in digests for digest, _ in self.expected.values())

    def attach(self, source: int | None) -> None:
        """Take ``source`` (an fd of the file now at the path, read-only; None: none) as the
        previous file if it is the one the layout describes. The caller closes it after
        :meth:`finish`."""
        if source is None:
            return
        identity = _identity(source)
        if identity != self.layout.identity:
            log.debug(
                "%s: the file on storage is not the one persisted last (%s, recorded %s): "
                "written in full", self.path, identity, self.layout.identity,
            )  # fmt: skip
            return
        self.source = source

    def plan(self, records: list[ArchiveRecord]) -> dict[int, CopiedRange]:
        """The records to copy, by data offset: those with an expected digest whose digest and
        size a record of the previous file has; the copy covers the record's whole blocks
        (its edges are streamed from memory)."""
        if self.source is None:
            return {}
        plan: dict[int, CopiedRange] = {}
        for record in records:
            want = self.expected.get(record.data_offset)
            if want is None or record.size < MIN_RECORD:
                continue
            found = self.layout.records.get((want[0], record.size))
            if found is None:
                continue
            src_data, crc = found
            start = -(-record.data_offset // BLOCK) * BLOCK
            end = (record.data_offset + record.size) // BLOCK * BLOCK
            if end - start < BLOCK:
                continue
            copied = CopiedRange(start, end, want[0], crc)
            src = src_data + (start - record.data_offset)
            self._copies.append(_Copy(record, want[0], want[1], src, copied))
            plan[record.data_offset] = copied
        return plan

    def finish(self, fd: int) -> None:
        """Fill every planned range of the new file ``fd`` (a copy from the previous file, or
        memory where the copy is refused) and check each whole record as read back from
        the file. Raises :class:`CorruptCheckpoint` where memory disagrees with the digest
        too, ``OSError`` where the file keeps disagreeing after a write from memory."""
        if not self._copies:
            return
        assert self.source is not None
        try:  # the new file is open for writing only: read it through a second open
            reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:  # no /proc: nothing could be read back, so nothing is copied
            log.debug("%s: cannot read the new file back (%s): written from memory", self.path, e)
            for item in self._copies:
                self._rewrite(fd, item)
            return
        buf = memoryview(bytearray(8 << 20))
        try:
            for item in self._copies:
                size = item.range.end - item.range.start
                try:
                    copy_range(self.source, fd, item.src_offset, item.range.start, size)
                except OSError as e:
                    # Refused, cut short, or the previous file unreadable (EIO): written from
                    # memory, whose own write raises if the new file is what fails (ENOSPC).
                    level = logging.DEBUG if e.errno in COPY_REFUSED else logging.WARNING
                    log.log(level, "%s: copy of %s failed (%s): written from memory",
                            self.path, item.name, e)  # fmt: skip
                    item.refused = True
                    continue
                # The whole record is read back next: ask for all of it now, so the disk
                # reads ahead of the hashing instead of one window at a time.
                _advise(reader, item.record.data_offset, item.record.size)
            for item in self._copies:
                if item.refused:
                    self._rewrite(fd, item)
                    self._check(reader, buf, item, after_rewrite=True)
                    continue
                if self._check(reader, buf, item, after_rewrite=False):
                    self.copied += item.range.end - item.range.start
                    continue
                log.warning(
                    "%s: tensor %r copied from the previous file reads back with another digest "
                    "(that file was changed in place since it was persisted): written from "
                    "memory", self.path, item.name,
                )  # fmt: skip
                self._rewrite(fd, item)
                self._check(reader, buf, item, after_rewrite=True)
        finally:
            buf.release()
            os.close(reader)

    def _check(self, reader: int, buf: memoryview, item: _Copy, *, after_rewrite: bool) -> bool:
        """Whether the record reads back from the new file with its digest; after a rewrite
        from memory a mismatch raises (the file system did not keep what was written)."""
        record = item.record
        hasher = xxhash.xxh3_64()
        for piece in read_back(reader, record.data_offset, record.size, buf):
            hasher.update(piece)
        if hasher.intdigest() == item.digest:
            return True
        if after_rewrite:
            raise OSError(
                f"{self.path}: tensor {item.name!r} reads back from the new file with digest "
                f"{digest_hex(hasher.intdigest())}, written as {digest_hex(item.digest)}"
            )
        return False

    def _rewrite(self, fd: int, item: _Copy) -> None:
        """Write the planned range from memory, once memory is checked against the digest
        (and the CRC-32 the descriptor carries)."""
        record = item.record
        data = self.view[record.data_offset : record.data_offset + record.size]
        got = xxhash.xxh3_64_intdigest(data)
        if got != item.digest or crc32(data) != item.range.crc:
            raise CorruptCheckpoint(
                f"checkpoint {self.path!r} is corrupt in the local tier: tensor {item.name!r} "
                f"has digest {digest_hex(got)}, expected {digest_hex(item.digest)}; it was "
                "not persisted",
                tensor=item.name,
                tier="local",
            )  # fmt: skip
        start, end = item.range.start, item.range.end
        piece = self.view[start:end]
        while piece:
            n = os.pwrite(fd, piece, start)
            piece, start = piece[n:], start + n
        self.rewritten += item.range.end - item.range.start
