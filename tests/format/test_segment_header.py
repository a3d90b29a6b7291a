"""SegmentHeader is built with keywords only, and packs/unpacks every field in place."""

from __future__ import annotations

import pytest

from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState

FIELDS = dict(
    state=SegmentState.COMMITTED, generation=3, payload_offset=HEADER_SIZE, payload_size=100,
    manifest_offset=8192, manifest_size=50, digest_offset=9000, n_storages=2,
    digest_state=DigestState.VALID, created_ns=11, committed_ns=12, persisted=1,
    skeleton_digest=13, manifest_digest=14,
)  # fmt: skip


def test_positional_construction_is_refused():
    with pytest.raises(TypeError):
        SegmentHeader(SegmentState.COMMITTED, 3, HEADER_SIZE, 100, 8192, 50, 9000, 2,  # type: ignore[misc]
                      DigestState.VALID, 11, 12)  # fmt: skip


def test_every_field_survives_pack_and_unpack():
    header = SegmentHeader(**FIELDS)  # type: ignore[arg-type]
    assert SegmentHeader.unpack(header.pack()) == header


@pytest.mark.parametrize("version", [1, 3, 0])
def test_a_header_of_another_layout_version_is_refused(version):
    """One layout version is read: a header of another (an unreleased earlier one, a newer
    one) is refused as corrupt, naming its version, and never read as this one's."""
    import struct

    from ckptcache.errors import CorruptCheckpoint

    data = bytearray(SegmentHeader(**FIELDS).pack().ljust(HEADER_SIZE, b"\0"))  # type: ignore[arg-type]
    struct.pack_into("<I", data, 8, version)
    with pytest.raises(CorruptCheckpoint, match=f"unknown segment layout version {version} "):
        SegmentHeader.unpack(bytes(data))
