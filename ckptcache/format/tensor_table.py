"""A zero-copy load of a plain state dict without a rebuild call per tensor.

The archive's skeleton is what ``torch.load`` reads: every tensor in it is a ``REDUCE`` of
``_rebuild_tensor_v2`` over a storage's persistent id, and the unpickler calls back into
Python for each (persistent id, rebuild, the tensor made over the mapping): 15-25 us a tensor,
most of a load of thousands of small tensors. A save whose object is made only of the common
containers and values and plain CPU tensors (a structure the save-plan cache describes with no
reduced object in it) also writes, in its manifest, a **tensor table**:

* the tensors' fields as columns (dtype, shape, strides, storage offset, storage index,
  ``requires_grad``), taken from the plan cache's walk, in the walk's (pickling) order;
* the object's *tree*: the same object pickled with each tensor replaced by its index in the
  columns (a persistent id), so no tensor reduction is in it.

A zero-copy load then makes every tensor from the columns in one loop (one ``from_numpy`` of a
typed slice of the mapping for a tensor that covers its storage, as before), and unpickles the
tree in the C unpickler with ``persistent_load`` a lookup in the made tensors: no Python call
per tensor inside the unpickler.

It is no less safe than the skeleton's own fast path (:mod:`ckptcache.format.fast_unpickle`):
the tree's unpickler resolves only ``OrderedDict`` (every opcode that calls something goes
through ``find_class``), the columns are read by an unpickler that resolves nothing, and a
tensor is only made over a storage of this mapping whose bounds the manifest's check has
already proved, through ``from_numpy`` of an exact slice or ``set_`` (which checks the
extent). Anything unexpected (a malformed table, a name outside the list, an index out of
range) returns :data:`NOT_FAST` and the load takes the skeleton's path, which decides with its
own checks and errors. The table is the same save's, written from the same walk as the
skeleton and the plan; it is only ever an alternative way to the same object.
"""

from __future__ import annotations

import base64
import collections
import io
import math
import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ckptcache.format.fast_unpickle import NOT_FAST, NUMPY_TWINS
from ckptcache.format.gcpause import gc_paused

__all__ = ["MAX_TABLE_CHARS", "NOT_FAST", "encode_table", "load_table"]

_Tensor = torch.Tensor
_LENGTH = struct.Struct("<Q")
#: The longest table a manifest takes; a larger object is saved without one.
MAX_TABLE_CHARS = 8 << 20

#: The dtypes a table may name, by name; others (and float8s, complex32...) get no table.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
        torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
        torch.complex128,
    )
}  # fmt: skip
_NAMES = {d: name for name, d in _DTYPES.items()}
#: Dtype name -> its numpy twin (bfloat16 has none: made with ``set_``).
_NUMPY_BY_NAME = {name: d for name, d in ((n, NUMPY_TWINS.get(t)) for n, t in _DTYPES.items()) if d}


class _TreePickler(pickle.Pickler):
    """Pickles an object with each tensor written as its index (a persistent id)."""

    def __init__(self, file: io.BytesIO, index: dict[int, int]):
        super().__init__(file, protocol=5)
        self._index = index

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is _Tensor:
            return self._index[id(obj)]
        return None


def encode_table(obj: Any, tensors: Sequence[torch.Tensor], columns: Sequence[Any]) -> str:
    """The tensor table of ``obj`` (ASCII, for the manifest), or ``""`` where it cannot have
    one: a tensor off the CPU or of a dtype outside the list, or a table longer than
    :data:`MAX_TABLE_CHARS`.

    ``tensors`` and ``columns`` are the plan cache's walk of ``obj``
    (:attr:`~ckptcache.format.plancache.Structure.tensors` and ``.columns``): every tensor
    once, in pickling order, and their dtypes, shapes, strides, offsets, storage indices,
    ``requires_grad`` and devices.
    """
    dtypes, shapes, strides, offsets, indices, requires_grad, devices, _ = columns
    if any(device != -1 for device in devices) or not set(dtypes) <= _NAMES.keys():
        return ""
    names = tuple(map(_NAMES.__getitem__, dtypes))
    fields = (names, tuple(map(tuple, shapes)), strides, offsets, indices, requires_grad)
    meta = pickle.dumps(fields, protocol=5)
    tree = io.BytesIO()
    _TreePickler(tree, {id(t): i for i, t in enumerate(tensors)}).dump(obj)
    blob = _LENGTH.pack(len(meta)) + meta + tree.getvalue()
    table = base64.b64encode(blob).decode("ascii")
    # The manifest travels whole in a peer's object head (capped at 64 MiB): a table past
    # this (some 150,000 tensors) would make that head too large where the records alone fit.
    return table if len(table) <= MAX_TABLE_CHARS else ""


