"""Non-blocking saves: ``save(obj, path, blocking=False)`` returns a :class:`SaveHandle` at
once and copies the tensors into the daemon's segment in a background thread.

The contract: tensors of a pending save must not be modified in place until the handle's copy
is done (``handle.wait()``, or :meth:`StepGuard.optimizer_step` which waits for every pending
copy of the process). A violation is detected where it is cheap to: each tensor's autograd
version counter (``tensor._version``, bumped by every in-place op) is recorded at submit and
checked after the copy; a changed counter aborts the save with
:class:`~ckptcache.errors.TensorMutated` (the previous generation stays the newest) instead of
committing torn bytes. In-place writes that bypass the counter (through ``tensor.data`` or
numpy views) are not seen.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from ckptcache.errors import TensorMutated

__all__ = ["SaveHandle", "VersionCheck", "wait_for_copies"]

_pending: weakref.WeakSet[SaveHandle] = weakref.WeakSet()
_pending_lock = threading.Lock()


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable through dicts, lists and tuples, with a readable key."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<root>", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


class VersionCheck:
    """The version counters of ``obj``'s tensors at submit; :meth:`check` raises if any moved."""

    def __init__(self, obj: Any, path: str):
        self.path = path
        self._seen = [(key, t, t._version) for key, t in _tensors(obj)]

    def check(self) -> None:
        """Raise :class:`TensorMutated` naming the first tensor modified since submit."""
        for key, tensor, version in self._seen:
            if tensor._version != version:
                raise TensorMutated(
                    f"tensor {key!r} of {self.path!r} was modified in place while a "
                    "non-blocking save was copying it; the save was aborted and the previous "
                    "generation kept. Call handle.wait() (or run optimizer steps inside "
                    "StepGuard.optimizer_step()) before modifying saved tensors"
                )


class SaveHandle:
    """A save in flight: :meth:`wait` returns once its bytes are committed (or raises)."""

    def __init__(self, path: str, future: Future[None], copied: threading.Event):
        self.path = path
        self._future = future
        self._copied = copied
        with _pending_lock:
            _pending.add(self)

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._future.done()

    def copied(self) -> bool:
        """Whether the tensors are copied out (they may be modified again)."""
        return self._copied.is_set()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until the tensors are copied out (or the save failed); no error raised."""
        return self._copied.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; raises the save's error (e.g. :class:`TensorMutated`)."""
        self._future.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "copied" if self.copied() else "copying"
        return f"<SaveHandle {self.path!r} {state}>"


def submit(
    run: Callable[[Callable[[], None]], None],
    path: str,
    executor: Any,
) -> SaveHandle:
    """Run ``run(on_copied)`` on ``executor``; ``on_copied`` marks the tensors free again."""
    copied = threading.Event()

    def task() -> None:
        try:
            run(copied.set)
        finally:
            copied.set()

    return SaveHandle(path, executor.submit(task), copied)


def wait_for_copies(timeout: float | None = None) -> None:
    """Block until every pending non-blocking save of this process has copied its tensors
    (errors stay with their handles)."""
    with _pending_lock:
        pending = [h for h in _pending if not h.copied()]
    for handle in pending:
        handle.wait_copied(timeout)
