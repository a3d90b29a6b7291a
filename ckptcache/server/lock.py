"""The daemon's one lock, as its parts see it: a narrow port, never the condition itself.

:class:`~ckptcache.server.state.CacheState` owns a :class:`StateLock` (``state.lock``); a part
holds it for a change of several things at once (``with state.lock.held():``, re-entrant),
waits on it with :meth:`Locked.wait` (lock held) or :meth:`Locked.wait_for` (takes it), and
wakes waiters with :meth:`Locked.notify_all`. The ``threading.Condition`` underneath stays
private to :class:`StateLock`, so no part can hold it past the port or wait on it in a way
the port does not offer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

__all__ = ["Locked", "StateLock"]


class _Held(Protocol):
    def __enter__(self) -> None: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None: ...


class Locked(Protocol):
    """What a part may do with the daemon's lock."""

    def held(self) -> _Held:
        """The lock as a context manager (re-entrant)."""

    def wait(self, timeout: float) -> None:
        """Release the lock (held by the caller) until a :meth:`notify_all` or ``timeout``."""

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (taking the lock) until ``predicate()`` holds or ``timeout`` passes; returns
        the last value of ``predicate()``."""

    def notify_all(self) -> None:
        """Wake every waiter (takes the lock): something they may wait for changed."""


class StateLock:
    """The :class:`Locked` port over one re-entrant condition variable."""

    __slots__ = ("_cond",)

    def __init__(self) -> None:
        self._cond = threading.Condition()  # re-entrant (an RLock underneath)

    def held(self) -> StateLock:
        """The lock as a context manager (re-entrant): this object itself, so holding it
        costs no more than holding the condition."""
        return self

    def __enter__(self) -> None:
        self._cond.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._cond.__exit__(kind, error, trace)

    def wait(self, timeout: float) -> None:
        """Release the lock (held by the caller) until a :meth:`notify_all` or ``timeout``."""
        self._cond.wait(timeout)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (taking the lock) until ``predicate()`` holds or ``timeout`` passes; returns
        the last value of ``predicate()``."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def notify_all(self) -> None:
        """Wake every waiter (takes the lock, re-entrant)."""
        with self._cond:
            self._cond.notify_all()
