"""The collector held off around a save (``ckptcache/format/gcpause.py``): regions nest, in one
thread or several, the collector comes back when the last one ends (and stays off in a process
that turned it off itself), a child forked inside one collects, and a storm of signals raising
``KeyboardInterrupt`` never leaves it off."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from types import FrameType

import pytest

from ckptcache.format import gcpause
from ckptcache.format.gcpause import gc_paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_regions_nest_and_the_last_one_enables_the_collector():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer region is still open
    assert gc.isenabled()


def test_a_region_that_raises_still_enables_the_collector():
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_regions_of_two_threads_overlap():
    """A non-blocking save's thread and the trainer's: the first region to end does not turn
    the collector back on under the other."""
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(30)
            seen.append(gc.isenabled())

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's region is still open
    release.set()
    thread.join(30)
    assert seen == [False] and gc.isenabled()


def test_a_process_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_child_forked_inside_a_region_collects():
    """The region's thread may not be in the child (a fork from another thread): the child
    must not be left without a collector."""
    with gc_paused():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.write(write, b"1" if gc.isenabled() and gcpause.open_regions() == 0 else b"0")
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        answer = os.read(read, 1)
        os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0 and answer == b"1"
    assert gc.isenabled()


def _regions(count: int) -> None:
    """Regions opened and closed, one inside another, with a collection's worth of garbage."""
    for _ in range(count):
        with gc_paused():
            with gc_paused():
                [(i,) for i in range(50)]
            [(i,) for i in range(50)]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C, where it lands inside :func:`_regions` (anywhere else, the test's own loop
    could not count it)."""
    while frame is not None:
        if frame.f_code is _regions.__code__:
            raise KeyboardInterrupt
        frame = frame.f_back


@pytest.mark.skipif(not gcpause.IN_C, reason="the collector extension is not built")
@pytest.mark.timeout(120, method="thread")  # the storm takes SIGALRM, the suite's own timer
def test_a_storm_of_interrupts_never_leaves_the_collector_off():
    """SIGALRM every 100 us raising ``KeyboardInterrupt`` while regions open and close:
    wherever the exception lands (before, inside or after a region's bookkeeping), no
    region stays open and the collector is back on."""
    interrupts = 0
    previous = signal.signal(signal.SIGALRM, _interrupt)
    deadline = time.monotonic() + 2.0
    signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0001)
    try:
        while time.monotonic() < deadline:
            try:
                _regions(20)
            except KeyboardInterrupt:
                interrupts += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupts > 100  # the storm did land inside the regions
    assert gcpause.open_regions() == 0
    assert gc.isenabled()
