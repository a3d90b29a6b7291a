"""CRC-32 (zip's): the fastest implementation at hand, and the CRC of a concatenation from
the CRCs of its parts.

:func:`crc32` is ISA-L's (the ``isal`` package: carry-less multiplication, several times zlib's
rate; ``benchmarks/persist/README.md``) where it is installed, and ``zlib.crc32`` (table-driven)
otherwise; both compute the same function (zip's polynomial, the same running-CRC argument), and a
test holds them to equal results. The CRC-32 of every record is taken while a persist writes and
again while a storage read is checked, so at the zlib rate the CPU, not the disk, bounds a large
persist.

Both release the interpreter lock, so reader threads can checksum the blocks they have just
read in parallel; a record's CRC is then the combination of its blocks' CRCs. The method is
zlib's ``crc32_combine`` (1.2.12 and later): multiply the first CRC by x^(8 * len2) modulo the
CRC polynomial and add the second. Python's ``zlib`` does not expose it.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

__all__ = ["CRC32_IMPLEMENTATION", "crc32", "crc32_combine"]

#: ``crc32(data, value=0)``: the CRC-32 of ``data`` continued from ``value``.
crc32: Callable[..., int]
try:
    from isal.isal_zlib import crc32 as crc32

    #: Which implementation :func:`crc32` is (``isal`` or ``zlib``), for logs and benchmarks.
    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # a platform without ISA-L's wheel: the standard library's
    crc32 = zlib.crc32
    CRC32_IMPLEMENTATION = "zlib"

_POLY = 0xEDB88320  # zip's CRC-32 polynomial, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial


@functools.lru_cache(maxsize=64)
def _x8nmodp(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial (cached: most parts have one of a few lengths)."""
    p, k = 1 << 31, 3  # x^0; 2^3 = 8 bits per byte
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` given ``crc1 = crc32(A)``, ``crc2 = crc32(B)``, ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
