"""``ckptcache._signals``: handlers held off inside the block run, in order, when it ends,
and the original handlers are back."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest

from ckptcache._signals import signals_deferred


class Interrupted(Exception):
    pass


def _raise(signum, frame):
    raise Interrupted(signum)


def test_a_signal_inside_the_block_raises_only_when_it_ends():
    previous = signal.signal(signal.SIGUSR1, _raise)
    reached = []
    try:
        with pytest.raises(Interrupted), signals_deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            reached.append("after the signal")  # the block runs on to its end
        assert reached == ["after the signal"]
        assert signal.getsignal(signal.SIGUSR1) is _raise
        with pytest.raises(Interrupted):  # and outside, at once again
            os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_every_signal_held_off_runs_though_the_first_raises():
    """A Ctrl-C and a SIGTERM inside one block: the SIGTERM's handler (a preemption hook)
    still runs, and the Ctrl-C's exception is raised after it, as the interpreter would."""
    ran: list[int] = []
    previous = (signal.signal(signal.SIGUSR1, _raise),
                signal.signal(signal.SIGUSR2, lambda signum, frame: ran.append(signum)))  # fmt: skip
    try:
        with pytest.raises(Interrupted), signals_deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert ran == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGUSR2, previous[1])


class Alarm(Exception):
    pass


def test_two_raising_handlers_lose_neither_exception():
    """A harness's alarm and a Ctrl-C inside one block: the later one is raised, the earlier
    one chained as its context (no exception dropped)."""

    def alarm(signum, frame):
        raise Alarm(signum)

    previous = (signal.signal(signal.SIGUSR1, alarm), signal.signal(signal.SIGUSR2, _raise))
    try:
        with pytest.raises(Interrupted) as raised, signals_deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert isinstance(raised.value.__context__, Alarm)
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGUSR2, previous[1])


def test_an_exception_of_the_block_still_restores_the_handlers():
    previous = signal.signal(signal.SIGUSR2, _raise)
    try:
        with pytest.raises(ValueError), signals_deferred():
            raise ValueError("the copy failed")
        assert signal.getsignal(signal.SIGUSR2) is _raise
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_outside_the_main_thread_it_changes_nothing():
    seen = []

    def run():
        with signals_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def _block() -> None:
    """One block: the frame :func:`_raise_in_block` looks for."""
    with signals_deferred():
        pass


def _raise_in_block(signum, frame):
    """Raises only inside :func:`_block` (entering, inside or restoring: a few frames deep),
    never in the loop that catches it; a short walk, so the storm does not nest handlers."""
    for _ in range(6):
        if frame is None:
            return
        if frame.f_code is _block.__code__:
            raise Interrupted(signum)
        frame = frame.f_back


def test_a_storm_of_raising_signals_never_leaves_a_stand_in_behind():
    """A raising handler firing every 50 us while blocks open and close: whatever it
    interrupts, no signal is swallowed once the storm ends, and the next block leaves the
    original handlers (a handler that ran between two restores used to leave the remaining
    stand-ins installed, deferring for good)."""
    previous = signal.signal(signal.SIGALRM, _raise_in_block)
    originals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    interrupted = 0
    # No finalizer of an earlier test's garbage runs in the storm: one interrupted there is
    # an unraisable exception, which is not what this test is about.
    gc.collect()
    gc.disable()
    try:
        signal.setitimer(signal.ITIMER_REAL, 50e-6, 50e-6)
        for _ in range(5000):
            try:
                _block()
            except Interrupted:
                interrupted += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    assert interrupted > 0  # the storm did land inside the blocks
    # What a storm may leave installed passes every signal straight on: a Ctrl-C raises.
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    _block()  # and the next block puts the originals back
    assert {s: signal.getsignal(s) for s in originals} == originals


def test_a_nested_block_leaves_the_outer_one_deferring():
    previous = signal.signal(signal.SIGUSR1, _raise)
    reached = []
    try:
        with pytest.raises(Interrupted), signals_deferred():
            with signals_deferred():
                pass
            os.kill(os.getpid(), signal.SIGUSR1)  # the outer block still holds it off
            reached.append("after the signal")
        assert reached == ["after the signal"]
        assert signal.getsignal(signal.SIGUSR1) is _raise
    finally:
        signal.signal(signal.SIGUSR1, previous)
