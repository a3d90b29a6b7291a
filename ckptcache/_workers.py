"""Worker threads that end a moment after their work: the trainer-side threads of the client.

A training process hosts the client's threads for as long as it runs, and test harnesses
(Lightning's thread-leak check, for one) fail a test that leaves a thread behind. So every
client thread is a daemon thread (it never keeps a process from exiting), ends on its own
:data:`LINGER_SECONDS` after its last job, and has a ``stop()`` that ends it at once (the hook
such harnesses call on a leftover daemon thread).

Lingering for a moment rather than ending at once keeps a burst of work (the files of one
checkpoint, saved one after the other) on one thread: starting a thread waits for it to be
scheduled, milliseconds on a busy node, on the caller's path.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptcache._signals import signals_deferred

__all__ = ["LINGER_SECONDS", "LingeringPool", "StoppableThread"]

#: How long an idle client thread waits for more work before it ends.
LINGER_SECONDS = 1.0


class StoppableThread(threading.Thread):
    """A daemon thread whose ``stop()`` asks its owner to end it (``on_stop``) and joins it."""

    def __init__(self, target: Callable[[], None], name: str, on_stop: Callable[[], None]):
        super().__init__(target=target, name=name, daemon=True)
        self._on_stop = on_stop

    def stop(self, timeout: float | None = None) -> None:
        """End this thread once its job in hand is done, and wait for it (not from itself, nor
        under a lock its job takes)."""
        self._on_stop()
        if threading.current_thread() is not self and self.is_alive():
            self.join(timeout)


class LingeringPool:
    """Up to ``max_workers`` daemon threads named ``name``; ``submit(fn)`` returns a
    :class:`concurrent.futures.Future`. A worker ends :data:`LINGER_SECONDS` after its last
    job; the next ``submit`` starts one again."""

    def __init__(self, max_workers: int, name: str, linger: float | None = None):
        self.max_workers = max(1, max_workers)
        self._name = name
        self._linger = LINGER_SECONDS if linger is None else linger  # read now, not at import
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Future[Any], Callable[[], Any]]] = collections.deque()
        self._workers = 0
        self._idle = 0  # workers waiting for a job (each will take one)
        self._stopping = False
        self._count = 0
        #: The workers started, less those seen ended (joined by :meth:`join`).
        self._threads: set[threading.Thread] = set()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on a worker (an idle one, else a new one up to ``max_workers``)."""
        future: Future[Any] = Future()
        # A signal's exception inside the condition's __enter__ would leave its lock held,
        # and every worker and later submit waiting for it (``ckptcache._signals``).
        with signals_deferred(), self._cond:
            self._stopping = False
            self._jobs.append((future, fn))
            if self._idle >= len(self._jobs):
                self._cond.notify()
            elif self._workers < self.max_workers:
                self._start_worker()
            # else: every worker is busy and takes the job when it is done
        return future

    def stop(self) -> None:
        """End the idle workers now (busy ones end after their job and the queue)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the workers have ended after :meth:`stop` (the busy ones after their
        jobs); a worker calling it does not wait for itself."""
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _start_worker(self) -> None:
        self._count += 1
        thread = StoppableThread(self._work, f"{self._name}_{self._count}", self.stop)
        self._threads = {t for t in self._threads if t.is_alive()}
        self._threads.add(thread)
        self._workers += 1
        try:
            thread.start()
        except BaseException:  # not started (no threads left, an error): no worker counted
            self._workers -= 1
            self._threads.discard(thread)
            raise

    def _next(self) -> tuple[Future[Any], Callable[[], Any]] | None:
        """The next job, or ``None`` when this worker should end (idle for the linger time,
        or stopped)."""
        with self._cond:
            self._idle += 1
            try:
                while not self._jobs:
                    idle_over = self._stopping or not self._cond.wait(self._linger)
                    if idle_over and not self._jobs:  # a job may have come as the wait ended
                        self._workers -= 1
                        return None
                return self._jobs.popleft()
            finally:
                self._idle -= 1

    def _work(self) -> None:
        while (job := self._next()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, as an executor would
                future.set_exception(e)


def join_started(thread: threading.Thread | None, timeout: float | None = None) -> None:
    """Join ``thread`` unless it is none, this one, or was never started (a signal's
    exception inside its ``start()``: a join would raise, and a ``close`` that joins it
    would stop half done)."""
    if thread is not None and thread is not threading.current_thread() and thread.ident:
        thread.join(timeout)
