"""Page tables of a shared mapping made ahead of its use, a range at a time
(``madvise(MADV_POPULATE_READ)``, Linux 5.14 and later). Torch-free: the client maps the
daemon's segments with it, and the daemon its own spares.

Why not ``MAP_POPULATE``: populating holds the process's address-space lock (``mmap_lock``)
for reading, and ``MAP_POPULATE`` holds it for the whole mapping. Every ``mmap`` and
``munmap`` of the process's other threads waits behind it (the lock being fair, their page
faults then wait too): a trainer's allocation of a 64 MiB CPU tensor, made while the spare
thread mapped a 576 MiB spare beside it, took the whole population (62-67 ms) instead of
about 1 ms (``benchmarks/save_load/spare_beside.py``). Populated a step at a time, the lock
is free between steps: the longest such allocation took 13-16 ms, and the mapping as long.
"""

from __future__ import annotations

import ctypes
import mmap

__all__ = ["POPULATE_IN_PARALLEL", "POPULATE_STEP", "populate_in_steps", "populate_range"]

#: ``madvise`` advice: fault in a range's page tables as reads would.
_MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

#: Bytes whose page tables :func:`populate_in_steps` makes per call (about 2 ms of the lock).
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


def populate_in_steps(mapping: mmap.mmap, step: int | None = None) -> None:
    """Fault in the page tables of all of ``mapping`` :data:`POPULATE_STEP` bytes at a time,
    for a thread working beside others (see the module docstring). Best effort: a range the
    kernel does not populate faults in when it is first touched, as it would anyway."""
    step = POPULATE_STEP if step is None else step
    view = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot close under us
    try:
        base, size = ctypes.addressof(view), len(mapping)
        for start in range(0, size, step):
            if populate_range(base + start, min(step, size - start)):
                return
    finally:
        del view
