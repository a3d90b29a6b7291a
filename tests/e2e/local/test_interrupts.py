"""A Ctrl-C (a ``KeyboardInterrupt`` raised by a signal handler) inside a save, a load or a
wait, against a real daemon: the client's connection ends at once (the daemon aborts the
interrupted reservation with it), the next call works, and the collector is back on.

The interrupts are raised only while the operation's own frames run (:func:`_interrupt`): a
signal landing in the test's loop would end the test instead of the operation."""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from rpyc.core.stream import SocketStream

from ckptcache.client._connection import Connection
from ckptcache.format import gcpause
from ckptcache.wire import messages as m
from tests.helpers import DaemonProc, assert_same, wait_until


def _operation(run: Callable[[], Any]) -> Any:
    """Runs ``run``: the frame :func:`_interrupt` looks for."""
    return run()


def _interrupted(run: Callable[[], Any], rng: random.Random, span: float) -> bool:
    """Runs ``run`` with a SIGALRM at a random moment of its first ``span`` seconds; whether
    its ``KeyboardInterrupt`` landed inside."""
    try:
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, span))
        _operation(run)
    except KeyboardInterrupt:
        return True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    while frame is not None:
        if frame.f_code is _operation.__code__:
            raise KeyboardInterrupt
        frame = frame.f_back


@pytest.fixture
def sigalrm_interrupts() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _interrupt)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def persisting(daemon_factory: Callable[..., DaemonProc], tmp_path: Path) -> DaemonProc:
    root = tmp_path / "ckpt"
    root.mkdir()
    return daemon_factory("--memory-limit", "1GiB", "--persist-root", str(root))


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256, 1024), float(i)) for i in range(16)}  # 16 MiB


def test_daemon_status_counts_open_reservations(daemon: DaemonProc, tmp_path: Path):
    with daemon.client() as c:
        conn: Connection = c._parts.connection  # type: ignore[attr-defined]
        reply = conn.call(
            "reserve", c._parts.saves.reserve_request(str(tmp_path / "a.pt"), 4096, "local"),
            m.ReserveReply,
        )  # fmt: skip
        assert daemon.status().reservations == 1
        conn.call("abort", m.AbortRequest(reply.reservation))
        assert daemon.status().reservations == 0


