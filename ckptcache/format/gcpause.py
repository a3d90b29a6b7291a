"""Cyclic garbage collection held off around a save, a walk or an unpickle of thousands of
objects."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
#: Regions open now, in every thread: the collector is enabled again when the last one ends.
_depth = 0
#: Whether the collector was enabled when the first of them began (a process that disabled
#: it itself keeps it disabled).
_reenable = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a save or a load of thousands of tensors makes
    tens of thousands of short-lived tuples, and the collections they set off scan the young
    objects, and now and then the whole heap (a trainer's heap is large): a first save of
    2,072 tensors was seen to run a full collection of 115 ms in a heap of 190,000 objects
    (``benchmarks/save_load/README.md``). Objects that die inside never reach a collection;
    nothing made inside lives in a cycle that needs the collector.

    Process-wide, as the collector is: regions nest, in one thread or several (a save on the
    trainer's thread beside a non-blocking save's thread), and the collector is enabled again
    when the last one ends."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            if _depth > 0:  # a child forked inside starts at 0 (``_after_fork``)
                _depth -= 1
                if _depth == 0 and _reenable:
                    gc.enable()


def _after_fork() -> None:
    """A child forked while a region was open in some thread: that thread is not in the
    child, so its region never ends there. The child collects as the parent did before."""
    global _depth, _reenable, _lock
    _lock = threading.Lock()
    if _depth and _reenable:
        gc.enable()
    _depth, _reenable = 0, False


os.register_at_fork(after_in_child=_after_fork)
