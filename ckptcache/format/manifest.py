"""The manifest: what a segment (or a persisted archive) holds, as validated JSON.

The manifest is written by the client next to the payload and validated by the daemon before
it commits a segment, so every offset in it is checked against the segment's size: a buggy or
hostile writer cannot make the daemon read outside the segment.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import ArchivePlan, ParsedArchive
from ckptcache.format.digest import DIGEST_ALGORITHM, digest_bytes, digest_hex
from ckptcache.format.layout import HEADER_SIZE, SegmentLayout

__all__ = [
    "MANIFEST_FORMAT",
    "Manifest",
    "ObjectPlan",
    "StorageRecord",
    "compute_digests",
    "manifest_from_archive",
    "meta_digests",
    "object_digest",
    "pack_digests",
    "unpack_digests",
    "verify_digests",
    "verify_meta",
]

MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class StorageRecord:
    """One storage: its bytes lie at ``offset`` (from the segment start) for ``nbytes``."""

    key: str
    offset: int
    nbytes: int
    dtype: str
    location: str
    name: str


_RECORD_FIELDS = fields(StorageRecord)


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild the object from its segment without parsing the zip."""

    path: str
    namespace: str
    payload_offset: int
    payload_size: int
    pickle_offset: int
    pickle_size: int
    storages: tuple[StorageRecord, ...]
    created: float
    digest_algorithm: str = DIGEST_ALGORITHM
    format: int = MANIFEST_FORMAT

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(s.nbytes for s in self.storages)

    def to_json(self) -> bytes:
        """Encode as compact UTF-8 JSON."""
        # As dataclasses.asdict (same keys, same order), without its deep copy of every value:
        # the fields are str, int and float, and a save encodes hundreds of records.
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw["storages"] = [
            {f.name: getattr(s, f.name) for f in _RECORD_FIELDS} for s in self.storages
        ]
        return json.dumps(raw, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview, *, segment_size: int | None = None) -> Manifest:
        """Decode and validate; raises :class:`CorruptCheckpoint` on anything malformed."""
        try:
            raw: dict[str, Any] = json.loads(bytes(data))
            if raw.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unknown manifest format {raw.get('format')!r}")
            storages = tuple(StorageRecord(**s) for s in raw.pop("storages"))
            manifest = cls(storages=storages, **raw)
            manifest._check(segment_size)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise CorruptCheckpoint(f"invalid segment manifest: {e}", tier="local") from e
        return manifest

    def _check(self, segment_size: int | None) -> None:
        ints = [self.payload_offset, self.payload_size, self.pickle_offset, self.pickle_size]
        for s in self.storages:
            ints += [s.offset, s.nbytes]
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints):
            raise ValueError("negative or non-integer offset")
        texts = [self.path, self.namespace, self.digest_algorithm]
        for s in self.storages:
            texts += [s.key, s.dtype, s.location, s.name]
        if any(not isinstance(v, str) for v in texts):
            raise ValueError("a name, path or dtype that is not a string")
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("creation time is not a number")
        end = self.payload_offset + self.payload_size
        if not (self.payload_offset <= self.pickle_offset <= end - self.pickle_size):
            raise ValueError("pickle outside the payload")
        for s in self.storages:
            if not (self.payload_offset <= s.offset and s.offset + s.nbytes <= end):
                raise ValueError(f"storage {s.key} outside the payload")
        if segment_size is not None and end > segment_size:
            raise ValueError("payload larger than the segment")
        if self.digest_algorithm != DIGEST_ALGORITHM:
            raise ValueError(f"unknown digest algorithm {self.digest_algorithm!r}")


@dataclass(frozen=True)
class ObjectPlan:
    """The complete plan for writing one flattened object into a segment.

    Built on the client side by :func:`ckptcache.format.objectio.plan_object`.
    """

    layout: SegmentLayout
    archive: ArchivePlan
    manifest: Manifest
    manifest_bytes: bytes


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
