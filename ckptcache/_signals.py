"""Signal handlers held off around hand-offs to other threads.

A handler that raises (Ctrl-C's ``KeyboardInterrupt``, or any exception a handler raises)
lands between two bytecodes of the main thread. Inside a Python-level lock's ``__enter__``
(``threading.Condition``, which every ``Future`` and worker pool waits on) that is after the
lock was taken and before the ``with`` can release it: the lock stays held, the worker that
needs it next waits for ever, and so does the save that waits for the worker. While
:func:`signals_deferred` is open, the handlers of the usual asynchronous signals only note
what arrived; on leaving, the original handlers run for each, at a point where no lock is
half taken, so a Ctrl-C still raises, only a moment later (once the copies it would have torn
through are done).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["signals_deferred"]

#: The signals a trainer's code (or its harness) raises from: keyboard, termination, timers.
_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2")
_ASYNC = tuple(getattr(signal, name) for name in _NAMES if hasattr(signal, name))

Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold off the Python handlers of asynchronous signals in the ``with`` block; run them
    for what arrived when it ends. Outside the main thread (where no handler ever runs) it
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[tuple[Handler, int, FrameType | None]] = []
    saved: dict[int, Handler] = {}
    deferring = [True]

    def note(handler: Handler) -> Handler:
        def deferred(signum: int, frame: FrameType | None) -> Any:
            if deferring[0]:
                arrived.append((handler, signum, frame))
                return None
            return handler(signum, frame)  # a signal caught between two restores

        return deferred

    try:
        for signum in _ASYNC:
            handler = signal.getsignal(signum)
            if callable(handler):
                saved[signum] = handler
                signal.signal(signum, note(handler))
        yield
    finally:
        deferring[0] = False  # from here on the stand-ins pass a signal straight on
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for handler, signum, frame in arrived:
            handler(signum, frame)
