"""The tensors of a tensor table's columns, made over a mapping in bulk.

A zero-copy load of thousands of small tensors spends its time making tensor objects; a Python
loop that works out, tensor by tensor, how each is to be made costs more than making it. So
the columns are checked and sorted once, in C loops (``map`` over C callables, numpy over the
numeric columns), and the common tensor, one that alone covers its whole storage (offset 0,
contiguous, a dtype numpy has), is made by three C calls mapped over all of them: a slice of
a typed array over the mapping, a reshape where it is not one-dimensional, ``from_numpy``.

Each tensor still gets its own storage of exactly its extent, as the skeleton's path gives it
(``from_numpy`` makes a storage over the slice's bytes alone): a user's ``torch.save`` of one
loaded tensor writes its bytes, not the mapping's. Tensors saved over one storage (views, tied
weights) are made by ``set_`` over one storage made once for that storage, so they still share.

Where the package was built with torch at hand, the dense tensors are made in one C++ loop
(``_tensors.cpp``: ``at::from_blob`` per tensor, each storage holding the mapping), which
skips the numpy slice each tensor otherwise costs; :data:`MADE_BY` says which path is in use.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ckptcache.codec.fast_unpickle import NUMPY_TWINS
from ckptcache.codec.table.columns import CODES, Dense, contiguous_strides
from ckptcache.codec.table.native import COMPILED

# Where it is not built (or for another torch), numpy's path (tests swap the two).
_compiled: types.ModuleType | None = COMPILED

__all__ = ["DTYPES", "MADE_BY", "make_dense", "make_strided"]

#: Which path makes a zero-copy load's dense tensors: ``"C++"`` or ``"numpy"``.
MADE_BY = "numpy" if _compiled is None else "C++"

#: The dtypes a table may name, by name; others (and float8s, complex32...) get no table.
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in CODES}
_CODE_BY_NAME = {name: c for c, name in enumerate(DTYPES)}
#: Dtype name -> its item size.
_ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
#: The table's dtype code -> the dtype's item size.
_ITEMSIZE_BY_CODE = np.array([d.itemsize for d in CODES], dtype=np.int64)
#: The table's dtype code -> the numpy dtype whose array carries its bytes: its twin, or for
#: bfloat16 int16 (the tensor then viewed as bfloat16: :data:`_CARRIED`).
_CARRIER = [NUMPY_TWINS[d] if d in NUMPY_TWINS else np.dtype(f"<i{d.itemsize}") for d in CODES]
_CARRIED = {c for c, d in enumerate(CODES) if d not in NUMPY_TWINS}
#: One empty tensor of each table dtype code, by code: the C++ loop's dtypes.
_KINDS = [torch.empty(0, dtype=d) for d in CODES]


def make_strided(
    fields: Any, whole: np.ndarray, places: tuple[Sequence[int], Sequence[int]]
) -> list[torch.Tensor] | None:
    """Every tensor of the pickled columns ``fields`` (dtype names, shapes, strides, storage
    offsets, storage indices, ``requires_grad``) over ``whole`` (a uint8 array over
    the mapping), the storages at ``places`` (their offsets and sizes in the mapping, by
    storage index); None where the columns do not check out."""
    if not _well_formed(fields, len(places[0])):
        return None
    names, shapes, strides, offsets, indices, requires_grad = fields
    starts, sizes = _extents(indices, places)
    if max(map(operator.add, starts, sizes), default=0) > len(whole):
        return None  # the manifest's check rules this out; a slice would clip it silently
    own = _whole_storage(names, shapes, strides, offsets, indices, starts, sizes)
    out: list[Any] = [None] * len(names)
    if own:  # made as the packed dense tensors are
        arrays = (np.asarray(places[0], dtype=np.int64), np.asarray(places[1], dtype=np.int64))
        made = make_dense(_as_dense(fields, own), whole, arrays)
        if made is None:
            return None
        for i, tensor in zip(own, made, strict=True):
            out[i] = tensor
    _over_shared(out, fields, starts, sizes, whole)
    for tensor in itertools.compress(out, requires_grad):
        tensor.requires_grad = True
    return out


def _as_dense(fields: tuple[Any, ...], own: list[int]) -> Dense:
    """The packed columns of the tensors at ``own`` in the pickled columns ``fields``."""
    names, shapes, _, _, indices, _ = fields
    picked = [shapes[i] for i in own]
    return Dense(
        np.array([indices[i] for i in own], dtype=np.int64),
        np.array([size for shape in picked for size in shape], dtype=np.int64),
        np.array([_CODE_BY_NAME[names[i]] for i in own], dtype=np.uint8),
        np.array(list(map(len, picked)), dtype=np.uint8),
        np.zeros(len(own), dtype=np.uint8),  # ``requires_grad`` is set by the caller
    )


def make_dense(
    dense: Dense, whole: np.ndarray, places: tuple[np.ndarray, np.ndarray]
) -> list[torch.Tensor] | None:
    """The tensors of a table's packed columns (:mod:`~ckptcache.codec.table.columns`),
    each over its own storage of exactly its bytes in ``whole`` (made in C++ where built, else
    by ``from_numpy`` of a typed slice); ``places``: the storages' offsets and sizes as int64
    arrays. None where the columns do not check out: a code off the list, a storage index
    out of range or used twice, a size that is not the shape's, a start off the dtype's
    alignment."""
    index, dims, code, ndim, grad = dense
    n = len(index)
    if not n:
        return []
    if code.max() >= len(CODES) or grad.max() > 1 or int(ndim.sum(dtype=np.int64)) != len(dims):
        return None
    if index.min() < 0 or index.max() >= len(places[0]) or not _distinct(index):
        return None
    # Bounded by the mapping's size, no product of dims below can wrap around in int64.
    if len(dims) and (dims.min() < 0 or dims.max() > len(whole)):
        return None
    itemsize = _ITEMSIZE_BY_CODE[code]
    starts, sizes = places[0][index], places[1][index]
    if ((sizes <= 0) | (sizes % itemsize != 0) | (starts % itemsize != 0)).any():
        return None
    if (starts + sizes).max() > len(whole):
        return None
    numel = sizes // itemsize
    first_dim = np.cumsum(ndim, dtype=np.int64) - ndim
    one = ndim == 1
    if not (dims[first_dim[one]] == numel[one]).all():
        return None  # other shapes: the reshape checks the element count
    if _compiled is not None:
        # Own copies of the columns (a few bytes a tensor), in the dtypes the loop reads.
        wide = (torch.from_numpy(np.array(a, dtype=np.int64)) for a in (starts, sizes, dims))
        narrow = (torch.from_numpy(np.array(a, dtype=np.uint8)) for a in (ndim, code))
        (at, size, dim), (nd, kind) = wide, narrow
        out = _compiled.over_mapping(torch.from_numpy(whole), at, size, dim, nd, kind, _KINDS)
    else:
        out = _over_numpy(code, starts // itemsize, numel, whole, dims, first_dim, ndim, one)
    for tensor in itertools.compress(out, grad.tolist()):
        tensor.requires_grad = True
    return out


def _over_numpy(
    code: np.ndarray, first: np.ndarray, numel: np.ndarray, whole: np.ndarray, dims: np.ndarray,
    first_dim: np.ndarray, ndim: np.ndarray, one: np.ndarray,
) -> list[torch.Tensor]:  # fmt: skip
    """The tensors :func:`make_dense` makes, each ``from_numpy`` of a typed, shaped slice."""
    arrays = _over_mapping(code, first, numel, whole)
    if not one.all():
        _shaped(arrays, np.flatnonzero(~one).tolist(), dims.tolist(), first_dim, ndim)
    out = list(map(torch.from_numpy, arrays))
    for c in set(code.tolist()) & _CARRIED:  # bfloat16: the bytes of an int16 array
        dtype = CODES[c]
        for i in np.flatnonzero(code == c).tolist():
            out[i] = out[i].view(dtype)  # same item size: a new dtype, not an autograd view
    return out


def _distinct(index: np.ndarray) -> bool:
    """Whether no storage index repeats (increasing, as a save writes them, needs no sort)."""
    return bool((index[1:] > index[:-1]).all()) or len(np.unique(index)) == len(index)


def _over_mapping(
    code: np.ndarray, first: np.ndarray, numel: np.ndarray, whole: np.ndarray
) -> list[np.ndarray]:
    """One-dimensional slices of ``numel`` elements from element ``first`` of ``whole``
    viewed as each ``code``'s numpy carrier (made tensors by ``from_numpy`` once shaped:
    numpy reshapes for a fraction of a torch view's cost)."""
    codes = set(code.tolist())
    typed = {c: whole[: len(whole) // _ITEMSIZE_BY_CODE[c] * _ITEMSIZE_BY_CODE[c]].view(
        _CARRIER[c]) for c in codes}  # fmt: skip
    slices = map(slice, first.tolist(), (first + numel).tolist())
    if len(typed) == 1:  # one dtype: the common state dict
        (array,) = typed.values()
        return list(map(array.__getitem__, slices))
    return list(map(operator.getitem, map(typed.__getitem__, code.tolist()), slices))


