"""A host-memory copy of the training state, refreshed every N steps (the seeds' offload).

It protects against losing accelerator memory on every replica at once while the processes
(and so host memory) survive: recovery then restores from the newest snapshot instead of a
checkpoint. The bytes live in one flat buffer obtained from a :class:`SnapshotStorage`, so the
daemon's shared-memory arena can later replace plain host memory without touching this class.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from torch import nn

from ckptcache.recovery._digests import DigestMode, state_digests
from ckptcache.recovery._rng import RngState, capture_rng
from ckptcache.recovery._state import (
    FlatState,
    TensorSpec,
    apply_training_state,
    flat_training_state,
    rebuild,
)

__all__ = ["HostMemoryStorage", "HostSnapshot", "SnapshotStorage"]

#: Tensors start on this byte boundary so any dtype can be viewed in place (and DMA is aligned).
_ALIGN = 64


class SnapshotStorage(Protocol):
    """Hands out the flat byte buffer a :class:`HostSnapshot` copies into.

    Call order: ``allocate`` once, again only when the state's layout changes; ``release``
    with the previous buffer just before a replacement is allocated and on ``clear``.
    """

    def allocate(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of ``nbytes`` bytes (page-locked if ``pin``)."""
        ...

    def release(self, buf: torch.Tensor) -> None:
        """The buffer is no longer used."""
        ...


class HostMemoryStorage:
    """Default storage: ordinary (pinned when CUDA is in use) process memory."""

    def allocate(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """Allocate and touch every page now, so the first capture does not page-fault."""
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        buf.zero_()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Nothing to do: the tensor is freed with its last reference."""


class HostSnapshot:
    """Copies model, optimizer, scheduler, extra state and RNG state into host memory.

    Call order (every replica, in the training loop, after the optimizer step committed)::

        snapshot = HostSnapshot(every=10)
        ...
        snapshot.maybe_capture(model, optimizer, step=guard.committed_step, scheduler=sched)

    then hand it to ``PeerRecovery(..., snapshot=snapshot)``: when no replica has intact live
    state, the replica holding the newest snapshot restores from it and sends it to the others.
    """

    def __init__(
        self,
        *,
        every: int = 1,
        storage: SnapshotStorage | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._storage: SnapshotStorage = storage or HostMemoryStorage()
        self._pin = pin_memory
        self._arena: torch.Tensor | None = None
        self._layout: tuple[TensorSpec, ...] = ()
        self._offsets: tuple[int, ...] = ()
        self._skeleton: Any = None
        self._step: int | None = None
        self._rng: RngState | None = None
        self._digests: dict[str, tuple[int, int]] = {}

    @property
    def step(self) -> int | None:
        """The step the snapshot holds (committed optimizer steps), or None if empty."""
        return self._step

    @property
    def rng_state(self) -> RngState | None:
        """Random generator states at capture time."""
        return self._rng

    def maybe_capture(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        scheduler: Any = None,
        extra_state: Any = None,
    ) -> bool:
        """Capture when ``step`` is a multiple of ``every``; return whether it did."""
        if step % self.every:
            return False
        self.capture(model, optimizer, step=step, scheduler=scheduler, extra_state=extra_state)
        return True

    def capture(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        scheduler: Any = None,
        extra_state: Any = None,
    ) -> None:
        """Copy the live state into the host buffer now (blocks until the copy is complete)."""
        flat = flat_training_state(model, optimizer, scheduler=scheduler, extra_state=extra_state)
        self._step = None  # invalid while half-written
        self._ensure_layout(flat)
        views = self._views()
        for view, t in zip(views, flat.tensors, strict=True):
            view.copy_(t, non_blocking=True)
        if any(t.is_cuda for t in flat.tensors):
            torch.cuda.synchronize()
        # Non-tensor parts are small; copy them so later in-place changes do not leak in.
        self._skeleton = copy.deepcopy(flat.skeleton)
        self._rng = capture_rng()
        self._digests = {}
        self._step = step

    def digests(self, mode: DigestMode) -> tuple[int, int]:
        """Digests of the snapshot (same algorithm as live state), cached per capture."""
        if self._step is None:
            raise ValueError("the snapshot is empty")
        if mode not in self._digests:
            self._digests[mode] = state_digests(self._layout, self._views(), mode)
        return self._digests[mode]

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        scheduler: Any = None,
    ) -> Any:
        """Load the snapshot into the live objects; return its extra_state (a private copy)."""
        if self._step is None:
            raise ValueError("the snapshot is empty")
        # Clones: the optimizer would otherwise keep the snapshot's own buffers as its state
        # and the next step would overwrite the snapshot.
        tensors = [
            v.to(device=spec.device_type, copy=True)
            for v, spec in zip(self._views(), self._layout, strict=True)
        ]
        state = rebuild(copy.deepcopy(self._skeleton), tensors)
        return apply_training_state(model, optimizer, state, scheduler=scheduler)

    def clear(self) -> None:
        """Drop the snapshot and give its buffer back to the storage."""
        if self._arena is not None:
            self._storage.release(self._arena)
        self._arena = None
        self._layout, self._offsets, self._step = (), (), None

    def _ensure_layout(self, flat: FlatState) -> None:
        if self._arena is not None and self._layout == flat.specs:
            return  # reuse the already-faulted buffer: the common case, every step
        offsets, end = [], 0
        for spec in flat.specs:
            offsets.append(end)
            end += -(-spec.nbytes // _ALIGN) * _ALIGN
        pin = self._pin if self._pin is not None else torch.cuda.is_available()
        if self._arena is not None:
            self._storage.release(self._arena)
            self._arena = None
        self._arena = self._storage.allocate(max(end, 1), pin=pin)
        self._layout, self._offsets = flat.specs, tuple(offsets)

    def _views(self) -> list[torch.Tensor]:
        assert self._arena is not None
        return [
            self._arena[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
            for spec, off in zip(self._layout, self._offsets, strict=True)
        ]
