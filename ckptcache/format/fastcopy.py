"""The copy of a save's runs: streaming stores where the copy extension (``_copy.c``) is
built, libc's ``memmove`` otherwise.

A save writes bytes the trainer never reads back into a segment; on x86-64 the extension
copies runs of 32 KiB and more with non-temporal (streaming) stores, which write whole cache
lines without first reading them, and fences them before it returns. One call copies a whole
list of runs, so a state of thousands of storages crosses into C once per share, not once per
storage. Both implementations are called through ``ctypes``, which releases the interpreter
lock for the call: the copy threads run in parallel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

__all__ = ["COPY_IMPLEMENTATION", "copy_runs", "copy_table"]


def _extension() -> ctypes.CDLL | None:
    try:
        from ckptcache.format import _copy
    except ImportError:  # not built here (no C compiler at install): memmove
        return None
    lib = ctypes.CDLL(_copy.__file__)
    lib.ckptcache_copy_runs.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ckptcache_copy_runs.restype = None
    lib.ckptcache_copy_kind.restype = ctypes.c_int
    return lib


_LIB = _extension()
_memmove = ctypes.CDLL(None).memmove
_memmove.restype = ctypes.c_void_p
_memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

_KINDS = ("memcpy", "stream-sse2", "stream-avx2")  # by ckptcache_copy_kind()
#: Which copy :func:`copy_runs` makes: ``stream-avx2``, ``stream-sse2``, ``memcpy`` (the
#: extension on a CPU without streaming stores) or ``memmove`` (no extension).
COPY_IMPLEMENTATION = "memmove" if _LIB is None else _KINDS[_LIB.ckptcache_copy_kind()]


def copy_runs(runs: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(dst, src, nbytes)`` run (addresses; runs must not overlap and the
    caller has checked every one against its destination). Every byte is stored, and ordered
    before later stores of this thread, when it returns."""
    if not runs:
        return
    if _LIB is None:
        for dst, src, n in runs:
            _memmove(dst, src, n)
        return
    copy_table(np.array(runs, dtype=np.uint64))


def copy_table(table: np.ndarray) -> None:
    """:func:`copy_runs` of the rows of ``table``: ``(dst, src, nbytes)`` as ``uint64``, C
    order (a save's runs made in columns, without a Python tuple per run)."""
    if not len(table):
        return
    if table.dtype != np.uint64 or table.ndim != 2 or table.shape[1] != 3:
        raise ValueError("copy_table copies rows of three uint64: (dst, src, nbytes)")
    table = np.ascontiguousarray(table)
    if _LIB is None:
        for dst, src, n in table.tolist():
            _memmove(dst, src, n)
        return
    _LIB.ckptcache_copy_runs(table.ctypes.data, len(table))
