"""Pages shared between segments (``ckptcache.server.memory.sharing``) on a real arena in
tmpfs: what a share gives back, that a whole segment holds its bytes again, that a backing
outlives its generation while anyone needs its pages, that runs move when a backing is itself
hollowed, and that a changed backing is found."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from ckptcache.errors import BudgetExceeded
from ckptcache.format.digest import digest_bytes
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.server.lock import StateLock
from ckptcache.server.memory import sharer, sharing
from ckptcache.server.memory.arena import Arena
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.memory.refill import within_payload
from ckptcache.server.memory.sharing import Run, intersect, storage_pages, subtract
from tests.server.conftest import NS, digested, save_object

MiB = 1 << 20
PAGE = mmap.PAGESIZE


@pytest.fixture
def arena():
    shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:8]}"
    yield Arena(shm, 64 * MiB, 0o700)
    shutil.rmtree(shm, ignore_errors=True)


def resident(segment) -> int:
    return os.stat(segment.path).st_blocks * 512


def filled(arena: Arena, payload: bytes):
    segment = arena.create(4 * MiB)
    segment.mapping[HEADER_SIZE : HEADER_SIZE + len(payload)] = payload
    return segment


STORAGE = [(HEADER_SIZE, 3 * MiB)]
PAYLOAD = os.urandom(3 * MiB)


def test_range_arithmetic():
    assert storage_pages([(100, 3 * PAGE), (5 * PAGE, 10)], 10 * PAGE) == [(PAGE, 3 * PAGE)]
    assert storage_pages([(0, 2 * PAGE), (2 * PAGE, PAGE)], 10 * PAGE) == [(0, 3 * PAGE)]
    assert storage_pages([(0, 4 * PAGE)], 2 * PAGE) == [(0, 2 * PAGE)]
    assert intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]


def test_a_share_gives_pages_back_and_whole_brings_the_bytes_back(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    used = arena.used
    pages = storage_pages(STORAGE, 4 * MiB)
    arena.sharing.punch(x, arena.sharing.share(x, pages, y))
    assert x.hollow == 3 * MiB and arena.used == used - 3 * MiB
    assert resident(x) <= 1 * MiB  # the header page and the tail, not the payload
    assert y.dependents == {x}
    assert os.listdir(arena.sharing.records.directory) == [x.name]
    digests = [digest_bytes(PAYLOAD)]
    assert arena.sharing.whole(x, STORAGE, digests, "x") == ""
    assert bytes(x.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD
    assert (x.runs, x.holes, x.hollow, y.dependents) == ([], [], 0, set())
    assert arena.used == used and os.listdir(arena.sharing.records.directory) == []


def test_a_changed_backing_page_is_found_when_made_whole(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    y.mapping[HEADER_SIZE + MiB] ^= 0xFF
    changed = arena.sharing.whole(x, STORAGE, [digest_bytes(PAYLOAD)], "x")
    assert changed == f"the storage at offset {HEADER_SIZE} differs from its digest"
    # Its runs stay recorded until the caller retired the generation: a crash in between
    # must not leave those bytes committed with no record of where they came from.
    assert x.runs and os.listdir(arena.sharing.records.directory) == [x.name]


def test_no_room_to_make_it_whole_is_a_typed_error_and_keeps_the_sharing(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    arena.limit = arena.used + MiB
    with pytest.raises(BudgetExceeded, match="no room to make x whole again"):
        arena.sharing.whole(x, STORAGE, [digest_bytes(PAYLOAD)], "x")
    assert x.hollow == 3 * MiB and y.dependents == {x}


def test_a_backing_outlives_its_generation_until_its_last_dependent_goes(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    arena.release(y)  # its generation left: it stays, backing x
    assert y.orphan and y.name not in arena.free and y.name in arena.segments
    arena.destroy(y)  # nor can it be unlinked
    assert os.path.exists(y.path)
    assert arena.sharing.whole(x, STORAGE, [digest_bytes(PAYLOAD)], "x") == ""
    assert not y.orphan and y.name in arena.free  # freed with its last dependent
    assert bytes(x.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD


def test_runs_move_when_their_backing_is_hollowed_in_turn(arena):
    """x shares with y, then y with z: x's runs move to z, never onto y's holes."""
    x, y, z = (filled(arena, PAYLOAD) for _ in range(3))
    pages = storage_pages(STORAGE, 4 * MiB)
    arena.sharing.punch(x, arena.sharing.share(x, pages, y))
    half = [(pages[0][0], pages[0][0] + MiB)]
    arena.sharing.punch(y, arena.sharing.share(y, half, z))
    assert {r.backing.name for r in x.runs} == {y.name, z.name}
    assert not intersect([(r.start, r.end) for r in x.runs if r.backing is y], y.holes)
    assert z.dependents == {x, y} and y.dependents == {x}
    digests = [digest_bytes(PAYLOAD)]
    assert arena.sharing.whole(x, STORAGE, digests, "x") == ""
    assert arena.sharing.whole(y, STORAGE, digests, "y") == ""
    for s in (x, y):
        assert bytes(s.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD


def test_a_freed_hollow_segment_is_not_handed_out_before_its_holes_are_allocated(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    x.content = 1  # a watching client's save: kept for the refill
    arena.release(x)
    assert x.holes and x.hollow == 0 and x.name in arena.free  # counted whole again
    assert y.dependents == set()
    assert arena.take_free(3 * MiB, tight=False) is None
    pool = SegmentPool(arena, StateLock(), 2, 32 * MiB)
    pool.note(4 * MiB)
    x.spare = True  # neither promoted to a spare nor handed out as one
    assert pool.promote_locked() == 0 and pool.take(3 * MiB, arena.uid) is None
    x.holes = []  # as the refill does once it allocated them (sharing.allocate_holes)
    assert arena.take_free(3 * MiB, tight=False) is x


def test_a_segment_the_sharer_reads_is_not_freed_until_it_is_done(arena):
    y = filled(arena, PAYLOAD)
    arena.sharing.hold([y])
    arena.release(y)
    assert y.orphan and y.name not in arena.free
    arena.sharing.let_go([y])
    assert not y.orphan and y.name in arena.free


def test_a_record_that_cannot_be_written_changes_nothing(arena, monkeypatch):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)

    def full(segment, runs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(arena.sharing.records, "write", full)
    with pytest.raises(OSError):
        arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y)
    assert (x.runs, x.holes, y.dependents) == ([], [], set())
    assert bytes(x.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD


def test_a_refill_reads_no_hole_past_the_source_payload():
    header = SimpleNamespace(payload_offset=HEADER_SIZE, payload_size=2 * MiB)
    source = SimpleNamespace(segment=SimpleNamespace(read_header=lambda: header))
    holes = [(HEADER_SIZE, 60 * MiB), (62 * MiB, 63 * MiB)]
    assert within_payload(source, holes) == [(HEADER_SIZE, HEADER_SIZE + 2 * MiB)]


def test_a_freed_hollow_segment_without_room_to_refill_is_unlinked(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    arena.limit = arena.used + MiB
    arena.release(x)
    assert x.name not in arena.segments and not os.path.exists(x.path)


def test_a_copy_back_outside_the_lock_meets_another_reader_that_finished_first(arena):
    """A load copies the pages back without the lock; another reader, under it, makes the
    segment whole meanwhile: the load's end finds nothing left to do, and the bytes hold."""
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    digests = [digest_bytes(PAYLOAD)]
    runs = arena.sharing.begin_whole(x, "x")
    assert y.readers == 1 and x.hollow == 0  # counted as in use before it is allocated
    assert arena.sharing.whole(x, STORAGE, digests, "x") == ""
    changed = arena.sharing.copy_whole(x, runs, STORAGE, digests, "x")
    assert arena.sharing.end_whole(x, runs, changed) == ""
    assert (x.runs, y.readers, y.dependents) == ([], 0, set())
    assert bytes(x.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD


def test_a_copy_back_that_failed_gives_the_pages_back_again(arena):
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    used = arena.used
    runs = arena.sharing.begin_whole(x, "x")
    arena.sharing.end_whole(x, runs, None)  # as after ENOSPC in copy_whole
    assert x.runs == runs and x.hollow == 3 * MiB and arena.used == used
    assert resident(x) <= 1 * MiB and y.readers == 0


def test_a_failed_copy_back_leaves_the_pages_another_copy_writes(arena):
    """Two loads copy the pages back at once and the first fails (tmpfs full): it gives
    nothing back, since the second copy writes those pages; the second finishes whole."""
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(x, arena.sharing.share(x, storage_pages(STORAGE, 4 * MiB), y))
    digests = [digest_bytes(PAYLOAD)]
    first = arena.sharing.begin_whole(x, "x")
    second = arena.sharing.begin_whole(x, "x")
    changed = arena.sharing.copy_whole(x, second, STORAGE, digests, "x")
    arena.sharing.end_whole(x, first, None)
    assert x.copying == 1 and x.hollow == 0 and resident(x) >= 3 * MiB
    assert arena.sharing.end_whole(x, second, changed) == ""
    assert (x.runs, x.copying, x.hollow) == ([], 0, 0)
    assert bytes(x.mapping[HEADER_SIZE : HEADER_SIZE + len(PAYLOAD)]) == PAYLOAD


def test_a_copy_back_failing_between_two_punch_steps_is_counted_once(make_core, monkeypatch):
    """A reader's copy back runs out of tmpfs after the sharer punched its first step: the
    failed copy gives every run's pages back and counts them; the sharer then punches no
    more, so what the budget counts as given back is what the runs cover, once."""
    core, _, _, older, _ = two_steps(make_core)
    monkeypatch.setattr(sharer, "_STEP", 4 * MiB)
    punch = sharing.Sharing.punch
    failed = []

    def punch_then_a_reader_without_room(x, ranges):
        punch(x, ranges)
        if not failed:
            with monkeypatch.context() as m:
                m.setattr(sharing, "_copy_back", raise_enospc)
                with pytest.raises(BudgetExceeded, match="no room"):
                    core.state.pin(older)
            failed.append(x.hollow)

    monkeypatch.setattr(sharing.Sharing, "punch", staticmethod(punch_then_a_reader_without_room))
    core.sharer.run_once()
    covered = sum(end - start for start, end in sharing.ranges_of(older.segment.runs))
    assert covered >= 12 * MiB and failed == [covered]  # every run given back by the failure
    assert older.segment.hollow == covered and older.pins == 0
    assert resident(older.segment) <= older.segment.capacity - covered


def raise_enospc(*_args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def two_steps(make_core) -> tuple:
    """A core and two digested step saves of the same 16 MiB (the comparison not started)."""
    core = make_core(memory_limit=256 * MiB, pool_bytes=0, share_pages=False)
    value = torch.randn(4 * MiB)
    session = core.saves.open_session(1, os.getuid())
    gens = []
    for step in (1, 2):
        path = f"/ckpt/iter_{step}/model.pt"
        save_object(core, session, path, value)
        gens.append(core.state.index.newest((NS, path)))
        digested(gens[-1])
    return core, value, session, *gens


def test_two_readers_copy_a_generation_back_one_at_a_time(make_core, monkeypatch):
    """Two loads of the same older checkpoint: the second waits for the first's copy back
    (outside the lock) instead of writing the same pages beside it, and finds it whole."""
    core, _, _, older, _ = two_steps(make_core)
    assert core.sharer.run_once() > 0 and older.segment.runs
    copy_back, copies = sharing._copy_back, []
    entered, go = threading.Event(), threading.Event()

    def slow_copy(x, runs) -> None:
        copies.append(1)
        entered.set()
        assert go.wait(10)
        copy_back(x, runs)

    monkeypatch.setattr(sharing, "_copy_back", slow_copy)
    first = threading.Thread(target=core.state.make_whole, args=(older,))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=core.state.make_whole, args=(older,))
    second.start()
    second.join(0.5)
    assert second.is_alive() and len(copies) == 1  # waiting, not copying
    go.set()
    first.join(10)
    second.join(10)
    assert copies == [1] and older.segment.runs == [] and not older.corrupt


def test_a_copy_back_that_found_changed_bytes_is_refused_after_another_finished(arena):
    """A copy back found a storage changed, after another reader had made the segment
    whole: its bytes are in the segment now, so the change is reported, never dropped."""
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.share(x, [(HEADER_SIZE, HEADER_SIZE + 2 * MiB)], y)
    first = arena.sharing.begin_whole(x, "x")
    second = arena.sharing.begin_whole(x, "x")
    assert arena.sharing.end_whole(x, first, "") == "" and x.runs == []
    assert arena.sharing.end_whole(x, second, "storage 0 differs") == "storage 0 differs"


def test_a_share_stopped_between_two_steps_records_only_what_it_gave_back(make_core, monkeypatch):
    """The newer save is deleted while the sharer punches the older one: the pages it had
    not punched yet stay resident and are backed no more, so a later share with an even newer
    save punches them, and the budget never counts a resident page as given back."""
    core, value, session, older, partner = two_steps(make_core)
    x = older.segment
    monkeypatch.setattr(sharer, "_STEP", 4 * MiB)
    punch = sharing.Sharing.punch

    def punch_then_the_partner_deleted(segment, ranges) -> None:
        punch(segment, ranges)
        if not partner.removed:
            core.state.retire_locked(partner)

    monkeypatch.setattr(sharing.Sharing, "punch", staticmethod(punch_then_the_partner_deleted))
    assert core.sharer.run_once() == 4 * MiB
    monkeypatch.setattr(sharing.Sharing, "punch", staticmethod(punch))
    assert x.hollow == sum(end - start for start, end in sharing.ranges_of(x.runs)) == 4 * MiB
    save_object(core, session, "/ckpt/iter_3/model.pt", value)
    digested(core.state.index.newest((NS, "/ckpt/iter_3/model.pt")))
    assert core.sharer.run_once() > 0
    assert x.hollow == sum(end - start for start, end in sharing.ranges_of(x.runs)) >= 12 * MiB
    assert resident(x) <= x.capacity - x.hollow


def test_a_restart_rebuilds_the_sharing_without_writing_a_record(arena, monkeypatch):
    """The runs are rebuilt from their record as it is: a full tmpfs at restart (another
    program's shared memory) must not keep the daemon from starting."""
    x, y = filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    monkeypatch.setattr(arena.sharing.records, "write", raise_enospc)
    arena.sharing.restore(x, [Run(HEADER_SIZE, HEADER_SIZE + 2 * MiB, y)])
    assert x.hollow == 2 * MiB and x in y.dependents
    assert resident(x) <= 4 * MiB - 2 * MiB + PAGE


def test_a_freed_hollow_segment_no_refill_will_fill_is_given_back(make_core):
    """One path saved again and again (keep 2) by a client that watches no storages: each
    freed segment has holes, and no refill will allocate them (it copies the newest save in
    for a watching client only), so it is unlinked rather than kept, never to be handed out,
    and counted in the budget."""
    core = make_core(memory_limit=256 * MiB, pool_bytes=0, share_pages=False, keep=2)
    value = torch.randn(4 * MiB)
    session = core.saves.open_session(1, os.getuid())
    path = "/ckpt/model.pt"
    for _ in range(6):
        save_object(core, session, path, value)
        digested(core.state.index.newest((NS, path)))
        core.sharer.run_once()
    arena = core.state.arena
    assert not [s.name for s in arena.free.values() if s.holes]
    assert len(arena.segments) <= 3 and arena.used <= 3 * 17 * MiB


def test_an_orphan_with_holes_is_unlinked_when_its_last_dependent_goes(arena):
    """A segment that backs another's pages and has holes of its own, freed while it is
    needed (an orphan): once the other goes, nothing will refill it, so it is unlinked, not
    left in the free pool (counted, never handed out)."""
    b, c, x = filled(arena, PAYLOAD), filled(arena, PAYLOAD), filled(arena, PAYLOAD)
    arena.sharing.punch(b, arena.sharing.share(b, [(HEADER_SIZE, HEADER_SIZE + MiB)], c))
    pages = [(HEADER_SIZE + MiB, HEADER_SIZE + 2 * MiB)]
    arena.sharing.punch(x, arena.sharing.share(x, pages, b))
    b.content = 1  # a watching client's save: its check as a freed segment is queued now
    arena.release(b)
    assert b.orphan and b.name in arena.segments
    arena.release(x)
    assert b.name not in arena.segments and b.name not in arena.free
    assert not os.path.exists(b.path)