def _shaped(
    arrays: list[np.ndarray], places: list[int], dims: list[int], first_dim: np.ndarray,
    ndim: np.ndarray,
) -> None:  # fmt: skip
    """Give the arrays at ``places`` their shapes (not one-dimensional); a shape whose
    element count is not the array's raises ``ValueError``."""
    starts, counts = first_dim.tolist(), ndim.tolist()
    for i in places:
        start = starts[i]
        arrays[i] = arrays[i].reshape(dims[start : start + counts[i]])


def _well_formed(fields: Any, n_storages: int) -> bool:
    """Whether ``fields`` are six equal-length tuples of the right kinds: names from the list,
    shapes and strides tuples of non-negative ints of equal lengths, non-negative int offsets,
    storage indices below ``n_storages``, bool flags. One C loop per column."""
    if type(fields) is not tuple or len(fields) != 6:
        return False
    names, shapes, strides, offsets, indices, requires_grad = fields
    n = len(names)
    if any(type(c) is not tuple or len(c) != n for c in fields):
        return False
    if not set(map(type, shapes)).union(map(type, strides)) <= {tuple}:
        return False
    if list(map(len, shapes)) != list(map(len, strides)):
        return False
    chain = itertools.chain.from_iterable
    numbers = [*chain(shapes), *chain(strides), *offsets, *indices]
    if not set(map(type, numbers)) <= {int} or min(numbers, default=0) < 0:
        return False
    if not set(map(type, requires_grad)) <= {bool} or not set(names) <= DTYPES.keys():
        return False
    return max(indices, default=-1) < n_storages


