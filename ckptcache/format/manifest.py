"""The manifest: what a segment (or a persisted archive) holds, as validated JSON.

The manifest is written by the client next to the payload and validated by the daemon before
it commits a segment, so every offset in it is checked against the segment's size: a buggy or
hostile writer cannot make the daemon read outside the segment.
"""

from __future__ import annotations

import functools
import json
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, overload

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import ArchivePlan, ParsedArchive
from ckptcache.format.digest import DIGEST_ALGORITHM, digest_bytes, digest_hex
from ckptcache.format.gcpause import gc_paused
from ckptcache.format.layout import HEADER_SIZE, SegmentLayout
from ckptcache.format.packed_records import PackedColumns, pack_columns

__all__ = [
    "MANIFEST_FORMAT",
    "LazyRecords",
    "Manifest",
    "ObjectPlan",
    "StorageRecord",
    "compute_digests",
    "encode_records",
    "make_record",
    "manifest_from_archive",
    "meta_digests",
    "object_digest",
    "pack_digests",
    "unpack_digests",
    "verify_digests",
    "verify_meta",
]

#: The one manifest format read: the storage records packed
#: (:mod:`ckptcache.format.packed_records`), numbers as arrays, strings as one text each
#: column. Until a release freezes one, a change bumps this and other formats are refused.
MANIFEST_FORMAT = 3


class StorageRecord(NamedTuple):
    """One storage: its bytes lie at ``offset`` (from the segment start) for ``nbytes``."""

    key: str
    offset: int
    nbytes: int
    dtype: str
    location: str
    name: str


_RECORD_FIELDS = StorageRecord._fields
#: A record from a row of its fields, without a Python frame per record
#: (``NamedTuple.__new__`` is generated Python code).
make_record = functools.partial(tuple.__new__, StorageRecord)


def encode_records(records: Sequence[StorageRecord]) -> bytes:
    """The ``storages`` value of a manifest: the records packed."""
    columns = list(zip(*records, strict=True)) if records else [()] * len(_RECORD_FIELDS)
    return json.dumps(pack_columns(columns), separators=(",", ":")).encode()


def _decode_records(
    raw: Any, *, lazy: bool = False
) -> tuple[Sequence[StorageRecord], PackedColumns]:
    """The records and their columns as decoded; ``lazy``: the records made on first use
    (:class:`LazyRecords`)."""
    packed = PackedColumns(raw)
    if lazy:
        return LazyRecords(packed), packed
    return tuple(map(make_record, zip(*packed, strict=True))), packed


