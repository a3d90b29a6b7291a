"""A manifest's storage records packed.

A load reads the offsets and sizes of the records and little else: one JSON value per field
of every record would be decoded and type-checked on every load for records it never reads.
Packed, the records are a few long JSON strings:

* ``offset`` and ``nbytes``: little-endian int64 arrays, base64; their type is fixed by the
  format, and their bounds are checked by numpy passes over the arrays;
* ``name`` (and ``key``, unless the keys are ``"0"``, ``"1"``, ... as a ``torch.save``
  archive numbers its storages, then ``null``): one text with the end of every item in it;
* ``dtype`` and ``location``, which repeat: the distinct values and one code per record.

Each column becomes a Python list only where something reads it (:class:`PackedColumns`): a
zero-copy load reads the offsets and sizes alone.
"""

from __future__ import annotations

import base64
import binascii
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ckptcache.format import b64

__all__ = ["FIELDS", "PackedColumns", "first_outside", "pack_columns"]

#: The record fields, in :class:`~ckptcache.format.manifest.StorageRecord` order.
FIELDS = ("key", "offset", "nbytes", "dtype", "location", "name")
_KEYS = frozenset(("n", *FIELDS))
_INT64 = np.dtype("<i8")
_CODE = np.dtype("<u4")
#: Bounds from here on are checked in Python ints: two int64 values up to it cannot overflow.
_HUGE = 1 << 62


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def _text(items: Sequence[str]) -> dict[str, str]:
    ends = np.cumsum(np.fromiter(map(len, items), _INT64, len(items)), dtype=_INT64)
    return {"text": "".join(items), "ends": _b64(ends)}


def _dictionary(items: Sequence[str]) -> dict[str, Any]:
    values = list(dict.fromkeys(items))
    codes = np.fromiter(map({v: i for i, v in enumerate(values)}.__getitem__, items), _CODE,
                        len(items))  # fmt: skip
    return {"values": values, "codes": _b64(codes)}


def _numbered(keys: Sequence[str]) -> bool:
    """Whether ``keys`` are ``"0"``, ``"1"``, ... in order (a ``torch.save`` archive's)."""
    return list(keys) == list(map(str, range(len(keys))))


