"""Cyclic garbage collection held off around a walk or an unpickle of thousands of objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a walk or pickle of thousands of tensors makes
    tens of thousands of short-lived tuples, and each generation-2 collection they set off
    scans the whole heap (a trainer's heap is large): that made the cost per tensor grow with
    the number of tensors. Nothing made inside lives in a cycle that needs the collector."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
