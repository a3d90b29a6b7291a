"""Staging copies in the daemon's parts (``commit_pinned``): pinned by the commit itself,
never digested, announced or persisted, and dropped with their lease or their session."""

from __future__ import annotations

import pytest
import torch

from ckptcache.errors import BudgetExceeded, CheckpointNotFound, CkptCacheError
from ckptcache.wire import messages as m
from tests.server.conftest import NS, save_object, written

MIB = 1 << 20


def stage_object(core, session, path: str, value: torch.Tensor, durability: str = "memory"):
    """Reserve, write and ``commit_pinned`` ``{"w": value}`` as ``Client.stage`` does."""
    _, commit = written(core, session, path, value, durability)
    return core.saves.commit_pinned(session, commit)


def held(core, path: str):
    with core.state.lock.held():
        return core.state.index.newest((NS, path))


def test_a_staging_copy_is_held_until_its_lease_is_released(make_core):
    # 2 MiB each (1 MiB and a header): an object under a MiB would cost only its pages.
    core = make_core(pool_bytes=0, memory_limit=6 * MIB, reserve_timeout=0.2)
    session = core.saves.open_session(1, 0)
    reply = stage_object(core, session, "/tmp/stage-a", torch.ones(MIB // 4))
    gen = held(core, "/tmp/stage-a")
    assert (reply.generation, gen.staged_by, gen.pins) == (1, reply.lease, 1)
    assert gen.digests is None and not gen.needs_persist  # nobody but its holder needs it
    save_object(core, session, "/ckpt/b.pt", torch.ones(MIB // 4))
    save_object(core, session, "/ckpt/c.pt", torch.ones(MIB // 4))
    with pytest.raises(BudgetExceeded):  # full: the staging copy is not evicted for room
        save_object(core, session, "/ckpt/d.pt", torch.ones(MIB // 4))
    assert held(core, "/tmp/stage-a") is gen
    # Another client's load of it pins it; that lease's end leaves the copy to its holder.
    reader = core.saves.open_session(2, 0)
    opened = core.loads.open(reader, m.OpenRequest(NS, "/tmp/stage-a"))
    core.loads.release(reader, m.ReleaseRequest((opened.lease,)))
    assert held(core, "/tmp/stage-a") is gen and gen.pins == 1
    core.loads.release(session, m.ReleaseRequest((reply.lease,)))
    assert held(core, "/tmp/stage-a") is None and gen.removed and gen.pins == 0
    assert save_object(core, session, "/ckpt/d.pt", torch.ones(MIB // 4)).generation == 1
    core.loads.release(session, m.ReleaseRequest((reply.lease,)))  # twice: ignored


def test_a_closed_session_drops_its_staging_copies(make_core):
    core = make_core(pool_bytes=0, memory_limit=8 * MIB)
    session = core.saves.open_session(1, 0)
    stage_object(core, session, "/tmp/stage-a", torch.ones(1000))
    gen = held(core, "/tmp/stage-a")
    core.saves.close_session(session)  # the trainer died
    assert held(core, "/tmp/stage-a") is None and gen.removed and gen.pins == 0
    assert core.state.arena.free  # its segment is free again
    with pytest.raises(CheckpointNotFound):
        core.queries.stat(core.saves.open_session(2, 0), m.StatRequest(NS, "/tmp/stage-a"))


def test_only_a_memory_reservation_becomes_a_staging_copy(make_core, tmp_path):
    core = make_core(pool_bytes=0, memory_limit=8 * MIB)
    session = core.saves.open_session(1, 0)
    with pytest.raises(CkptCacheError, match="must be reserved with durability 'memory'"):
        stage_object(core, session, str(tmp_path / "a.pt"), torch.ones(10), "local")
    assert held(core, str(tmp_path / "a.pt")) is None
    assert not session.reservations  # the refused reservation was given back