def test_ctrl_c_after_the_reservation_gives_its_memory_back(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The interrupt lands as the reservation's reply is read: the daemon reserved the
    memory, the client never learnt of it. The daemon aborts that reservation (it used to hold
    its memory until the client's connection ended), so the next save fits."""
    d = daemon_factory("--memory-limit", "80MiB")
    reads = SocketStream.read
    armed = [False]

    def read(self: SocketStream, count: int) -> bytes:
        data = reads(self, count)
        if armed[0] and count > 5:  # the reply's body, after its header
            armed[0] = False
            raise KeyboardInterrupt
        return data

    requests = Connection.request

    def request(self: Connection, kind: str, *args: Any, **kwargs: Any) -> Any:
        armed[0] = kind == "reserve"
        return requests(self, kind, *args, **kwargs)

    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(32)}  # 32 MiB
    with d.client(timeout=20, fallback="raise") as c:
        c.save(state, str(tmp_path / "a.pt"))
        monkeypatch.setattr(SocketStream, "read", read)
        monkeypatch.setattr(Connection, "request", request)
        with pytest.raises(KeyboardInterrupt):
            c.save(state, str(tmp_path / "b.pt"))
        monkeypatch.undo()
        assert gc.isenabled() and gcpause.open_regions() == 0
        wait_until(lambda: d.status().reservations == 0, timeout=5, what="the abort")
        state["w0"].fill_(7.0)
        c.save(state, str(tmp_path / "c.pt"))  # fits: no BudgetExceeded
        assert_same(c.load(str(tmp_path / "c.pt")), state)
        assert not c.exists(str(tmp_path / "b.pt"))
        assert c.daemon_status().reservations == 0


# The storm takes SIGALRM, which the suite's own timeout would use: a watchdog thread instead
# (a hang fails the run with every thread's stack, never waits out CI's limit).
@pytest.mark.timeout(240, method="thread")
def test_a_storm_of_ctrl_c_across_saves_loads_and_waits(
    persisting: DaemonProc, tmp_path: Path, sigalrm_interrupts: None
):
    """200 saves, loads, loads into given tensors and waits, each with a SIGALRM at a random moment of its run raising
    ``KeyboardInterrupt``: afterwards the collector is on, no reservation is open, every
    segment is free once the objects are deleted, and every call works."""
    paths = [str(tmp_path / "ckpt" / f"{i}.pt") for i in range(3)]
    state = _state()
    live = {k: torch.zeros_like(v) for k, v in state.items()}  # a trainer's own tensors
    rng = random.Random(43)
    interrupted = 0
    with persisting.client(timeout=10) as c:
        for p in paths:
            c.save(state, p)
        c.wait(prefix=str(tmp_path / "ckpt"))
        t0 = time.perf_counter()
        c.save(state, paths[0])
        span = max(time.perf_counter() - t0, 0.002)
        for i in range(200):
            path = paths[i % len(paths)]
            run: Callable[[], Any] = (
                lambda p=path: c.save(state, p),
                lambda p=path: c.load(p),
                lambda p=path: c.load_into(p, live),
                lambda p=path: c.wait(p, timeout=10),
            )[i % 4]
            interrupted += _interrupted(run, rng, span)
            c.daemon_status()  # answers at once: no DaemonUnavailable after the timeout
        assert interrupted >= 20  # the storm did land inside the calls
        assert gc.isenabled() and gcpause.open_regions() == 0
        wait_until(lambda: persisting.status().reservations == 0, timeout=5, what="the aborts")
        # Every call works: a save, its load and its persist.
        state["w1"].fill_(-1.0)
        c.save(state, paths[0], durability="persisted")
        assert_same(c.load(paths[0]), state)
        assert_same(c.load_into(paths[0], live), state)
        assert_same(live, state)
        c.wait(prefix=str(tmp_path / "ckpt"), timeout=30)
        assert_same(torch.load(paths[0], weights_only=True), state)
        gc.collect()  # the loads' mappings, kept by the tracebacks of their interrupts
        for p in paths:
            c.delete(p)
    st = persisting.status()
    assert (st.reservations, st.objects, st.memory_stored) == (0, 0, 0)
    wait_until(
        lambda: (lambda s: s.segments == s.free_segments)(persisting.status()),
        timeout=10, what="every segment free",
    )  # fmt: skip


def _raise_in_finalizers(frame: FrameType, event: str, arg: Any) -> None:
    """A Ctrl-C in every call of a finalizer (``weakref.finalize``) or of ckptcache's code;
    other code the collection runs (the standard library's weak sets) is left alone."""
    name = frame.f_code.co_filename
    if event == "call" and (name == weakref.__file__ or f"{os.sep}ckptcache{os.sep}" in name):
        raise KeyboardInterrupt


def test_a_ctrl_c_as_a_loads_mapping_is_collected_leaves_no_pin(daemon: DaemonProc):
    """The collection of a load's mapping runs no Python code a signal's exception could cut
    short: a raise in every finalizer and every call of ours made while the last tensor goes
    does not keep the generation pinned (nor the segment locked) for the life of the
    connection."""
    state = _state()
    path = "/interrupts/collected.pt"
    with daemon.client() as c:
        c.save(state, path, durability="memory")
        for _ in range(3):
            loaded = c.load(path)
            assert c.status(path).pins >= 1
            gc.collect()  # what else is garbage goes first, untraced
            sys.settrace(_raise_in_finalizers)
            try:
                del loaded  # the last reference to the mapping
                gc.collect()  # and whatever cycle held it: collected here, traced
            finally:
                sys.settrace(None)
        # The releases go with the next request (the client's own reading ahead may hold a
        # pin of its own for a moment).
        wait_until(lambda: c.status(path).pins == 0, timeout=10, what="every pin released")
        assert_same(c.load_into(path, {k: torch.zeros_like(v) for k, v in state.items()}), state)


@pytest.mark.parametrize(
    ("raised", "in_release"),
    [(KeyboardInterrupt, None), (OSError, None), (OSError, KeyboardInterrupt)],
    ids=["ctrl-c", "error", "error, then ctrl-c in the release"],
)
def test_a_load_whose_mapping_fails_leaves_no_pin(
    daemon: DaemonProc,
    monkeypatch: pytest.MonkeyPatch,
    raised: type[BaseException],
    in_release: type[BaseException] | None,
):
    """Between the daemon's reply (the pin taken) and the mapping's registration: an error
    releases the pin, a signal's exception ends the connection (and the pin with it), also
    one that lands as the pin's release is asked (then it is what the load raises)."""
    from ckptcache.codec import shm

    path = "/interrupts/unmapped.pt"
    with daemon.client() as c:
        c.save(_state(), path, durability="memory")
        call = Connection.call

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise raised("mapping failed")

        def releasing(self: Connection, method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "release" and in_release is not None:
                raise in_release
            return call(self, method, *args, **kwargs)

        monkeypatch.setattr(shm, "map_private", failing)
        monkeypatch.setattr(Connection, "call", releasing)
        with pytest.raises(in_release or raised):
            c._loads.map_local(path)  # type: ignore[attr-defined]
        monkeypatch.undo()
        wait_until(lambda: c.status(path).pins == 0, timeout=10, what="the pin released")
        assert_same(c.load(path), _state())


def _once(error: type[BaseException], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, but raising ``error`` at its first call."""
    fired: list[bool] = []

    def once(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            raise error
        return real(*args, **kwargs)

    return once


def test_a_ctrl_c_as_the_save_thread_starts_leaves_later_saves_working(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
):
    """The pool counted a worker that never started: no later non-blocking save would run,
    and neither would ``close()`` or the interpreter's exit."""
    from ckptcache._workers import StoppableThread

    with daemon.client() as c:
        monkeypatch.setattr(
            StoppableThread, "start", _once(KeyboardInterrupt, StoppableThread.start)
        )
        with pytest.raises(KeyboardInterrupt):
            c.save(_state(), "/interrupts/nb-a.pt", blocking=False)
        monkeypatch.undo()
        handle = c.save(_state(), "/interrupts/nb-b.pt", blocking=False)
        assert handle is not None
        handle.wait(60)
        assert_same(c.load("/interrupts/nb-b.pt"), _state())


def test_a_ctrl_c_as_the_plans_thread_starts_leaves_close_whole(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
):
    """A thread made but never started: ``close()`` joined it, raised, and left the
    connection open."""
    from ckptcache.client import _plans

    c = daemon.client()
    real = _plans.StoppableThread.start
    monkeypatch.setattr(_plans.StoppableThread, "start", _once(KeyboardInterrupt, real))
    with pytest.raises(KeyboardInterrupt):
        c.exists("/interrupts/job/step-1/model.pt")
    monkeypatch.undo()
    assert not c.exists("/interrupts/job/step-1/model.pt")
    c.close()
    assert c._connection.rpc is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["reserve reply", "lease"])
def test_a_ctrl_c_in_stage_leaves_no_reservation_or_pin(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch, where: str
):
    """Between the daemon's reservation (or its pinned commit) and the client's record of
    it: the connection ends, and the daemon gives the memory back."""
    from ckptcache.client import _staging

    with daemon.client() as c:
        c.save(_state(), "/interrupts/before-stage.pt", durability="memory")  # connected
        if where == "lease":
            monkeypatch.setattr(_staging, "_Lease", _once(KeyboardInterrupt, _staging._Lease))
        else:
            call = Connection.call

            def interrupted(self: Connection, method: str, *args: Any, **kwargs: Any) -> Any:
                reply = call(self, method, *args, **kwargs)
                if method == "reserve":
                    raise KeyboardInterrupt  # as the reply is decoded
                return reply

            monkeypatch.setattr(Connection, "call", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.stage([torch.ones(1 << 20)])
        monkeypatch.undo()
        wait_until(
            lambda: (daemon.status().reservations, daemon.status().pinned) == (0, 0),
            timeout=10,
            what="the reservation and the pin given back",
        )
        staged = c.stage([torch.arange(100.0)])
        assert torch.equal(staged.tensors[0], torch.arange(100.0))
        staged.release()


def test_a_storm_of_ctrl_c_across_waits_on_non_blocking_saves(
    persisting: DaemonProc, tmp_path: Path, sigalrm_interrupts: None
):
    """Non-blocking saves whose handles are waited on (``wait``, ``wait_copied``,
    ``wait_done``), each wait with a SIGALRM at a random moment raising
    ``KeyboardInterrupt``, until 20 landed inside a wait: only ever that error, never one of
    a lock the wait held (a condition's lock released or kept by the interrupt), and every
    save still finishes, committed with its bytes."""
    path = str(tmp_path / "ckpt" / "async.pt")
    state = {f"w{i}": torch.full((64, 1024), float(i)) for i in range(16)}  # 4 MiB
    rng = random.Random(5)
    interrupted = 0
    with persisting.client(timeout=10) as c:
        t0 = time.perf_counter()
        c.save(state, path, blocking=False).wait()
        span = max(time.perf_counter() - t0, 0.002)
        for i in range(600):
            handle = c.save(state, path, blocking=False)
            wait = (handle.wait, handle.wait_copied, handle.wait_done)[i % 3]
            interrupted += _interrupted(wait, rng, span)
            assert handle.wait_done(30), handle
            handle.wait()  # committed: the save's own outcome, whatever the wait met
            if interrupted == 20:
                break
        assert interrupted == 20  # the storm did land inside the waits
        state["w3"].fill_(-3.0)
        c.save(state, path, blocking=False).wait(timeout=30)
        assert_same(c.load(path), state)
