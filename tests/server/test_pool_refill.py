"""The spare pool in one process: sized from the saves it has seen (none before), bounded by
its byte limit, refilled after every save or receive that took a spare, never beyond the
budget; receives (backup copies, storage reads) take spares like saves; a clean stop leaves
only committed generations in the shm directory.

Built by :func:`ckptcache.server.daemon.build_core` on a private shm directory.
"""

from __future__ import annotations

import os
import time

import torch

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.server.state import Incoming
from ckptcache.wire import messages as m
from tests.helpers import wait_until
from tests.server.conftest import NS, object_bytes, save_object, written

MIB = 1 << 20


def spares(core) -> m.PoolReply:
    with core.state.lock.held():
        return core.pool.describe(core.state.arena.uid)


def settled(core, count: int) -> m.PoolReply | None:
    """The pool's reply once it holds ``count`` spares and is not growing."""
    reply = spares(core)
    return reply if len(reply.segments) == count and not reply.growing else None


def used(core) -> int:
    with core.state.lock.held():
        return core.state.arena.used


def payload(mib: int, fill: float = 1.0) -> torch.Tensor:
    """A tensor whose object takes a ``mib + 1`` MiB segment (payload plus header, rounded)."""
    return torch.full((mib * MIB // 4,), fill)


def teach(core, session, *mibs: int) -> m.PoolReply:
    """Save objects of these payload sizes under paths of their own (each needs a new
    segment) and return the pool once it holds a spare sized like each."""
    for i, mib in enumerate(mibs):
        save_object(core, session, f"/ckpt/teach-{i}.pt", payload(mib))
    return wait_until(lambda: settled(core, len(mibs)), what="the pool sized by the saves")


def test_no_spare_before_a_save_then_one_sized_like_it(make_core):
    """A core nobody saved to holds no spare (nothing is known of the sizes to come); after
    a 3 MiB save it holds one spare of that save's size, not a share of the pool bytes."""
    core = make_core(memory_limit=64 * MIB, pool_segments=2, pool_bytes=32 * MIB)
    session = core.saves.open_session(1, 0)
    save_object(core, session, "/ckpt/a.pt", payload(3))
    reply = wait_until(lambda: settled(core, 1), what="one spare")
    assert reply.capacities == (4 * MIB,)
    assert used(core) == 8 * MIB  # the committed object and its spare: nothing else


def test_the_pool_bytes_bound_what_is_made(make_core):
    """A save larger than ``pool_bytes`` is never pre-made; a smaller one is."""
    core = make_core(memory_limit=64 * MIB, pool_segments=2, pool_bytes=4 * MIB)
    session = core.saves.open_session(1, 0)
    save_object(core, session, "/ckpt/big.pt", payload(9))
    wait_until(lambda: not spares(core).growing)
    assert spares(core).segments == ()  # a 10 MiB spare would pass the 4 MiB bound
    assert used(core) == 10 * MIB
    save_object(core, session, "/ckpt/small.pt", payload(2))
    assert wait_until(lambda: settled(core, 1)).capacities == (3 * MIB,)


def test_a_clean_stop_leaves_only_committed_generations(make_core):
    """Spares and reusable free segments hold no data: the stop unlinks them; the committed
    generation stays for the next incarnation."""
    core = make_core(memory_limit=64 * MIB, pool_segments=2, pool_bytes=32 * MIB)
    session = core.saves.open_session(1, 0)
    kept = save_object(core, session, "/ckpt/kept.pt", payload(2)).segment
    save_object(core, session, "/ckpt/gone.pt", payload(5))
    wait_until(lambda: settled(core, 2))
    core.retention.delete(session, m.DeleteRequest(NS, "/ckpt/gone.pt"))
    with core.state.lock.held():
        directory = core.state.arena.directory
        assert core.state.arena.free  # the deleted object's segment, and the spares
    core.shutdown()
    left = [name for name in os.listdir(directory) if name.startswith("seg-")]
    assert left == [os.path.basename(kept)]


def test_a_spare_taken_through_the_free_list_is_replaced(make_core):
    limit = 64 * MIB
    core = make_core(memory_limit=limit, pool_segments=1, pool_bytes=16 * MIB)
    session = core.saves.open_session(1, 0)
    (spare,) = teach(core, session, 15).segments  # a 16 MiB spare
    # 9 MiB of payload: the 16 MiB spare is within twice the need, so the free list hands
    # it over whole (no trim on the save's path).
    assert save_object(core, session, "/ckpt/a.pt", payload(9, 2.0)).segment == spare
    with core.state.lock.held():
        assert core.state.arena.segments[spare].capacity == 16 * MIB
    reply = wait_until(lambda: settled(core, 1), what="the pool refilled")
    assert reply.segments[0] != spare
    assert reply.capacities == (10 * MIB,)  # sized like the save that took the last one
    assert used(core) <= limit
    with core.state.lock.held():
        gen = core.state.index.newest((NS, "/ckpt/a.pt"))
        assert gen is not None and gen.segment.name == spare


def test_a_receive_takes_a_spare_and_the_pool_refills(make_core):
    limit = 128 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=32 * MIB)
    session = core.saves.open_session(1, 0)
    first = set(teach(core, session, 15, 15).segments)  # two 16 MiB spares
    value = torch.arange(3 * MIB // 4, dtype=torch.float32)
    plan, buf = object_bytes("/ckpt/b.pt", value)

    def fill(view: memoryview, advance) -> None:
        view[:] = buf[HEADER_SIZE:]
        advance(len(view))

    gen = core.ingest.receive(Incoming(
        NS, "/ckpt/b.pt", plan.layout.nbytes, plan.layout.manifest_offset,
        len(plan.manifest_bytes), fill, "peer", verify=False,
    ))  # fmt: skip
    assert gen.segment.name in first  # a spare, not a segment made inline
    with core.state.lock.held():
        assert gen.segment.capacity == 4 * MIB  # a 16 MiB spare trimmed to a 3 MiB object
    reply = wait_until(lambda: settled(core, 2), what="the pool refilled")
    assert gen.segment.name not in reply.segments
    assert 4 * MIB in reply.capacities
    assert used(core) <= limit
    loaded = core.loads.open(session, m.OpenRequest(NS, "/ckpt/b.pt"))
    assert loaded.generation == gen.number


def test_the_pool_never_grows_beyond_the_budget(make_core):
    limit = 24 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=16 * MIB, keep=1)
    session = core.saves.open_session(1, 0)
    for i in range(3):
        # Memory-only paths: the committed generations hold most of the budget.
        save_object(core, session, f"/ckpt/p{i}.pt", torch.full((5 * MIB // 4,), float(i)))
        assert used(core) <= limit
        wait_until(lambda: not spares(core).growing)
        assert used(core) <= limit
    with core.state.lock.held():
        assert sum(s.capacity for s in core.state.arena.segments.values()) <= limit


def test_spares_of_a_size_no_save_has_are_replaced(make_core):
    limit = 64 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=16 * MIB)
    session = core.saves.open_session(1, 0)
    first = set(teach(core, session, 7, 7).segments)
    assert spares(core).capacities == (8 * MIB, 8 * MIB)
    for i in range(2):  # 10 MiB segments: the 8 MiB spares are too small, made inline
        assert save_object(core, session, f"/ckpt/s{i}.pt", payload(9)).segment not in first

    # Both stale spares give way to one of the size the saves have (16 MiB of pool bytes).
    def replaced() -> m.PoolReply | None:
        reply = settled(core, 1)
        return reply if reply is not None and reply.capacities == (10 * MIB,) else None

    reply = wait_until(replaced, what="the stale spares replaced")
    assert not set(reply.segments) & first
    assert used(core) <= limit
    assert save_object(core, session, "/ckpt/s2.pt", payload(9)).segment == reply.segments[0]


def test_a_freed_segment_becomes_the_spare_when_the_budget_has_no_room_for_one(make_core):
    """A budget too full to grow a spare, then a checkpoint deleted: its segment (allocated
    already, the size the saves have) is listed as the spare, so a new client maps it ahead
    of its save instead of meeting it unmapped inside the save; nothing is allocated."""
    limit = 16 * MIB
    core = make_core(memory_limit=limit, pool_segments=1, pool_bytes=8 * MIB)
    session = core.saves.open_session(1, 0)
    first = save_object(core, session, "/ckpt/a.pt", payload(4, 1.0)).segment
    wait_until(lambda: settled(core, 1), what="the first spare")
    save_object(core, session, "/ckpt/b.pt", payload(4, 2.0))  # takes it; one more is made
    wait_until(lambda: settled(core, 1), what="the second spare")
    save_object(core, session, "/ckpt/c.pt", payload(4, 3.0))  # takes it: 15 of 16 MiB used
    wait_until(lambda: not spares(core).growing)
    assert spares(core).segments == ()  # no room for another 5 MiB

    core.retention.delete(session, m.DeleteRequest(NS, "/ckpt/a.pt"))
    reply = spares(core)
    assert reply.segments == (first,) and reply.capacities == (5 * MIB,)
    assert used(core) == 15 * MIB
    # A new client that was told of it gets it, and what it committed there is what is read.
    other = core.saves.open_session(2, 0)
    core.queries.pool_info(other, m.PoolRequest())
    value = payload(4, 4.0)
    assert save_object(core, other, "/ckpt/d.pt", value).segment == first
    loaded = core.loads.open(other, m.OpenRequest(NS, "/ckpt/d.pt"))
    assert loaded.segment == first
    with core.state.lock.held():
        gen = core.state.index.newest((NS, "/ckpt/d.pt"))
    assert gen is not None
    (record,) = gen.manifest.storages
    view = core.state.arena.segments[first].view()
    try:
        assert bytes(view[record.offset : record.offset + record.nbytes]) == value.numpy().tobytes()
    finally:
        del view


def test_a_restarted_daemon_sizes_its_spares_from_the_adopted_records(make_core):
    """A restart adopts the committed generations; their records size the spares at once, so
    the next job's first save finds one made, where a fresh daemon holds none."""
    shm = f"/dev/shm/ckptcache-test-restart-{os.getpid()}"
    options = {"memory_limit": 64 * MIB, "pool_segments": 2, "pool_bytes": 32 * MIB}
    first = make_core(shm_dir=shm, **options)
    session = first.saves.open_session(1, 0)
    save_object(first, session, "/ckpt/job/step-1/model.pt", payload(3))
    save_object(first, session, "/ckpt/job/step-1/optim.pt", payload(5))
    first.shutdown()  # a clean stop keeps memory-only generations for the next incarnation
    # Segment names carry the incarnation (start second and pid): in one process, the next
    # core must start in another second not to reuse the first one's names.
    time.sleep(1.1)
    second = make_core(shm_dir=shm, **options)
    listed = second.queries.list(second.saves.open_session(1, 0), m.ListRequest(NS, "/ckpt/job"))
    assert {info.path for info in listed.objects} == {
        "/ckpt/job/step-1/model.pt",
        "/ckpt/job/step-1/optim.pt",
    }
    reply = wait_until(lambda: settled(second, 2), what="spares sized from the records")
    assert sorted(reply.capacities) == [4 * MIB, 6 * MIB]


def test_the_grower_waits_while_the_next_file_of_a_checkpoint_is_saved(make_core):
    """A checkpoint's files are saved back to back: the commit of one wakes the grower, which
    makes no spare while another is reserved and being written (its allocation would take a
    core from that copy), reports itself growing meanwhile (a client asking then follows the
    spare to come), and makes the spares once saves pause. Both files commit whole."""
    core = make_core(memory_limit=64 * MIB, pool_segments=2, pool_bytes=32 * MIB)
    session = core.saves.open_session(1, 0)
    _, first = written(core, session, "/ckpt/model.pt", payload(3))
    plan, data = object_bytes("/ckpt/optim.pt", payload(2, fill=2.0))
    reply = core.saves.reserve(session, m.ReserveRequest(NS, "/ckpt/optim.pt", len(data), "local"))
    model = core.saves.commit(session, first).generation
    # Woken by that commit, the grower waits (for at most a second) for saves to pause.
    wait_until(lambda: spares(core).growing, what="the grower woken")
    time.sleep(0.2)  # a 4 MiB spare takes milliseconds to make: none is made meanwhile
    waiting = spares(core)
    assert waiting.segments == () and waiting.growing
    assert used(core) == 4 * MIB + 3 * MIB  # the two files' segments, no spare
    view = core.state.arena.segments[reply.segment].view()
    try:
        view[: len(data)] = data
    finally:
        del view
    commit = m.CommitRequest(reply.reservation, plan.layout.manifest_offset,
                             len(plan.manifest_bytes))  # fmt: skip
    optim = core.saves.commit(session, commit).generation
    spared = wait_until(lambda: settled(core, 2), what="the spares, once saves paused")
    assert sorted(spared.capacities) == [3 * MIB, 4 * MIB]
    with core.state.lock.held():
        index = core.state.index
        saved = {p: index.newest((NS, p)) for p in ("/ckpt/model.pt", "/ckpt/optim.pt")}
    assert [g.number for g in saved.values()] == [model, optim]
    segment = saved["/ckpt/optim.pt"].segment
    assert segment.name == reply.segment
    view = segment.view()
    try:
        end = plan.layout.manifest_offset  # the archive up to its manifest, as written
        assert bytes(view[HEADER_SIZE:end]) == bytes(data[HEADER_SIZE:end])
    finally:
        del view
