"""The spare pool in one process: refilled after every save or receive that took a spare,
never beyond the budget; receives (backup copies, storage reads) take spares like saves.

Built by :func:`ckptcache.server.daemon.build_core` on a private shm directory.
"""

from __future__ import annotations

import torch

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.wire import messages as m
from tests.helpers import wait_until
from tests.unit.conftest import NS, object_bytes, save_object

MIB = 1 << 20


def spares(core) -> m.PoolReply:
    with core.state.locked():
        return core.pool.describe(core.state.arena.uid)


def settled(core, count: int) -> m.PoolReply | None:
    """The pool's reply once it holds ``count`` spares and is not growing."""
    reply = spares(core)
    return reply if len(reply.segments) == count and not reply.growing else None


def used(core) -> int:
    with core.state.locked():
        return core.state.arena.used


def test_a_spare_taken_through_the_free_list_is_replaced(make_core):
    limit = 64 * MIB
    core = make_core(memory_limit=limit, pool_segments=1, pool_bytes=16 * MIB)
    (spare,) = wait_until(lambda: settled(core, 1)).segments
    session = core.saves.open_session(1, 0)
    # 9 MiB of payload: the 16 MiB spare is within twice the need, so the free list hands
    # it over whole (no trim on the save's path).
    value = torch.full((9 * MIB // 4,), 2.0)
    assert save_object(core, session, "/ckpt/a.pt", value).segment == spare
    with core.state.locked():
        assert core.state.arena.segments[spare].capacity == 16 * MIB
    reply = wait_until(lambda: settled(core, 1), what="the pool refilled")
    assert reply.segments[0] != spare
    assert reply.capacities == (10 * MIB,)  # sized like the save that took the last one
    assert used(core) <= limit
    with core.state.locked():
        gen = core.state.index.newest((NS, "/ckpt/a.pt"))
        assert gen is not None and gen.segment.name == spare


def test_a_receive_takes_a_spare_and_the_pool_refills(make_core):
    limit = 64 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=32 * MIB)
    first = set(wait_until(lambda: settled(core, 2)).segments)
    value = torch.arange(3 * MIB // 4, dtype=torch.float32)
    plan, buf = object_bytes("/ckpt/b.pt", value)

    def fill(view: memoryview, advance) -> None:
        view[:] = buf[HEADER_SIZE:]
        advance(len(view))

    gen = core.ingest.receive(
        NS, "/ckpt/b.pt", plan.layout.nbytes, plan.layout.manifest_offset,
        len(plan.manifest_bytes), fill, "peer", verify=False,
    )  # fmt: skip
    assert gen.segment.name in first  # a spare, not a segment made inline
    with core.state.locked():
        assert gen.segment.capacity == 4 * MIB  # a 16 MiB spare trimmed to a 3 MiB object
    reply = wait_until(lambda: settled(core, 2), what="the pool refilled")
    assert gen.segment.name not in reply.segments
    assert 4 * MIB in reply.capacities
    assert used(core) <= limit
    session = core.saves.open_session(1, 0)
    loaded = core.loads.open(session, m.OpenRequest(NS, "/ckpt/b.pt"))
    assert loaded.generation == gen.number


def test_the_pool_never_grows_beyond_the_budget(make_core):
    limit = 24 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=16 * MIB, keep=1)
    wait_until(lambda: settled(core, 2))
    session = core.saves.open_session(1, 0)
    for i in range(3):
        # Memory-only paths: the committed generations hold most of the budget.
        save_object(core, session, f"/ckpt/p{i}.pt", torch.full((5 * MIB // 4,), float(i)))
        assert used(core) <= limit
        wait_until(lambda: not spares(core).growing)
        assert used(core) <= limit
    with core.state.locked():
        assert sum(s.capacity for s in core.state.arena.segments.values()) <= limit


def test_spares_of_a_size_no_save_has_are_replaced(make_core):
    limit = 64 * MIB
    core = make_core(memory_limit=limit, pool_segments=2, pool_bytes=16 * MIB)
    first = set(wait_until(lambda: settled(core, 2)).segments)
    assert spares(core).capacities == (8 * MIB, 8 * MIB)  # a share each before any save
    session = core.saves.open_session(1, 0)
    value = torch.full((9 * MIB // 4,), 1.0)
    for i in range(2):  # 10 MiB segments: the 8 MiB spares are too small, made inline
        assert save_object(core, session, f"/ckpt/s{i}.pt", value).segment not in first

    # Both stale spares give way to one of the size the saves have (16 MiB of pool bytes).
    def replaced() -> m.PoolReply | None:
        reply = settled(core, 1)
        return reply if reply is not None and reply.capacities == (10 * MIB,) else None

    reply = wait_until(replaced, what="the stale spares replaced")
    assert not set(reply.segments) & first
    assert used(core) <= limit
    assert save_object(core, session, "/ckpt/s2.pt", value).segment == reply.segments[0]
