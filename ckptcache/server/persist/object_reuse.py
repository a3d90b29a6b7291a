"""Incremental persists to an object store: ranges of the new object that the object persisted
before it at the path holds with the same bytes at the same offsets are copied inside the
store (S3 ``UploadPartCopy``) instead of uploaded.

An object cannot be read back before it is visible, and reading the copied ranges back after
would download what the copy saved, so what is copied is proven equal before, from what the
daemon recorded when it wrote the previous object (:class:`PersistedLayout`, ``placed``):

1. **Same records.** A record is a candidate where the previous object has a record at the same
   data offset, of the same size, whose xxh3 (computed by that object's stream as it was
   uploaded) is the digest the new generation recorded at commit.
2. **Same bytes between them.** Consecutive candidates make one run only where the bytes
   between their data (the first one's descriptor, the second one's local header) have the
   xxh3 the previous object's stream recorded for them (:func:`lead_digest`).
3. **Same object.** The object at the path must have the identity recorded right after that
   persist (ETag, version, modification time), and every copy names its ETag
   (``CopySourceIfMatch``); before the upload completes the object is looked up again and
   must still have it, and the completion itself is conditional on it (the write guard).
4. **Memory checked where it is uploaded.** A record cut by a copied range's edge is partly
   uploaded from memory, which the stream does not hash (it takes the record's digest and
   CRC-32 from the copy): its whole data is hashed from memory first and must have the
   recorded digest.

The object written is the same ``torch.save`` archive a full persist writes, byte for byte;
the previous object is not written, and a copy shares nothing with it that deleting it could
take away.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.digest import digest_hex
from ckptcache.format.persisted import ArchiveRecord, CopiedRange, lead_digest, list_records
from ckptcache.server.persist.incremental import PersistedLayout
from ckptcache.storage.base import StoredVersion
from ckptcache.storage.s3_parts import place_copies

__all__ = ["ObjectReuse"]

log = logging.getLogger(__name__)


class ObjectReuse:
    """One object-store persist's reuse of the previous object's ranges.

    Call order: :meth:`prepare` with the object now at the path (before the upload starts):
    True when ranges are to be copied (:attr:`copies`, :attr:`token`) -> the stream's
    ``reuse`` is :meth:`plan`, which returns the records' copied parts."""

    def __init__(
        self,
        layout: PersistedLayout,
        expected: Mapping[int, tuple[int, str]],
        view: memoryview,
        path: str,
        *,
        part_size: int,
    ):
        self.layout, self.expected, self.view, self.path = layout, expected, view, path
        self.part_size = part_size
        #: Ranges of the new object copied from the same ranges of the previous one.
        self.copies: list[tuple[int, int]] = []
        #: The previous object's ETag, which every copy and the completion name.
        self.token = ""
        self._plan: dict[int, CopiedRange] = {}

    @property
    def copied(self) -> int:
        """Bytes copied in the store instead of uploaded."""
        return sum(end - start for start, end in self.copies)

    def prepare(self, current: StoredVersion | None) -> bool:
        """Plan the copies from ``current``, the object now at the path (None: none), if it is
        the one the layout describes; False when nothing is to be copied."""
        if current is None or not current.token or current.identity != self.layout.identity:
            if current is not None:
                log.debug("%s: the object on storage is not the one persisted last (%s, "
                          "recorded %s): uploaded in full", self.path, current.identity,
                          self.layout.identity)  # fmt: skip
            return False
        records, cd_offset = list_records(self.view, self.path)
        runs = self._runs(records)
        self.copies = place_copies(runs, size=cd_offset, part_size=self.part_size)
        if not self.copies:
            return False
        self.token = current.token
        self._plan = self._record_ranges(records)
        return True

    def plan(self, records: list[ArchiveRecord]) -> dict[int, CopiedRange]:
        """The stream's ``reuse``: each record's copied part, by data offset."""
        return self._plan

    def _same(self, record: ArchiveRecord) -> bool:
        want = self.expected.get(record.data_offset)
        old = self.layout.placed.get(record.data_offset)
        return (
            want is not None and old is not None and old.size == record.size
            and old.digest == want[0]
        )  # fmt: skip

    def _runs(self, records: list[ArchiveRecord]) -> list[tuple[int, int]]:
        """Ranges the previous object holds byte for byte: runs of records proven the same,
        from the first one's data to the last one's data end (points 1 and 2 above)."""
        runs: list[list[int]] = []
        previous: ArchiveRecord | None = None  # the record before, if the same
        for record in records:
            if not self._same(record):
                previous = None
                continue
            end = record.data_offset + record.size
            if previous is not None:
                before = self.layout.placed[previous.data_offset]
                lead = lead_digest(self.view, previous, before.crc, record)
                if lead == self.layout.placed[record.data_offset].lead:
                    runs[-1][1] = end
                    previous = record
                    continue
            runs.append([record.data_offset, end])
            previous = record
        return [(start, end) for start, end in runs]

    def _record_ranges(self, records: list[ArchiveRecord]) -> dict[int, CopiedRange]:
        """Each record's part inside a copied range; a record cut by an edge is checked in
        memory first (point 4)."""
        plan: dict[int, CopiedRange] = {}
        copies = iter(self.copies)
        span = next(copies, None)
        for record in records:
            data_end = record.data_offset + record.size
            while span is not None and span[1] <= record.data_offset:
                span = next(copies, None)
            if span is None:
                break
            start, end = max(span[0], record.data_offset), min(span[1], data_end)
            if start >= end:
                continue
            old = self.layout.placed[record.data_offset]
            if (start, end) != (record.data_offset, data_end):
                self._check_memory(record, old.digest)
            plan[record.data_offset] = CopiedRange(start, end, old.digest, old.crc)
        return plan

    def _check_memory(self, record: ArchiveRecord, digest: int) -> None:
        data = self.view[record.data_offset : record.data_offset + record.size]
        got = xxhash.xxh3_64_intdigest(data)
        if got != digest:
            name = self.expected[record.data_offset][1]
            raise CorruptCheckpoint(
                f"checkpoint {self.path!r} is corrupt in the local tier: tensor {name!r} has "
                f"digest {digest_hex(got)}, expected {digest_hex(digest)}; it was not persisted",
                tensor=name,
                tier="local",
            )
