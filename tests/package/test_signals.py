"""``ckptcache._signals``: handlers held off inside the block run, in order, when it ends,
and the original handlers are back."""

from __future__ import annotations

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
