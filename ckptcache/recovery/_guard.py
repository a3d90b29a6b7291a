"""Optimizer-step atomicity: a replica is either before a step or after it, never in between.

A failure can strike in two places, and recovery treats them differently:

* during forward/backward: parameters and optimizer state are untouched, so every healthy
  replica still holds the state *before* the step; the step is simply run again. The forward
  pass did have side effects, though: random generators advanced (dropout) and BatchNorm
  running statistics were updated. The guard records both when a step commits and
  :meth:`StepGuard.rewind` puts them back, so the re-run step is bitwise the original;
* during ``optimizer.step()``: some tensors may already be updated and others not. A replica
  whose step was interrupted is marked *in flight* and counts as recovering; healthy replicas
  finish the step (a fault handler waits for it with :meth:`StepGuard.paused`) and send the
  post-step state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ckptcache.client import wait_for_copies
from ckptcache.recovery._rng import RngState, capture_rng, restore_rng

__all__ = ["StepGuard"]


class StepGuard:
    """Marks optimizer steps as in flight or committed (one per training process).

    Call order (training thread)::

        guard = StepGuard(model)            # before the first step (or step=resume_step)
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

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        step: int = 0,
        capture_rng_state: bool = True,
    ) -> None:
        """``model``: whose buffers (BatchNorm statistics) to record at each commit."""
        self._lock = threading.Lock()
        self._model = model
        self._committed = step
        self._in_flight: int | None = None
        self._capture = capture_rng_state
        self._rng: RngState | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._record()

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
        state may be half-updated, so the next recovery counts it as recovering. It first waits
        until every non-blocking save of this process has copied its tensors, so the update
        never races a copy (``ckptcache.save(..., blocking=False)``).
        """
        wait_for_copies()
        with self._lock:
            current = self._committed if step is None else step
            self._in_flight = current
            yield
            # Reached only when the body returned normally (an exception skips the commit).
            self._committed = current + 1
            self._in_flight = None
            self._record()

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
            self._record()

    def rewind(self) -> None:
        """Undo the side effects of an aborted forward/backward (not of an optimizer step).

        Restores the model's buffers and the random generators recorded at the last commit.
        """
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError(
                    f"optimizer step {self._in_flight} was interrupted: this replica's state is "
                    "mixed and cannot be rewound; recover it from a peer instead"
                )
            if self._model is not None:
                with torch.no_grad():
                    for name, buf in self._model.named_buffers():
                        saved = self._buffers.get(name)
                        if saved is not None and saved.shape == buf.shape:
                            buf.copy_(saved)
            if self._rng is not None:
                restore_rng(self._rng)

    def _record(self) -> None:
        if self._capture:
            self._rng = capture_rng()
        if self._model is None:
            return
        # Looked up by name each time: module.to() replaces buffer tensors with new ones.
        with torch.no_grad():
            for name, buf in self._model.named_buffers():
                saved = self._buffers.get(name)
                if saved is None or saved.shape != buf.shape or saved.dtype != buf.dtype:
                    self._buffers[name] = buf.detach().clone()
                else:
                    saved.copy_(buf)