class LazyRecords(Sequence[StorageRecord]):
    """A manifest's records made from its (checked) columns on first use. A zero-copy load
    reads only the offsets and sizes, as columns: making thousands of records it never looks
    at costs about as much as the manifest's JSON decode."""

    __slots__ = ("_columns", "_rows")

    def __init__(self, columns: Sequence[Sequence[Any]]):
        self._columns = columns
        self._rows: tuple[StorageRecord, ...] | None = None

    def rows(self) -> tuple[StorageRecord, ...]:
        """The records as a tuple (made once)."""
        if self._rows is None:
            self._rows = tuple(map(make_record, zip(*self._columns, strict=True)))
        return self._rows

    def __len__(self) -> int:
        return len(self._columns[0])

    @overload
    def __getitem__(self, i: int) -> StorageRecord: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[StorageRecord, ...]: ...
    def __getitem__(self, i: int | slice) -> StorageRecord | tuple[StorageRecord, ...]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[StorageRecord]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        # As the tuple it stands for: a manifest read either way compares equal.
        return self.rows() == (other.rows() if isinstance(other, LazyRecords) else other)

    def __hash__(self) -> int:
        return hash(self.rows())

    def __repr__(self) -> str:
        return repr(self.rows())


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild the object from its segment without parsing the zip."""

    path: str
    namespace: str
    payload_offset: int
    payload_size: int
    pickle_offset: int
    pickle_size: int
    #: The records; a tuple, or :class:`LazyRecords` for a manifest read with ``keep_columns``.
    storages: Sequence[StorageRecord]
    created: float
    digest_algorithm: str = DIGEST_ALGORITHM
    format: int = MANIFEST_FORMAT
    #: The tensor table (:mod:`ckptcache.codec.table.table`), or ``""``: a faster way to
    #: the same object for a zero-copy load; the skeleton is always there.
    table: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(s.nbytes for s in self.storages)

    def to_json(self, records: bytes | None = None) -> bytes:
        """Encode as compact UTF-8 JSON; ``records``: :func:`encode_records` of
        :attr:`storages`, when the caller has it already (a save of a structure seen before)."""
        # As dataclasses.asdict (same keys, same order), the records as columns.
        head = {f.name: getattr(self, f.name) for f in fields(self)}
        head["storages"] = None
        head["format"] = MANIFEST_FORMAT
        table = head.pop("table")  # the last field: its text spliced in, from the cache
        text = json.dumps(head, separators=(",", ":")).encode()
        text = b"".join((text[:-1], b',"table":', _table_json(table), b"}"))
        return text.replace(
            b'"storages":null', b'"storages":' + (records or encode_records(self.storages)), 1
        )

    @classmethod
    def from_json(
        cls, data: bytes | memoryview, *, segment_size: int | None = None,
        keep_columns: bool = False,
    ) -> Manifest:  # fmt: skip
        """Decode and validate; raises :class:`CorruptCheckpoint` on anything malformed.
        ``keep_columns``: keep the records' columns as decoded, for :meth:`columns` (a load
        that reads only offsets and sizes; a manifest held for long does without them)."""
        try:
            # Tens of thousands of short-lived objects for a state of thousands of tensors:
            # generation-2 collections they would set off scan the whole heap of the daemon
            # or trainer.
            with gc_paused():
                return cls._decoded(data, segment_size, keep_columns)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise CorruptCheckpoint(f"invalid segment manifest: {e}", tier="local") from e

    @classmethod
    def _decoded(
        cls, data: bytes | memoryview, segment_size: int | None, keep_columns: bool = False
    ) -> Manifest:
        """:meth:`from_json`'s work; raises ``ValueError`` and kin on anything malformed."""
        raw: dict[str, Any] = json.loads(bytes(data))
        fmt = raw.get("format")
        if fmt != MANIFEST_FORMAT:
            raise ValueError(
                f"unknown manifest format {fmt!r} (this version reads {MANIFEST_FORMAT} only)"
            )
        storages, columns = _decode_records(raw.pop("storages"), lazy=keep_columns)
        manifest = cls(storages=storages, **raw)
        manifest._check(segment_size, columns)
        if keep_columns:
            object.__setattr__(manifest, "_columns", columns)
        return manifest

    def columns(self) -> Sequence[Sequence[Any]]:
        """The records' fields as columns (key, offset, nbytes, dtype, location, name): as
        decoded where this manifest was read with ``keep_columns``."""
        kept = self.__dict__.get("_columns")
        if kept is not None:
            return kept  # type: ignore[no-any-return]
        return list(zip(*self.storages, strict=True)) if self.storages else [()] * 6

    def _check(self, segment_size: int | None, columns: PackedColumns) -> None:
        # The records' strings were checked as they were unpacked; their bounds in one numpy
        # pass (thousands of records).
        heads = (self.payload_offset, self.payload_size, self.pickle_offset, self.pickle_size)
        if not set(map(type, heads)) <= {int} or min(heads) < 0:
            raise ValueError("negative or non-integer offset")
        texts = (self.path, self.namespace, self.digest_algorithm)
        try:
            "".join(texts)  # refuses an item that is not a str (JSON makes no subclass)
        except TypeError:
            raise ValueError("a path, namespace or algorithm that is not a string") from None
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("creation time is not a number")
        end = self.payload_offset + self.payload_size
        if not (self.payload_offset <= self.pickle_offset <= end - self.pickle_size):
            raise ValueError("pickle outside the payload")
        outside = columns.check_within(self.payload_offset, end)
        if outside is not None:
            raise ValueError(f"storage {columns[0][outside]} outside the payload")
        if segment_size is not None and end > segment_size:
            raise ValueError("payload larger than the segment")
        if type(self.table) is not str:
            raise ValueError("a tensor table that is not a string")
        if self.digest_algorithm != DIGEST_ALGORITHM:
            raise ValueError(f"unknown digest algorithm {self.digest_algorithm!r}")


#: The last tensor table encoded, and its JSON text. The repeated saves of a structure share one
#: table (the same ``str``, from the plan cache), and escaping its hundreds of kilobytes anew at
#: every save would be a visible part of a repeated save's cost. The table is held, so its identity
#: stays its own while it is here.
_last_table: tuple[str, bytes] = ("", b'""')