def pack_columns(columns: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The packed ``storages`` value of a manifest, from the records' six columns
    (:data:`FIELDS` order). The same columns always pack to the same value."""
    keys, offsets, sizes, dtypes, locations, names = columns
    return {
        "n": len(offsets),
        "key": None if _numbered(keys) else _text(keys),
        "offset": _b64(np.array(offsets, dtype=_INT64)),
        "nbytes": _b64(np.array(sizes, dtype=_INT64)),
        "dtype": _dictionary(dtypes),
        "location": _dictionary(locations),
        "name": _text(names),
    }


def _array(value: Any, dtype: np.dtype, n: int, what: str) -> np.ndarray:
    """The ``n`` items of ``dtype`` that the base64 string ``value`` holds."""
    if type(value) is not str:
        raise ValueError(f"storage {what} are not a base64 string")
    try:
        raw = b64.decode(value)
    except binascii.Error as e:
        raise ValueError(f"storage {what} are not valid base64 ({e})") from None
    if len(raw) != n * dtype.itemsize:
        raise ValueError(f"storage {what} of the wrong length")
    return np.frombuffer(raw, dtype=dtype)


class _Text:
    """A column of strings stored as one text and each item's end in it."""

    def __init__(self, raw: Any, n: int, what: str):
        if type(raw) is not dict or set(raw) != {"text", "ends"} or type(raw["text"]) is not str:
            raise ValueError(f"storage {what} column malformed")
        self.text: str = raw["text"]
        self.ends = _array(raw["ends"], _INT64, n, f"{what} ends")
        if n and (
            self.ends[0] < 0
            or (np.diff(self.ends) < 0).any()
            or int(self.ends[-1]) != len(self.text)
        ):
            raise ValueError(f"storage {what} column malformed")
        if not n and self.text:
            raise ValueError(f"storage {what} column malformed")

    def items(self) -> list[str]:
        ends = self.ends.tolist()
        return list(map(self.text.__getitem__, map(slice, [0, *ends[:-1]], ends)))


class _Dictionary:
    """A column of repeated strings stored as the distinct values and a code per item."""

    def __init__(self, raw: Any, n: int, what: str):
        if type(raw) is not dict or set(raw) != {"values", "codes"}:
            raise ValueError(f"storage {what} column malformed")
        self.values: list[str] = raw["values"]
        if type(self.values) is not list:
            raise ValueError(f"storage {what} column malformed")
        try:
            "".join(self.values)  # refuses an item that is not a str, in one C pass
        except TypeError:
            raise ValueError("a name, path or dtype that is not a string") from None
        self.codes = _array(raw["codes"], _CODE, n, f"{what} codes")
        if n and int(self.codes.max()) >= len(self.values):
            raise ValueError(f"storage {what} code out of range")

    def items(self) -> list[str]:
        return list(map(self.values.__getitem__, self.codes.tolist()))


def first_outside(offsets: Sequence[int], sizes: Sequence[int], start: int, end: int) -> int | None:
    """The index of the first record (non-negative ``int`` offsets and sizes) whose bytes
    are not all in ``[start, end)``, or ``None``."""
    if not offsets or (min(offsets) >= start and max(map(operator.add, offsets, sizes)) <= end):
        return None
    rows = enumerate(zip(offsets, sizes, strict=True))
    return next(i for i, (o, n) in rows if not start <= o <= end - n)


class PackedColumns(Sequence[Sequence[Any]]):
    """The six columns of packed records (:data:`FIELDS` order), each made into a list on
    first use; built from a decoded ``storages`` value, which is checked whole here (raises
    ``ValueError``) but for the offsets' bounds, which need the manifest (:meth:`check_within`)."""

    def __init__(self, raw: Any):
        if type(raw) is not dict or set(raw) != _KEYS:
            raise ValueError("storage columns missing or unknown")
        n = raw["n"]
        if type(n) is not int or n < 0:
            raise ValueError("storage count is not a non-negative integer")
        self._n = n
        #: The offsets and sizes as int64 arrays (read without making lists).
        self.offsets = _array(raw["offset"], _INT64, n, "offsets")
        self.sizes = _array(raw["nbytes"], _INT64, n, "sizes")
        self._keys = None if raw["key"] is None else _Text(raw["key"], n, "key")
        self._dtypes = _Dictionary(raw["dtype"], n, "dtype")
        self._locations = _Dictionary(raw["location"], n, "location")
        self._names = _Text(raw["name"], n, "name")
        self._made: list[list[Any] | None] = [None] * len(FIELDS)

    def check_within(self, start: int, end: int) -> int | None:
        """The index of the first record whose bytes are not all in ``[start, end)``, or
        ``None``; raises ``ValueError`` for a negative offset or size."""
        if not self._n:
            return None
        offsets, sizes = self.offsets, self.sizes
        if int(offsets.min()) < 0 or int(sizes.min()) < 0:
            raise ValueError("negative or non-integer offset")
        if end >= _HUGE:  # past any real segment: Python ints, which cannot wrap around
            return first_outside(offsets.tolist(), sizes.tolist(), start, end)
        # Each at most ``end`` first, so their sum cannot wrap around in int64.
        bad = (offsets < start) | (offsets > end) | (sizes > end)
        if not bad.any():
            bad = offsets + sizes > end
        return int(np.argmax(bad)) if bad.any() else None

    def _make(self, i: int) -> list[Any]:
        if i == 0:
            return list(map(str, range(self._n))) if self._keys is None else self._keys.items()
        if i in (1, 2):
            return (self.offsets if i == 1 else self.sizes).tolist()  # type: ignore[no-any-return]
        if i == 5:
            return self._names.items()
        return (self._dtypes if i == 3 else self._locations).items()

    def __len__(self) -> int:
        return len(FIELDS)

    def __getitem__(self, i: int) -> list[Any]:  # type: ignore[override]
        i = operator.index(i)
        if not -len(FIELDS) <= i < len(FIELDS):
            raise IndexError(i)
        i %= len(FIELDS)
        made = self._made[i]
        if made is None:
            made = self._made[i] = self._make(i)
        return made

    def __iter__(self) -> Iterator[list[Any]]:
        return (self[i] for i in range(len(FIELDS)))
