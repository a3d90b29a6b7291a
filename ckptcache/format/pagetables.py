"""Page tables of a shared mapping made ahead of its use, a range at a time
(``madvise(MADV_POPULATE_READ)``, Linux 5.14 and later). Torch-free: the daemon's pool makes
its spares with it, the client's spare thread maps them with it (a save that wants the spare
stops the steps with a :class:`Stop`), and a save's mapping is populated by its copy threads
with it.

Why not ``MAP_POPULATE`` for a mapping made beside other threads: populating holds the
process's address-space lock (``mmap_lock``) for reading, and ``MAP_POPULATE`` holds it for
the whole mapping. Every ``mmap`` and ``munmap`` of the process's other threads waits behind
it (the lock being fair, their page faults then wait too): an allocation made while another
thread maps a spare waits for the whole population (``benchmarks/save_load/spare_beside.py``).
Populated a step at a time, the lock is free between steps.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

__all__ = [
    "NATIVE_STEPS",
    "POPULATE_IN_PARALLEL",
    "POPULATE_STEP",
    "Stop",
    "populate_in_steps",
    "populate_range",
]

#: ``madvise`` advice: fault in a range's page tables as reads would.
_MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

#: Bytes whose page tables :func:`populate_in_steps` makes per call (a short hold of the lock).
POPULATE_STEP = 16 << 20


def populate_range(address: int, length: int) -> int:
    """``errno`` of ``MADV_POPULATE_READ`` over the range (0: done); ``ctypes`` releases the
    interpreter lock for the call."""
    return 0 if _libc.madvise(address, length, _MADV_POPULATE_READ) == 0 else ctypes.get_errno()


def _can_populate() -> bool:
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        view = ctypes.c_char.from_buffer(probe)
        try:
            return populate_range(ctypes.addressof(view), mmap.PAGESIZE) == 0
        finally:
            del view
    finally:
        probe.close()


#: Whether this kernel populates a range on request (else a mapping is made with
#: ``MAP_POPULATE``, on one thread, as before).
POPULATE_IN_PARALLEL = _can_populate()


class Stop:
    """A flag another thread raises to end a :func:`populate_in_steps` after its step under
    way (a word the extension's loop reads before every step)."""

    def __init__(self) -> None:
        self._flag = ctypes.c_int(0)

    def set(self) -> None:
        """End the population after the step under way."""
        self._flag.value = 1

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return bool(self._flag.value)

    @property
    def address(self) -> int:
        """Where the flag is, for the extension."""
        return ctypes.addressof(self._flag)


def _native_steps() -> Callable[[int, int, int, int | None], int] | None:
    """The copy extension's loop of steps (``ckptcache_populate_until`` in ``_copy.c``), or
    None where the extension was not built (or is an older build without it)."""
    try:
        from ckptcache.format import _copy
    except ImportError:
        return None
    fn = getattr(ctypes.CDLL(_copy.__file__), "ckptcache_populate_until", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    return fn  # type: ignore[no-any-return]


#: All the steps in one call without the interpreter lock, where the extension is built: a
#: loop in Python takes the lock back between steps, and beside a busy thread (a trainer, the
#: daemon's persist) waits up to a switch interval for it each time, so a spare could still
#: be being mapped when the next save wants it.
NATIVE_STEPS = _native_steps()


def populate_in_steps(
    mapping: mmap.mmap, step: int | None = None, stop: Stop | None = None
) -> bool:
    """Fault in the page tables of all of ``mapping`` :data:`POPULATE_STEP` bytes at a time,
    for a thread working beside others (see the module docstring); ``stop``: end after the
    step under way once it is set. Returns whether every step was made. Best effort: a range
    the kernel does not populate faults in when it is first touched, as it would anyway."""
    step = POPULATE_STEP if step is None else step
    view = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot close under us
    try:
        base, size = ctypes.addressof(view), len(mapping)
        if NATIVE_STEPS is not None:
            return NATIVE_STEPS(base, size, step, None if stop is None else stop.address) == size
        for start in range(0, size, step):
            if (stop is not None and stop.is_set()) or populate_range(
                base + start, min(step, size - start)
            ):
                return False
        return True
    finally:
        del view