class _Closed(pickle.Unpickler):
    """Resolves no global at all: the columns are tuples of names and numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a tensor table names {module}.{name}")


class _Tree(pickle.Unpickler):
    """Resolves ``OrderedDict`` (a state dict's container) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"a tensor table's tree names {module}.{name}")


def load_table(table: str, whole: np.ndarray, places: Sequence[tuple[int, int]]) -> Any:
    """The object of a tensor table, its tensors over ``whole`` (a uint8 array over the
    mapping) at the storages' ``(offset, nbytes)`` in ``places`` (manifest order, checked
    against the mapping by the manifest); :data:`NOT_FAST` where the table does not do."""
    try:
        blob = base64.b64decode(table, validate=True)
        (meta_size,) = _LENGTH.unpack_from(blob)
        body = memoryview(blob)[_LENGTH.size :]
        with gc_paused():
            fields = _Closed(io.BytesIO(body[:meta_size])).load()
            tensors = _make_tensors(fields, whole, places)
            if tensors is None:
                return NOT_FAST
            tree = _Tree(io.BytesIO(body[meta_size:]))
            tree.persistent_load = dict(enumerate(tensors)).__getitem__  # type: ignore[assignment]
            return tree.load()
    except Exception:  # a malformed table: the skeleton's path decides, with its errors
        return NOT_FAST


def _make_tensors(
    fields: Any, whole: np.ndarray, places: Sequence[tuple[int, int]]
) -> list[torch.Tensor] | None:
    """Every tensor of the columns ``fields``, or None where one does not check out."""
    if type(fields) is not tuple or len(fields) != 6:
        return None
    names, shapes, strides, offsets, indices, requires_grad = fields
    n = len(names)
    if any(type(c) is not tuple or len(c) != n for c in fields):
        return None
    numbers = [x for c in (*shapes, *strides) for x in c] + [*offsets, *indices]
    if not set(map(type, numbers)) <= {int} or min(numbers, default=0) < 0:
        return None
    if not set(map(type, requires_grad)) <= {bool} or not set(names) <= _DTYPES.keys():
        return None
    if max(indices, default=-1) >= len(places):
        return None
    from_numpy, empty = torch.from_numpy, torch.empty
    shared = len(set(indices)) != n  # else no storage needs to be found again
    storages: dict[int, torch.UntypedStorage] = {}  # storage index -> the one made for it
    dense: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> its contiguous strides
    out: list[torch.Tensor] = []
    append = out.append
    for name, shape, stride, offset, index, grad in zip(
        names, shapes, strides, offsets, indices, requires_grad, strict=True
    ):
        dtype, as_numpy = _DTYPES[name], _NUMPY_BY_NAME.get(name)
        start, nbytes = places[index]
        untyped = storages.get(index) if shared else None
        contiguous = dense.get(shape)
        if contiguous is None:
            contiguous = dense[shape] = _contiguous_strides(shape)
        if (
            untyped is None
            and offset == 0
            and as_numpy is not None
            and stride == contiguous
            and nbytes
            and nbytes == as_numpy.itemsize * _numel(shape)
        ):  # the common case: the whole storage, one typed slice of the mapping
            tensor = from_numpy(whole[start : start + nbytes].view(as_numpy).reshape(shape))
            if shared:
                storages[index] = tensor.untyped_storage()
        else:
            if untyped is None:
                untyped = storages[index] = from_numpy(
                    whole[start : start + nbytes]
                ).untyped_storage()
            # ``set_`` refuses an extent past the storage's end.
            tensor = empty((0,), dtype=dtype).set_(untyped, offset, shape, stride)
        if grad:
            tensor.requires_grad = True
        append(tensor)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return shape[0] if len(shape) == 1 else math.prod(shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a dimension of
    size 1 or 0 still gets the product of the sizes after it)."""
    strides, expected = [], 1
    for size in reversed(shape):
        strides.append(expected)
        expected *= max(size, 1)
    return tuple(reversed(strides))
