"""Cyclic garbage collection held off around a save, a walk or an unpickle of thousands of
objects.

The regions are counted by the ``_gcpause`` extension where it is built: there, a signal's
exception (Ctrl-C) can never leave a region open, nor the collector off (see ``_gcpause.c``).
Where it is not built (no C compiler at install), by :class:`_PythonPaused`: the same
regions, but an exception raised by a signal handler inside its bookkeeping (a few bytecodes
around ``gc.disable`` and ``gc.enable``) may leave the collector off.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from types import TracebackType
from typing import Literal

__all__ = ["IN_C", "gc_paused", "open_regions"]

_lock = threading.Lock()
#: Regions open now, in every thread: the collector is enabled again when the last one ends.
_depth = 0
#: Whether the collector was enabled when the first of them began (a process that disabled
#: it itself keeps it disabled).
_reenable = False


class _PythonPaused:
    """The regions kept in Python (the extension is not built)."""

    def __enter__(self) -> None:
        global _depth, _reenable
        with _lock:
            if _depth == 0:
                _reenable = gc.isenabled()
                gc.disable()
            _depth += 1

    def __exit__(
        self, kind: type[BaseException] | None, value: object, tb: TracebackType | None
    ) -> Literal[False]:
        global _depth
        with _lock:
            if _depth > 0:  # a child forked inside starts at 0 (``_after_fork``)
                _depth -= 1
                if _depth == 0 and _reenable:
                    gc.enable()
        return False


try:
    from ckptcache.format import _gcpause
except ImportError:  # pragma: no cover - built wherever a C compiler is found
    _gcpause = None  # type: ignore[assignment]

#: Whether the regions are kept by the extension (safe against a signal's exception).
IN_C = _gcpause is not None
_Paused: type[contextlib.AbstractContextManager[None]] = (
    _gcpause.paused if IN_C else _PythonPaused  # type: ignore[assignment]
)


def gc_paused() -> contextlib.AbstractContextManager[None]:
    """No cyclic garbage collection inside: a save or a load of thousands of tensors makes
    tens of thousands of short-lived tuples, and the collections they set off scan the young
    objects, and now and then the whole heap (a trainer's heap is large: the figures are in
    ``benchmarks/save_load/README.md``). Objects that die inside never reach a collection;
    nothing made inside lives in a cycle that needs the collector.

    Process-wide, as the collector is: regions nest, in one thread or several (a save on the
    trainer's thread beside a non-blocking save's thread), and the collector is enabled again
    when the last one ends (unless it was off when the first began). Use it in a ``with``
    statement, nothing else: the statement that entered a region is what ends it."""
    return _Paused()


def open_regions() -> int:
    """How many regions are open now, in every thread (0 outside any save)."""
    return _gcpause.depth() if IN_C else _depth


def _after_fork() -> None:
    """A child forked while a region was open in some thread: that thread is not in the
    child, so its region never ends there. The child collects as the parent did before."""
    global _depth, _reenable, _lock
    _lock = threading.Lock()
    if IN_C:
        _gcpause.after_fork()
    if _depth and _reenable:
        gc.enable()
    _depth, _reenable = 0, False


os.register_at_fork(after_in_child=_after_fork)
