"""The daemon's copy of a path's newest save into a freed segment
(``ckptcache.server.memory.refill``): which ranges it copies, and that whatever needs the
segment (a reservation, a cut, an unlink) stops it first and never meets it half way."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest

from ckptcache.format.layout import HEADER_SIZE, SegmentState
from ckptcache.server.memory.arena import Arena, Fill, empty_header
from ckptcache.server.memory.refill import CHUNK, copy_ranges, differing
from ckptcache.server.quiet import SavesInFlight

MiB = 1 << 20


@pytest.fixture
def arena():
    shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:8]}"
    yield Arena(shm, 256 << 20, 0o700)
    shutil.rmtree(shm, ignore_errors=True)


def _gen(storages: list[tuple[int, int]], payload: tuple[int, int] = (HEADER_SIZE, 0)):
    """A generation as :func:`differing` reads it: its storages' offsets and sizes, and its
    segment's payload."""
    records = [SimpleNamespace(offset=o, nbytes=n) for o, n in storages]
    header = replace(empty_header(SegmentState.COMMITTED), payload_offset=payload[0],
                     payload_size=payload[1])  # fmt: skip
    return SimpleNamespace(manifest=SimpleNamespace(storages=records),
                           segment=SimpleNamespace(read_header=lambda: header))  # fmt: skip


def test_only_storages_held_at_the_same_offset_size_and_digest_are_left_out():
    start, size = HEADER_SIZE, 1000
    left = _gen([(4200, 100), (4400, 100), (4600, 100), (4800, 100)])
    source = _gen([(4200, 100), (4400, 100), (4600, 120), (4900, 100)], (start, size))
    had = [1, 2, 3, 4]
    has = [1, 9, 3, 4]  # the second changed; the third grew; the fourth moved
    assert differing(left, had, source, has) == [(start, 4200), (4300, start + size)]


def test_nothing_is_left_out_where_nothing_was_held():
    source = _gen([(4200, 100)], (HEADER_SIZE, 500))
    assert differing(_gen([]), [], source, [7]) == [(HEADER_SIZE, HEADER_SIZE + 500)]


def _segments(arena: Arena, capacity: int):
    source, target = arena.create(capacity), arena.create(capacity)
    source.mapping[HEADER_SIZE:capacity] = os.urandom(1 << 16) * ((capacity - HEADER_SIZE) >> 16)
    return source, target


def test_the_ranges_are_copied_and_nothing_else(arena):
    capacity = 4 * MiB + HEADER_SIZE
    source, target = _segments(arena, capacity)
    ranges = [(HEADER_SIZE, HEADER_SIZE + 10), (MiB, 3 * MiB + 5)]
    assert copy_ranges(source, target, ranges, Fill(), SavesInFlight())
    src, dst = bytes(source.mapping), bytes(target.mapping)
    for lo, hi in ranges:
        assert dst[lo:hi] == src[lo:hi]
    assert dst[HEADER_SIZE + 10 : MiB] == bytes(MiB - HEADER_SIZE - 10)
    assert dst[3 * MiB + 5 :] == bytes(len(dst) - 3 * MiB - 5)


def _stop_by(arena: Arena, how: str, target) -> None:
    if how == "reservation":
        assert arena.take_free(target.capacity, tight=True) is target
    elif how == "cut":
        arena.trim(target, HEADER_SIZE + MiB)
    else:
        arena.destroy(target)


@pytest.mark.parametrize("how", ["reservation", "cut", "unlink"])
def test_whatever_needs_the_segment_stops_the_copy_first(arena, how):
    """A save in flight holds the copy before its first chunk; the segment is then handed
    out, cut or unlinked: the copy stops and writes nothing more."""
    capacity = 2 * CHUNK + HEADER_SIZE
    source, target = _segments(arena, capacity)
    arena.release(target)
    saves = SavesInFlight()
    saves.begin()  # a save is copying: the fill waits
    fill = target.fill = Fill()
    result: list[bool] = []

    def copy() -> None:
        try:
            result.append(copy_ranges(source, target, [(HEADER_SIZE, capacity)], fill, saves))
        finally:
            target.fill = None
            fill.finish()

    thread = threading.Thread(target=copy)
    thread.start()
    _stop_by(arena, how, target)
    thread.join(timeout=10)
    assert result == [False]
    assert fill.stopped
    if how != "unlink":
        assert bytes(target.mapping[HEADER_SIZE : HEADER_SIZE + MiB]) == bytes(MiB)


def test_a_segment_the_daemon_still_hashes_is_never_cut(arena):
    """The copy is done and the daemon hashes the segment (its fill still set): a cut would
    turn that read into a SIGBUS, so the segment stays whole."""
    _, target = _segments(arena, 4 * MiB + HEADER_SIZE)
    arena.release(target)
    capacity = target.capacity
    fill = target.fill = Fill()
    fill.finish()
    arena.trim(target, HEADER_SIZE + MiB)
    assert target.capacity == capacity
    assert os.path.getsize(target.path) == capacity
    target.fill = None
    arena.trim(target, HEADER_SIZE + MiB)
    assert os.path.getsize(target.path) == target.capacity < capacity


def test_a_save_is_handed_a_segment_holding_bytes_its_client_knows(arena):
    """Of the free segments its client maps, checked to hold saves, a save takes one holding
    a save of its own client's (``known`` tokens), though another was freed later: only
    there may it keep what it did not change."""
    capacity = 4 * MiB + HEADER_SIZE
    ours, theirs = arena.create(capacity), arena.create(capacity)
    mapped = {ours.name, theirs.name}

    def free(segment, token: int) -> None:
        arena.release(segment)
        segment.content = segment.checked = token

    free(ours, 11)
    free(theirs, 22)
    assert arena.take_free(capacity, tight=False, mapped=mapped) is theirs  # the latest freed
    free(theirs, 22)
    assert arena.take_free(capacity, tight=False, mapped=mapped, known={11}) is ours
    assert ours.handed == 11


def test_a_known_segment_never_beats_a_better_fit(arena):
    """A free segment holding the client's save, but larger, is left for a larger save: a
    small save taking it could leave that one no room (under a tight budget any larger
    segment may be taken)."""
    small, large = 4 * MiB + HEADER_SIZE, 16 * MiB + HEADER_SIZE
    fit, known = arena.create(small), arena.create(large)
    for segment, token in ((known, 11), (fit, 0)):
        arena.release(segment)
        segment.content = segment.checked = token
    both = {fit.name, known.name}
    assert arena.take_free(small, tight=True, mapped=both, known={11}) is fit
