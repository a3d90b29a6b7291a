"""Background work after the saves in flight (``ckptcache/server/quiet.py``): the daemon
counts its open reservations through every way one ends, and the digester (as the persist
workers) starts a generation's work once saves pause, or a bounded time after its commit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckptcache.server import quiet
from ckptcache.server.quiet import SavesInFlight
from ckptcache.wire import messages as m
from tests.helpers import wait_until
from tests.server.conftest import NS, written


def _waiter(in_flight: SavesInFlight, **kwargs: float) -> tuple[threading.Thread, list[bool]]:
    out: list[bool] = []
    thread = threading.Thread(target=lambda: out.append(in_flight.wait_quiet(**kwargs)))
    thread.start()
    return thread, out


def test_nothing_in_flight_is_quiet_at_once():
    assert SavesInFlight().wait_quiet(settle=0.01, most=0.0) is True


def test_a_wait_ends_once_the_last_save_ends_and_settles():
    in_flight = SavesInFlight()
    in_flight.begin()
    in_flight.begin()
    thread, out = _waiter(in_flight, settle=0.02, most=60.0)
    in_flight.end()
    time.sleep(0.1)
    assert thread.is_alive() and out == []  # one save still in flight
    in_flight.end()
    thread.join(30)
    assert out == [True] and in_flight.open == 0


def test_a_wait_is_bounded():
    in_flight = SavesInFlight()
    in_flight.begin()  # a save that never ends
    assert in_flight.wait_quiet(settle=0.01, most=0.05) is False
    # A generation committed more than the bound ago waits no more.
    assert in_flight.wait_after(time.time() - quiet.MAX_WAIT_SECONDS - 1) is False


def test_a_commit_time_from_a_clock_ahead_waits_no_longer_than_the_bound(monkeypatch):
    """A copy's commit time is the saving node's: an hour ahead must not hold its digest
    and persist for an hour behind a save that never ends."""
    monkeypatch.setattr(quiet, "MAX_WAIT_SECONDS", 0.05)
    in_flight = SavesInFlight()
    in_flight.begin()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (in_flight.wait_after(time.time() + 3600), done.set()))
    thread.start()
    thread.join(30)
    assert done.is_set()


def test_ends_never_count_below_zero():
    in_flight = SavesInFlight()
    in_flight.end(3)
    in_flight.begin()
    assert in_flight.open == 1


def test_every_way_a_reservation_ends_is_counted(make_core):
    core = make_core(pool_bytes=0, memory_limit=64 << 20)
    counter = core.state.saves_in_flight
    session = core.saves.open_session(1, 0)
    reply, commit = written(core, session, "/ckpt/a.pt", torch.ones(1000))
    assert counter.open == 1
    core.saves.commit(session, commit)
    assert counter.open == 0
    reply, _ = written(core, session, "/ckpt/b.pt", torch.ones(1000))
    core.saves.abort(session, m.AbortRequest(reply.reservation))
    assert counter.open == 0
    written(core, session, "/ckpt/c.pt", torch.ones(1000))
    written(core, session, "/ckpt/d.pt", torch.ones(1000))
    assert counter.open == 2
    core.saves.close_session(session)  # the client went away
    assert counter.open == 0


def test_the_digest_of_a_file_waits_for_the_next_file_of_the_checkpoint(
    make_core, monkeypatch: pytest.MonkeyPatch
):
    """The model file is committed while the optimizer file's save is in flight: its digest
    starts once that save is committed, not beside its copy."""
    monkeypatch.setattr(quiet, "MAX_WAIT_SECONDS", 60.0)
    core = make_core(pool_bytes=0, memory_limit=64 << 20)
    session = core.saves.open_session(1, 0)
    _, optimizer = written(core, session, "/ckpt/optim.pt", torch.ones(1000))
    _, model = written(core, session, "/ckpt/model.pt", torch.zeros(1000))
    core.saves.commit(session, model)
    with core.state.lock.held():
        (gen,) = core.state.index.generations((NS, "/ckpt/model.pt"))
    time.sleep(0.3)
    assert gen.digests is None  # the optimizer file is still being copied
    core.saves.commit(session, optimizer)
    wait_until(lambda: gen.digests is not None, what="the model file's digest")
