"""The client's threads end when their ``stop()``, or the client's ``close()``, returns.

Lightning's thread-leak check (its test suite's ``thread_police_duuu_daaa_duuu_daaa``) calls
``stop()`` on every daemon thread a test left behind and fails the test if the thread is
still alive afterwards; it runs after every test, most often right after a save. Here every
idle wait of the client's threads is an hour, so a thread that has ended was ended by its
stop or by ``close()``, never by its own linger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import ckptcache._workers as workers
import ckptcache.client._spares as spares
import ckptcache.codec.plan.walk as walk
import ckptcache.codec.shm as shm

#: The idle wait of every client thread in these tests.
HOUR = 3600.0
#: How long a ``stop()`` may take before the test gives up on it (it takes milliseconds):
#: a bound that keeps a failing test from hanging, not a timing assertion.
GIVE_UP = 30.0


def started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """The client's threads started since ``before`` and still alive."""
    return [
        t for t in threading.enumerate()
        if t not in before and t.name.startswith("ckptcache") and t.is_alive()
    ]  # fmt: skip


def kinds(threads: list[threading.Thread]) -> set[str]:
    return {t.name.rsplit("_", 1)[0] for t in threads}


@pytest.fixture
def lingering(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[threading.Thread]]:
    """Idle waits of an hour for the spare thread, the save thread, the copy threads (a
    new copy pool, on two threads) and the thread that lets a compiled walk's storages go (a
    new one); yields the threads alive before, and stops whatever of ours is left at the
    end."""
    monkeypatch.setattr(spares, "_IDLE_SECONDS", HOUR)
    monkeypatch.setattr(workers, "LINGER_SECONDS", HOUR)
    monkeypatch.setattr(shm, "_copiers", None)
    monkeypatch.setattr(walk, "_releasers", None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the copy runs on 2 threads
    before = set(threading.enumerate())
    yield before
    for t in started_since(before):
        t.stop(GIVE_UP)  # type: ignore[attr-defined]


def state(seed: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8 << 20,), seed)}  # 32 MiB: two copy threads of 16 MiB


def test_stop_right_after_a_save_ends_each_thread(lingering, client, tmp_path):
    """What Lightning's check does after a test that saved: ``stop()``, then ``is_alive()``.
    The spare thread used to clear its wake event at the top of its next pass and sit out
    its idle wait before it read the stop flag: ``stop()`` returned after that wait (a
    second by default) and, with the wait an hour here, found the thread still alive.
    (``lingering`` first: the client, made in a process with torch, starts its spare thread
    as it is made.)"""
    for i in range(3):
        handle = client.save(state(i), str(tmp_path / f"async_{i}.pt"), blocking=False)
        assert handle is not None
        handle.wait()
        client.save(state(i), str(tmp_path / f"iter_{i}.pt"))
        started = started_since(lingering)
        # The save woke the spare thread; the copy and the non-blocking save ran on theirs,
        # and a blocking save walked in C++ lets its storages go on one more.
        released = {"ckptcache-release"} if walk.WALKED_BY == "C++" else set()
        assert kinds(started) == {"ckptcache-spares", "ckptcache-save", "ckptcache-copy",
                                  *released}  # fmt: skip
        for t in started:
            t.stop(GIVE_UP)  # type: ignore[attr-defined]
            assert not t.is_alive(), f"{t.name} outlived its stop()"
        assert torch.equal(client.load(str(tmp_path / f"iter_{i}.pt"))["w"], state(i)["w"])


def test_close_right_after_a_save_ends_the_clients_threads(daemon, tmp_path, lingering):
    """``close()`` returns with the client's spare and save threads ended. (The copy threads
    and the release thread are the process's, shared by its clients: they end at their own
    ``stop()``, which the test above checks.)"""
    c = daemon.client()
    handle = c.save(state(1.0), str(tmp_path / "async.pt"), blocking=False)
    assert handle is not None
    handle.wait()
    c.save(state(2.0), str(tmp_path / "model.pt"))
    assert {"ckptcache-spares", "ckptcache-save"} <= kinds(started_since(lingering))
    c.close()
    shared = ("ckptcache-copy", "ckptcache-release")
    left = [t for t in started_since(lingering) if not t.name.startswith(shared)]
    assert left == [], [t.name for t in left]
