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

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["signals_deferred"]

#: The signals a trainer's code (or its harness) raises from: keyboard, termination, timers.
_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2")
_ASYNC = tuple(getattr(signal, name) for name in _NAMES if hasattr(signal, name))

Handler = Callable[[int, FrameType | None], Any]


def signals_deferred() -> _Deferral:
    """Hold off the Python handlers of asynchronous signals in the ``with`` block; run them
    for what arrived when it ends. Outside the main thread (where no handler ever runs) it
    does nothing."""
    return _Deferral()


class _Deferral:
    """The ``with`` block of :func:`signals_deferred`.

    A raising handler can land between any two bytecodes, the block's own included, and
    even inside ``signal.signal`` (which runs pending handlers first), so no sequence of
    Python steps is sure to put every handler back. Two rules keep what a storm of raising
    signals can leave behind harmless:

    * a stand-in defers only while the block is open (from the end of ``__enter__`` to the
      start of ``__exit__``); any other time it passes the signal straight to the original
      handler, so one left installed never swallows a Ctrl-C;
    * a block that finds the stand-in of a block that is over saves the original behind it,
      so it puts the original back (stand-ins never pile up); an open block's stand-in (a
      nested block) is saved as it is.

    A class, not a generator: a handler that raised after a generator's ``yield`` but before
    the ``with`` took the context left every stand-in installed, as no ``__exit__`` ran.
    """

    def __init__(self) -> None:
        self.arrived: list[tuple[Handler, int, FrameType | None]] = []
        self.saved: dict[int, Handler] = {}
        self.open = [False]

    def _stand_in(self, handler: Handler) -> Handler:
        arrived, open_ = self.arrived, self.open

        def deferred(signum: int, frame: FrameType | None) -> Any:
            if open_[0]:
                arrived.append((handler, signum, frame))
                return None
            return handler(signum, frame)

        deferred.__wrapped__ = handler  # type: ignore[attr-defined]
        deferred.ckptcache_block_open = open_  # type: ignore[attr-defined]
        return deferred

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _ASYNC:
            handler = signal.getsignal(signum)
            left = getattr(handler, "ckptcache_block_open", None)
            if left is not None and not left[0]:  # left behind by a block that is over
                handler = handler.__wrapped__  # type: ignore[union-attr]
            if callable(handler):
                self.saved[signum] = handler
                signal.signal(signum, self._stand_in(handler))
        self.open[0] = True

    def __exit__(self, *exc: object) -> None:
        self.open[0] = False
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        # Every handler runs, as the interpreter runs each pending one in turn: a Ctrl-C's
        # exception swallows neither a SIGTERM handler that came with it nor another
        # handler's exception. The last exception is raised, the earlier ones chained as
        # its context, as when a signal lands while another's exception is handled.
        error: BaseException | None = None
        for handler, signum, frame in self.arrived:
            try:
                handler(signum, frame)
            except BaseException as e:  # raised below, once every handler ran
                if error is not None and e is not error and e.__context__ is None:
                    e.__context__ = error
                error = e
        if error is not None:
            raise error
