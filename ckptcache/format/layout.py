"""Segment layout: a fixed header page, the archive payload, the manifest and the digest table.

```
offset 0       header (HEADER_SIZE bytes): magic, version, state, generation, offsets
offset 4096    payload: a torch.save-compatible zip archive (see ckptcache.format.archive)
manifest_off   manifest: UTF-8 JSON (see ckptcache.format.manifest), 64-byte aligned
digest_off     digest table: one little-endian u64 xxh3 per storage, filled by the daemon
```

States of a segment (one byte of truth for crash recovery):

``FREE`` (reusable, content meaningless) -> ``WRITING`` (reserved by a client) ->
``COMMITTED`` (visible; the daemon set it after validating the manifest) -> ``FREE``.
A daemon restarted after a crash keeps ``COMMITTED`` segments and reclaims the others.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ckptcache.errors import CorruptCheckpoint

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "SEGMENT_GRANULE",
    "SegmentHeader",
    "SegmentLayout",
    "SegmentState",
    "align",
    "plan_segment",
]

MAGIC = b"CKPTSEG\x00"
#: The one header layout read (until a release freezes one, a layout change bumps this and
#: segments of another version are refused).
LAYOUT_VERSION = 2
HEADER_SIZE = 4096
#: Segment capacities are rounded up to this, so slightly different sizes reuse one segment.
SEGMENT_GRANULE = 1 << 20

_HEADER = struct.Struct("<8sIIQQQQQQIIQQIQQ")


class SegmentState(enum.IntEnum):
    """Lifecycle of a segment file, stored in its header."""

    FREE = 0
    WRITING = 1
    COMMITTED = 2


class DigestState(enum.IntEnum):
    """Whether the header's digest table holds valid digests yet."""

    PENDING = 0
    VALID = 1


def align(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True, kw_only=True)
class SegmentHeader:
    """The decoded fixed header of a segment (built with keywords only: eleven adjacent ints
    are too easy to swap by position)."""

    state: SegmentState
    generation: int
    payload_offset: int
    payload_size: int
    manifest_offset: int
    manifest_size: int
    digest_offset: int
    n_storages: int
    digest_state: DigestState
    created_ns: int
    committed_ns: int
    #: 1 once phase 2 wrote this generation to storage (survives daemon restarts).
    persisted: int = 0
    #: xxh3 of the pickle skeleton and of the manifest bytes, recorded with the digest
    #: table (0: not recorded yet).
    skeleton_digest: int = 0
    manifest_digest: int = 0

    def pack(self) -> bytes:
        """Encode the header (without padding to ``HEADER_SIZE``)."""
        return _HEADER.pack(
            MAGIC, LAYOUT_VERSION, int(self.state), self.generation, self.payload_offset,
            self.payload_size, self.manifest_offset, self.manifest_size, self.digest_offset,
            self.n_storages, int(self.digest_state), self.created_ns, self.committed_ns,
            self.persisted, self.skeleton_digest, self.manifest_digest,
        )  # fmt: skip

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> SegmentHeader:
        """Decode a header; raises :class:`CorruptCheckpoint` (a ``ValueError``) on a short
        header, a wrong magic or version, or an unknown state."""
        if len(data) < _HEADER.size:
            raise CorruptCheckpoint("segment shorter than its header")
        if bytes(data[:8]) != MAGIC:
            raise CorruptCheckpoint("bad segment magic")
        version = struct.unpack_from("<I", data, 8)[0]
        if version != LAYOUT_VERSION:
            raise CorruptCheckpoint(
                f"unknown segment layout version {version} (this version reads "
                f"{LAYOUT_VERSION} only): written by another ckptcache version"
            )
        fields = _HEADER.unpack_from(data)
        try:
            state, digest_state = SegmentState(fields[2]), DigestState(fields[10])
        except ValueError as e:
            raise CorruptCheckpoint(f"segment header: {e}") from e
        return cls(
            state=state, generation=fields[3], payload_offset=fields[4],
            payload_size=fields[5], manifest_offset=fields[6], manifest_size=fields[7],
            digest_offset=fields[8], n_storages=fields[9], digest_state=digest_state,
            created_ns=fields[11], committed_ns=fields[12], persisted=fields[13],
            skeleton_digest=fields[14], manifest_digest=fields[15],
        )  # fmt: skip


@dataclass(frozen=True)
class SegmentLayout:
    """Where the parts of one object go inside a segment, and the capacity it needs."""

    payload_size: int
    manifest_offset: int
    manifest_capacity: int
    digest_offset: int
    n_storages: int

    @property
    def payload_offset(self) -> int:
        """The archive always starts right after the header page."""
        return HEADER_SIZE

    @property
    def nbytes(self) -> int:
        """Bytes the segment must hold."""
        return self.digest_offset + 8 * self.n_storages


def plan_segment(payload_size: int, manifest_capacity: int, n_storages: int) -> SegmentLayout:
    """Lay out a segment for an archive of ``payload_size`` bytes."""
    manifest_offset = align(HEADER_SIZE + payload_size, 64)
    digest_offset = align(manifest_offset + manifest_capacity, 64)
    return SegmentLayout(
        payload_size, manifest_offset, manifest_capacity, digest_offset, n_storages
    )