def _table_json(table: str) -> bytes:
    """``json.dumps(table)`` as bytes, from :data:`_last_table` when it is that table."""
    global _last_table
    last = _last_table  # one read: another thread may replace it meanwhile
    if last[0] is table:
        return last[1]
    encoded = json.dumps(table).encode()
    _last_table = (table, encoded)
    return encoded


@dataclass(frozen=True)
class ObjectPlan:
    """The complete plan for writing one flattened object into a segment.

    Built on the client side by :func:`ckptcache.codec.objectio.plan_object`.
    """

    layout: SegmentLayout
    archive: ArchivePlan
    manifest: Manifest
    manifest_bytes: bytes
    #: :func:`encode_records` of the manifest's storages (reused by a replan).
    records_json: bytes = b""


def manifest_from_archive(parsed: ParsedArchive, path: str, namespace: str, size: int) -> Manifest:
    """The manifest of an archive read back from storage (placed at ``HEADER_SIZE``).

    Dtypes and tensor names are not recorded in a plain archive; the skeleton carries them.
    """
    records = tuple(
        StorageRecord(key, HEADER_SIZE + off, n, "unknown", "", f"<storage {key}>")
        for key, (off, n) in parsed.storages.items()
    )
    return Manifest(
        path=path, namespace=namespace, payload_offset=HEADER_SIZE, payload_size=size,
        pickle_offset=HEADER_SIZE + parsed.pickle_offset, pickle_size=parsed.pickle_size,
        storages=records, created=time.time(),
    )  # fmt: skip


def compute_digests(buf: memoryview, manifest: Manifest) -> list[int]:
    """xxh3 of every storage's bytes, in key order (zero-copy over ``buf``)."""
    return [digest_bytes(buf[s.offset : s.offset + s.nbytes]) for s in manifest.storages]


def meta_digests(buf: memoryview, manifest: Manifest, manifest_offset: int,
                 manifest_size: int) -> tuple[int, int]:  # fmt: skip
    """xxh3 of the pickle skeleton and of the manifest's bytes as they lie in ``buf``."""
    po = manifest.pickle_offset
    return (
        digest_bytes(buf[po : po + manifest.pickle_size]),
        digest_bytes(buf[manifest_offset : manifest_offset + manifest_size]),
    )


def verify_meta(
    buf: memoryview, manifest: Manifest, manifest_offset: int, manifest_size: int,
    expected: tuple[int, int], *, tier: str,
) -> None:  # fmt: skip
    """Raise :class:`CorruptCheckpoint` if the skeleton or the manifest changed since their
    digests were recorded (a recorded 0 means none was: nothing to check)."""
    got = meta_digests(buf, manifest, manifest_offset, manifest_size)
    for what, have, want in zip(("skeleton (pickle)", "manifest"), got, expected, strict=True):
        if want and have != want:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.path!r} is corrupt in the {tier} tier: its {what} has "
                f"digest {digest_hex(have)}, expected {digest_hex(want)}. Delete this copy "
                "(ckptcache rm) and load from another tier",
                tensor=f"<{what.split()[0]}>",
                tier=tier,
            )


def object_digest(digests: Sequence[int]) -> str:
    """One digest for a whole object (identifies its redundancy group across nodes)."""
    return digest_hex(digest_bytes(pack_digests(digests)))


def pack_digests(digests: Sequence[int]) -> bytes:
    """Encode a digest table."""
    return struct.pack(f"<{len(digests)}Q", *digests)


def unpack_digests(data: bytes | memoryview, n: int) -> list[int]:
    """Decode a digest table of ``n`` entries."""
    return list(struct.unpack_from(f"<{n}Q", data))


def verify_digests(
    buf: memoryview, manifest: Manifest, expected: Sequence[int], *, tier: str
) -> None:
    """Raise :class:`CorruptCheckpoint` naming the first storage whose bytes changed."""
    for record, want in zip(manifest.storages, expected, strict=True):
        got = digest_bytes(buf[record.offset : record.offset + record.nbytes])
        if got != want:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.path!r} is corrupt in the {tier} tier: tensor "
                f"{record.name!r} (storage {record.key}) has digest {digest_hex(got)}, "
                f"expected {digest_hex(want)}. Delete this copy (ckptcache rm) and load from "
                "another tier",
                tensor=record.name,
                tier=tier,
            )
