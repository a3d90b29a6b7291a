"""Optimizer-step atomicity: a replica is either before a step or after it, never in between.

A failure can strike in two places, and recovery treats them differently:

* during forward/backward: parameters and optimizer state are untouched, so every healthy
  replica still holds the state *before* the step; the step is simply run again (the guard
  also rewinds the random generators to where they were when that step began);
* during ``optimizer.step()``: some tensors may already be updated and others not. A replica
  whose step was interrupted is marked *in flight* and counts as recovering; healthy replicas
  finish the step (a fault handler waits for it with :meth:`StepGuard.paused`) and send the
  post-step state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckptcache.recovery._rng import RngState, capture_rng

__all__ = ["StepGuard"]


class StepGuard:
    """Marks optimizer steps as in flight or committed (one per training process).

    Call order (training thread)::

        guard = StepGuard()                 # before the first step (or StepGuard(step=resume_step))
        for step in range(guard.committed_step, num_steps):
            loss = model(batch).sum(); loss.backward()
            with guard.optimizer_step(step):
                optimizer.step()
                scheduler.step()            # everything that must change atomically goes inside

    A fault handler running in another thread wraps its abort in ``with guard.paused():`` so
    that it never interrupts the training thread halfway through an optimizer step.
    :class:`~ckptcache.recovery.PeerRecovery` reads ``committed_step``, ``in_flight`` and
    ``rng_state`` and resets the guard after a recovery.
    """

    def __init__(self, step: int = 0, *, capture_rng_state: bool = True) -> None:
        self._lock = threading.Lock()
        self._committed = step
        self._in_flight: int | None = None
        self._capture = capture_rng_state
        self._rng: RngState | None = capture_rng() if capture_rng_state else None

    @property
    def committed_step(self) -> int:
        """Number of optimizer steps completed: the index of the next step to run."""
        return self._committed

    @property
    def in_flight(self) -> int | None:
        """The step whose optimizer update started but never finished, or None."""
        return self._in_flight

    @property
    def rng_state(self) -> RngState | None:
        """Generators as they were when the last step committed (the start of the next step)."""
        return self._rng

    @contextmanager
    def optimizer_step(self, step: int | None = None) -> Iterator[None]:
        """Run the body as the atomic update of ``step`` (default: ``committed_step``).

        If the body raises, the step stays in flight and the exception propagates: this replica's
        state may be half-updated, so the next recovery counts it as recovering.
        """
        with self._lock:
            current = self._committed if step is None else step
            self._in_flight = current
            yield
            # Reached only when the body returned normally (an exception skips the commit).
            self._committed = current + 1
            self._in_flight = None
            if self._capture:
                self._rng = capture_rng()

    @contextmanager
    def paused(self) -> Iterator[int]:
        """Wait for an in-flight optimizer step to finish and hold off new ones while inside.

        Yields the committed step. Meant for a fault-handling thread: abort collectives or raise
        into the training thread inside this block, so a healthy replica is always between steps.
        """
        with self._lock:
            yield self._committed

    def reset(self, step: int) -> None:
        """Declare the state consistent at ``step`` (after a recovery or a checkpoint load)."""
        with self._lock:
            self._committed = step
            self._in_flight = None
            if self._capture:
                self._rng = capture_rng()
