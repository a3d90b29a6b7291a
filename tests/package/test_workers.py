"""The client's worker threads: daemon threads that end a moment after their work, and whose
``stop()`` ends them at once (what thread-leak checks such as Lightning's call)."""

from __future__ import annotations

import threading

import pytest

from ckptcache._workers import LingeringPool
from tests.helpers import wait_until


def alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name) and t.is_alive()]


def test_jobs_run_on_daemon_threads_that_end_after_the_work():
    pool = LingeringPool(2, "test-linger", linger=0.05)
    barrier = threading.Barrier(3)  # two jobs at once on two workers, and this thread
    futures = [pool.submit(lambda i=i: (barrier.wait(), i)[1]) for i in range(2)]
    barrier.wait()
    assert [f.result(10) for f in futures] == [0, 1]
    assert all(t.daemon for t in alive("test-linger"))
    wait_until(lambda: not alive("test-linger"), what="the idle workers to end")
    assert pool.submit(lambda: "again").result(10) == "again"  # a new worker starts


def test_an_exception_reaches_the_caller():
    pool = LingeringPool(1, "test-raise")

    def boom() -> None:
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        pool.submit(boom).result(10)
    assert pool.submit(lambda: 1).result(10) == 1  # the worker survived it


def test_stop_ends_an_idle_worker_at_once():
    pool = LingeringPool(1, "test-stop", linger=3600.0)
    assert pool.submit(lambda: 1).result(10) == 1
    (worker,) = alive("test-stop")
    worker.stop()  # type: ignore[attr-defined]
    assert not worker.is_alive()
    assert pool.submit(lambda: 2).result(10) == 2  # and the pool still serves
