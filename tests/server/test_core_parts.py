"""The daemon's local parts in one process (no sockets): budget, eviction, retention, waits.

Built by :func:`ckptcache.server.daemon.build_core` on a private shm directory, driven
through the same calls the control service makes.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckptcache.errors import BudgetExceeded, CheckpointNotFound
from ckptcache.wire import messages as m
from ckptcache.wire.states import WaitState
from tests.helpers import wait_until
from tests.server.conftest import NS, digested, save_object

MIB = 1 << 20


def numbers(core, path):
    with core.state.lock.held():
        return [g.number for g in core.state.index.generations((NS, path))]


def test_retention_keeps_the_newest_generations(make_core):
    core = make_core(pool_bytes=0, memory_limit=16 * MIB, keep=2)
    session = core.saves.open_session(1, 0)
    for i in range(4):
        assert (
            save_object(core, session, "/ckpt/a.pt", torch.full((1000,), float(i))).generation
            == i + 1
        )
    assert numbers(core, "/ckpt/a.pt") == [3, 4]
    info = core.queries.stat(session, m.StatRequest(NS, "/ckpt/a.pt"))
    assert (info.generation, info.generations, info.persist_state) == (4, 2, "memory-only")
    # The retired generations' segments are freed once the background digester unpins them.
    arena = core.state.arena
    wait_until(lambda: len(arena.segments) == 2 + len(arena.free), what="retired segments freed")
    wait = core.queries.wait(session, m.WaitRequest(NS, "/ckpt/a.pt", timeout=0.0))
    assert (wait.state, wait.generation) == (WaitState.MEMORY_ONLY, 4)
    assert core.retention.delete(session, m.DeleteRequest(NS, "/ckpt/a.pt")).dropped == 2
    with pytest.raises(CheckpointNotFound, match="not in the memory of node 'unit'"):
        core.queries.stat(session, m.StatRequest(NS, "/ckpt/a.pt"))


def test_budget_evicts_only_unpinned_superseded_generations(make_core):
    core = make_core(pool_bytes=0, memory_limit=6 * MIB, keep=2, reserve_timeout=0.2)
    session = core.saves.open_session(1, 0)
    save_object(core, session, "/ckpt/a.pt", torch.zeros(MIB // 4))
    save_object(core, session, "/ckpt/a.pt", torch.ones(MIB // 4))
    lease = core.loads.open(session, m.OpenRequest(NS, "/ckpt/a.pt", generation=1))
    save_object(core, session, "/ckpt/b.pt", torch.ones(MIB // 4))
    assert core.state.arena.used == 6 * MIB  # 2 MiB each: 1 MiB and a header
    # Full: generation 1 of a.pt is pinned and the rest are the newest of their paths.
    with pytest.raises(BudgetExceeded, match=r"no room for .* of '/ckpt/b\.pt'"):
        save_object(core, session, "/ckpt/b.pt", torch.full((MIB // 4,), 2.0))
    core.loads.release(session, m.ReleaseRequest((lease.lease,)))
    with core.state.lock.held():
        gens = [
            g for p in ("/ckpt/a.pt", "/ckpt/b.pt") for g in core.state.index.generations((NS, p))
        ]
    for gen in gens:
        digested(gen)  # a digester still hashing generation 1 would keep it from eviction
    assert save_object(core, session, "/ckpt/b.pt", torch.full((MIB // 4,), 2.0)).generation == 2
    assert numbers(core, "/ckpt/a.pt") == [2]  # evicted: superseded and no longer pinned
    assert numbers(core, "/ckpt/b.pt") == [1, 2]
    assert core.state.arena.used <= 6 * MIB


def test_closing_a_session_drops_its_pins_and_reservations(make_core):
    core = make_core(pool_bytes=0, memory_limit=8 * MIB)
    session = core.saves.open_session(1, 0)
    save_object(core, session, "/ckpt/a.pt", torch.ones(10))
    with core.state.lock.held():
        gen = core.state.index.newest((NS, "/ckpt/a.pt"))
    assert gen is not None
    digested(gen)  # the only pin left to count is the session's lease
    core.loads.open(session, m.OpenRequest(NS, "/ckpt/a.pt"))
    core.saves.reserve(session, m.ReserveRequest(NS, "/ckpt/b.pt", 4096))
    assert gen.pins == 1
    core.saves.close_session(session)
    assert gen.pins == 0 and session.reservations == {} and session.leases == {}
    assert numbers(core, "/ckpt/b.pt") == []


def test_state_owner_wait_for_wakes_on_notify(make_core):
    core = make_core(pool_bytes=0, memory_limit=4 * MIB)
    flag: list[int] = []

    def later():
        with core.state.lock.held():
            flag.append(1)
        core.state.lock.notify_all()

    timer = threading.Timer(0.05, later)
    timer.start()
    assert core.state.lock.wait_for(lambda: bool(flag), timeout=30) is True
    timer.join()
    assert core.state.lock.wait_for(lambda: False, timeout=0.0) is False


def test_the_lock_port_is_reentrant_and_excludes_other_threads(make_core):
    lock = make_core(pool_bytes=0, memory_limit=4 * MIB).state.lock
    entered = threading.Event()

    def other():
        with lock.held():
            entered.set()

    with lock.held():
        with lock.held():  # re-entrant: a *_locked method called by a part holding it
            lock.notify_all()
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.2)  # excluded while this thread holds it
    thread.join(30)
    assert entered.is_set()
    assert not isinstance(lock.held(), type(threading.Condition()))


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_file_planted_under_a_free_segments_name_is_neither_opened_nor_reused(
    make_core, tmp_path, planted
):
    """An admitted user may write its own segment directory: a FIFO swapped in for a free
    segment made the reuse check block under the state lock (the daemon hung for every
    user), and a symlink made it open whatever it pointed to."""
    core = make_core(pool_bytes=0, memory_limit=8 * MIB)
    session = core.saves.open_session(1, 0)
    first = save_object(core, session, "/ckpt/a.pt", torch.ones(10))
    with core.state.lock.held():
        gen = core.state.index.newest((NS, "/ckpt/a.pt"))
    assert gen is not None
    digested(gen)
    core.retention.delete(session, m.DeleteRequest(NS, "/ckpt/a.pt"))
    seg = core.state.arena.segments[first.segment]
    assert seg.name in core.state.arena.free
    os.unlink(seg.path)
    if planted == "fifo":
        os.mkfifo(seg.path)
    else:
        target = tmp_path / "elsewhere"
        target.write_bytes(b"\0" * 4096)
        os.symlink(target, seg.path)
    done: list = []
    saver = threading.Thread(
        target=lambda: done.append(save_object(core, session, "/ckpt/b.pt", torch.ones(10))),
        daemon=True,
    )
    saver.start()
    saver.join(30)
    assert done, "the save hung on the planted file"
    assert done[0].segment != first.segment  # not reused
    assert core.queries.stat(session, m.StatRequest(NS, "/ckpt/b.pt")).generation == 1
