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
