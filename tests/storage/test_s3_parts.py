"""How an upload that copies ranges of the previous object is cut into parts: S3's rules hold
for any runs, and what can be copied is."""

from __future__ import annotations

import itertools
import random

import pytest

from ckptcache.storage.s3_parts import (
    MAX_PART,
    MAX_PARTS,
    MIN_PART,
    copy_pieces,
    parts_needed,
    place_copies,
)

MIB = 1 << 20


def _check_rules(kept: list[tuple[int, int]], runs: list[tuple[int, int]], size: int) -> None:
    at = 0
    for start, end in kept:
        assert start - at >= MIN_PART, "the uploaded bytes before a copy make a whole part"
        assert end - start >= MIN_PART
        assert any(s <= start and end <= e for s, e in runs), "a copy lies inside one run"
        at = end
    assert at < size, "the object ends with an uploaded part"


@pytest.mark.parametrize("seed", range(40))
def test_kept_copies_follow_the_part_rules(seed):
    rng = random.Random(seed)
    runs, at = [], 0
    for _ in range(rng.randrange(1, 30)):
        at += rng.randrange(1, 12 * MIB)
        length = rng.randrange(1, 40 * MIB)
        runs.append((at, at + length))
        at += length
    size = at + rng.randrange(1, MIB)
    kept = place_copies(runs, size=size, part_size=8 * MIB)
    _check_rules(kept, runs, size)


def test_a_run_after_enough_uploaded_bytes_is_copied_whole():
    runs = [(6 * MIB, 100 * MIB)]
    assert place_copies(runs, size=101 * MIB, part_size=8 * MIB) == [(6 * MIB, 100 * MIB)]


def test_a_run_too_close_to_the_last_copy_is_shortened_at_its_start():
    runs = [(6 * MIB, 20 * MIB), (21 * MIB, 40 * MIB)]
    kept = place_copies(runs, size=41 * MIB, part_size=8 * MIB)
    assert kept == [(6 * MIB, 20 * MIB), (25 * MIB, 40 * MIB)]


def test_a_run_left_shorter_than_a_part_is_uploaded():
    runs = [(6 * MIB, 20 * MIB), (21 * MIB, 29 * MIB)]
    assert place_copies(runs, size=30 * MIB, part_size=8 * MIB) == [(6 * MIB, 20 * MIB)]


def test_too_many_parts_copy_nothing():
    runs = [(i * 11 * MIB + 5 * MIB, i * 11 * MIB + 11 * MIB) for i in range(MAX_PARTS)]
    size = MAX_PARTS * 11 * MIB + MIB
    assert parts_needed(runs, size=size, part_size=8 * MIB) > MAX_PARTS
    assert place_copies(runs, size=size, part_size=8 * MIB) == []


def test_a_copy_larger_than_a_part_is_split_evenly():
    pieces = copy_pieces(0, 2 * MAX_PART + 3)
    assert len(pieces) == 3
    assert pieces[0][0] == 0 and pieces[-1][1] == 2 * MAX_PART + 3
    assert all(b[0] == a[1] for a, b in itertools.pairwise(pieces))
    assert all(MIN_PART <= end - start <= MAX_PART for start, end in pieces)
