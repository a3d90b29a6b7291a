"""CRC-32 (zip's) of a concatenation from the CRCs of its parts.

``zlib.crc32`` releases the interpreter lock, so reader threads can checksum the blocks they
have just read in parallel; a record's CRC is then the combination of its blocks' CRCs. The
method is zlib's ``crc32_combine`` (1.2.12 and later): multiply the first CRC by x^(8 * len2)
modulo the CRC polynomial and add the second. Python's ``zlib`` does not expose it.
"""

from __future__ import annotations

import functools

__all__ = ["crc32_combine"]

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
