"""A zero-copy load of a plain state dict without a rebuild call per tensor.

The archive's skeleton is what ``torch.load`` reads: every tensor in it is a ``REDUCE`` of
``_rebuild_tensor_v2`` over a storage's persistent id, and the unpickler calls back into
Python for each (persistent id, rebuild, the tensor made over the mapping): most of a load of
thousands of small tensors. A save whose object is made only of the common
containers and values and plain CPU tensors (a structure the save-plan cache describes with no
reduced object in it) also writes, in its manifest, a **tensor table**:

* the tensors' fields as columns, taken from the plan cache's walk
  (:mod:`~ckptcache.codec.table.columns`): the tensors that alone cover their storage as
  packed little-endian arrays, the others' columns (dtype, shape, strides, storage offset,
  storage index, ``requires_grad``) pickled;
* the object's *tree*: the same object pickled with each tensor replaced by its index in the
  columns (a persistent id), so no tensor reduction is in it.

A zero-copy load then makes the tensors from the columns in bulk
(:mod:`~ckptcache.codec.table.tensors`: C calls mapped over all of them, each tensor its own
storage of exactly its bytes), and unpickles the tree in the C unpickler with
``persistent_load`` a lookup in the made tensors: no Python call per tensor inside the
unpickler. A table of another layout (no :data:`~ckptcache.codec.table.columns.MAGIC` in
front) is not read: the load takes the skeleton's path.

It is no less safe than the skeleton's own fast path (:mod:`ckptcache.codec.fast_unpickle`):
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
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ckptcache.codec.fast_unpickle import NOT_FAST
from ckptcache.codec.table.columns import MAGIC, dense_places, pack_dense, unpack_dense
from ckptcache.codec.table.tensors import DTYPES, make_dense, make_strided
from ckptcache.format import b64
from ckptcache.format.gcpause import gc_paused

__all__ = ["MAX_TABLE_CHARS", "NOT_FAST", "encode_table", "load_table"]

_Tensor = torch.Tensor
#: Each dtype a table may name -> its name.
_NAMES = {d: name for name, d in DTYPES.items()}
#: The longest table a manifest takes; a larger object is saved without one.
MAX_TABLE_CHARS = 8 << 20


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
    """The tensor table of ``obj`` (ASCII, for the manifest;
    :mod:`~ckptcache.codec.table.columns`), or ``""`` where it cannot have one: a tensor
    off the CPU or of a dtype outside the list, or a table longer than
    :data:`MAX_TABLE_CHARS`.

    ``tensors`` and ``columns`` are the plan cache's walk of ``obj``
    (:attr:`~ckptcache.codec.plan.cache.Structure.tensors` and ``.columns``): every tensor
    once, in pickling order, and their dtypes, shapes, strides, offsets, storage indices,
    ``requires_grad``, devices, and each storage's size.
    """
    dtypes, shapes, strides, offsets, indices, requires_grad, devices, _ = columns
    if any(device != -1 for device in devices) or not set(dtypes) <= _NAMES.keys():
        return ""
    dense = dense_places(columns)
    rest = [i for i, d in enumerate(dense) if not d]
    # Persistent ids: the dense tensors first, in walk order, then the others.
    order = [i for i, d in enumerate(dense) if d] + rest
    fields = tuple(
        tuple(column[i] for i in rest)
        for column in (tuple(map(_NAMES.__getitem__, dtypes)), tuple(map(tuple, shapes)),
                       strides, offsets, indices, requires_grad)
    )  # fmt: skip
    strided = pickle.dumps(fields, protocol=5) if rest else b""
    tree = io.BytesIO()
    _TreePickler(tree, {id(tensors[i]): pid for pid, i in enumerate(order)}).dump(obj)
    blob = pack_dense(columns, dense, len(strided)) + strided + tree.getvalue()
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


def load_table(table: str, whole: np.ndarray, places: tuple[Sequence[int], Sequence[int]]) -> Any:
    """The object of a tensor table, its tensors over ``whole`` (a uint8 array over the
    mapping), the storages at ``places`` (their offsets and sizes, in manifest order, checked
    against the mapping by the manifest); :data:`NOT_FAST` where the table does not do."""
    try:
        blob = memoryview(b64.decode(table))
        with gc_paused():
            if blob[: len(MAGIC)] != MAGIC:
                return NOT_FAST  # another layout's table: the skeleton's path
            tensors, tree = _columns(blob, whole, places)
            if tensors is None:
                return NOT_FAST
            unpickler = _Tree(io.BytesIO(tree))
            unpickler.persistent_load = dict(enumerate(tensors)).__getitem__  # type: ignore[assignment]
            return unpickler.load()
    except Exception:  # a malformed table: the skeleton's path decides, with its errors
        return NOT_FAST


def _columns(
    blob: memoryview, whole: np.ndarray, places: tuple[Sequence[int], Sequence[int]]
) -> tuple[list[torch.Tensor] | None, memoryview]:
    """The tensors of a table (the dense ones, then the others) and its tree's
    bytes; None for the tensors where they do not check out."""
    dense, strided, tree = unpack_dense(blob)
    arrays = (np.asarray(places[0], dtype=np.int64), np.asarray(places[1], dtype=np.int64))
    made = make_dense(dense, whole, arrays)
    if made is None or not strided:
        return made, tree
    fields = _Closed(io.BytesIO(strided)).load()
    # A storage of a dense tensor is its alone: no other tensor may name it.
    if (
        type(fields) is not tuple
        or len(fields) != 6
        or not set(dense.storage.tolist()).isdisjoint(fields[4] if type(fields[4]) is tuple else ())
    ):
        return None, tree
    rest = make_strided(fields, whole, places)
    return (None if rest is None else made + rest), tree
