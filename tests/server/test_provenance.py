"""The facts a restart needs (:mod:`ckptcache.server.persist.provenance`): the record round-trips,
and what it cannot keep is left to be recomputed, never invented."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import pytest

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.server.persist.provenance import Provenance, read_provenance, write_provenance


@dataclass
class _Segment:
    mapping: mmap.mmap
    record_path: str | None = None  # no daemon record: the page itself (server/memory/records.py)
    sealable: bool = False


@pytest.mark.parametrize(
    "record",
    [
        Provenance(base="1:2:3:4", anchor="/ckpt/job/iter1"),
        Provenance(base="", anchor="/", dropped=True),
        Provenance(base=None, anchor=""),
        Provenance(base="e", anchor=None),
    ],
)
def test_the_provenance_record_round_trips(record):
    segment = _Segment(mmap.mmap(-1, HEADER_SIZE))
    assert read_provenance(segment) is None  # a segment of an older version has none
    write_provenance(segment, record)
    assert read_provenance(segment) == record


def test_an_anchor_too_long_to_keep_is_recomputed_not_invented():
    segment = _Segment(mmap.mmap(-1, HEADER_SIZE))
    write_provenance(segment, Provenance(base="b", anchor="/" + "d" * 3000))
    assert read_provenance(segment) == Provenance(base="b", anchor=None)