def _extents(
    indices: tuple[int, ...], places: tuple[Sequence[int], Sequence[int]]
) -> tuple[list[int], list[int]]:
    """Each tensor's storage's start and size in the mapping."""
    offsets, sizes = places
    return list(map(offsets.__getitem__, indices)), list(map(sizes.__getitem__, indices))


def _whole_storage(
    names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
    strides: tuple[tuple[int, ...], ...], offsets: tuple[int, ...], indices: tuple[int, ...],
    starts: Sequence[int], sizes: Sequence[int],
) -> list[int]:  # fmt: skip
    """The places of the tensors that alone cover their whole, non-empty storage, contiguous
    from offset 0, of a dtype numpy has and at a start aligned to it."""
    n = len(names)
    itemsizes = list(map(_ITEMSIZE.__getitem__, names))
    dense = {shape: contiguous_strides(shape) for shape in set(shapes)}
    numels = map(math.prod, shapes)
    covers = map(operator.eq, sizes, map(operator.mul, itemsizes, numels))
    ok = np.fromiter(covers, bool, n)  # exact in Python ints: no overflow
    ok &= np.fromiter(map(operator.eq, strides, map(dense.__getitem__, shapes)), bool, n)
    ok &= np.fromiter(map(operator.not_, offsets), bool, n)
    size = np.fromiter(itemsizes, np.int64, n)
    ok &= (size > 0) & (np.fromiter(sizes, np.int64, n) > 0)
    ok &= np.fromiter(starts, np.int64, n) % np.maximum(size, 1) == 0
    if len(set(indices)) != n:  # storages shared: their tensors are made over one storage
        counts = collections.Counter(indices)
        ok &= np.fromiter(map(counts.__getitem__, indices), np.int64, n) == 1
    return np.flatnonzero(ok).tolist()


def _over_shared(
    out: list[Any], fields: tuple[Any, ...], starts: Sequence[int], sizes: Sequence[int],
    whole: np.ndarray,
) -> None:  # fmt: skip
    """Make, in place in ``out``, each tensor not made yet: ``set_`` over its storage's bytes
    (one storage per storage index, shared by its tensors); ``set_`` refuses an extent past
    the storage's end."""
    names, shapes, strides, offsets, indices, _ = fields
    storages: dict[int, torch.UntypedStorage] = {}
    for i in itertools.compress(range(len(out)), map(operator.is_, out, itertools.repeat(None))):
        untyped = storages.get(indices[i])
        if untyped is None:
            start = starts[i]
            bytes_ = torch.from_numpy(whole[start : start + sizes[i]])
            untyped = storages[indices[i]] = bytes_.untyped_storage()
        empty = torch.empty((0,), dtype=DTYPES[names[i]])
        out[i] = empty.set_(untyped, offsets[i], shapes[i], strides[i])
