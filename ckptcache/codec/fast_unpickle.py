"""The weights-only load of a plain state dict's skeleton, in C where torch's runs in Python.

torch's weights-only unpickler interprets each opcode in Python, most of a load of thousands of
small tensors. :func:`fast_unpickle` runs the opcodes in the C unpickler with three globals allowed
(``_rebuild_tensor_v2``, ``OrderedDict`` and the storage classes, which only ever appear inside a
storage's persistent id) and only the rebuild of each tensor in Python. Anything else (another
global, a tensor with hooks or metadata, a bare storage, a malformed skeleton) returns
:data:`NOT_FAST` and torch's unpickler decides, with its own errors.

It is no less safe: no callable is reachable but those three (REDUCE, NEWOBJ, INST, OBJ, EXT
and STACK_GLOBAL all resolve through ``find_class``), and a tensor is only ever made over a
storage this load made, with the dtype its persistent id names.

Zero-copy loads give an array over the mapping (``load_array``): a tensor that covers its whole
storage, the common case, is then made by one ``torch.from_numpy`` of a typed view of that array,
cheaper than a storage, a typed storage and an ``empty().set_()``. Each storage's persistent id
then first yields a :class:`_Pending` that only the rebuild may consume; one that ends up anywhere
else in the result (a bare storage in the state, or a crafted skeleton that reuses it through the
memo) sends the load to torch's unpickler instead.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptcache.format.gcpause import gc_paused

#: Returned when the skeleton needs more than this path allows.
NOT_FAST = object()

#: ``load_array(key, nbytes)``: the bytes of storage ``key`` as a uint8 array over the
#: mapping, or None where a storage must be made the usual way.
ArrayLoader = Callable[[str, int], "np.ndarray | None"]

#: Each torch dtype that numpy has a twin of, and the twin (a tensor over an array of it is
#: made by one ``torch.from_numpy``).
NUMPY_TWINS: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64), torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16), torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32), torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_), torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}  # fmt: skip


class _NotFast(Exception):
    """The skeleton needs more than the fast path allows: torch's unpickler takes over."""


def fast_load_applies() -> bool:
    """False under a fake tensor mode: torch's rebuild makes fake tensors there."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is None


class _Pending:
    """A storage's persistent id, not yet a storage: the rebuild that consumes it makes the
    tensor straight from the mapping's array."""

    __slots__ = ("dtype", "saved_id", "used")

    def __init__(self, saved_id: tuple[Any, ...], dtype: torch.dtype):
        self.saved_id = saved_id
        self.dtype = dtype
        self.used = False


def _refs_unshared() -> int:
    """What ``sys.getrefcount`` reports for a pending storage that nothing but the check's own
    list and loop hold (measured the same way: the figure differs between Python versions)."""
    probe = [_Pending((), torch.uint8)]
    for entry in probe:
        return sys.getrefcount(entry)
    raise AssertionError("unreachable")


#: See :func:`_refs_unshared`; more than this means a pending storage sits in the result.
_PENDING_REFS = _refs_unshared()


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def fast_unpickle(
    skeleton: bytes | memoryview,
    persistent_load: Callable[[Any], torch.storage.TypedStorage],
    load_array: ArrayLoader | None = None,
) -> Any:
    """Unpickle ``skeleton`` (see the module docstring); :data:`NOT_FAST` where it cannot.

    ``persistent_load`` makes the storages the usual way (and keeps them for torch's
    unpickler, should it take over); ``load_array`` (zero-copy loads only) lets a tensor that
    covers its whole storage be made straight from the mapping."""
    made: dict[int, tuple[torch.storage.TypedStorage, torch.UntypedStorage, torch.dtype]] = {}
    pending: list[_Pending] = []

    def load_storage(saved_id: Any) -> Any:
        if load_array is not None and type(saved_id) is tuple and len(saved_id) == 5:
            storage_type = saved_id[1]
            if type(storage_type) is torch.serialization.StorageType:
                entry = _Pending(saved_id, storage_type.dtype)
                pending.append(entry)
                return entry
        typed = persistent_load(saved_id)
        made[id(typed)] = (typed, typed._untyped_storage, typed.dtype)
        return typed

    empty = torch.empty
    from_numpy = torch.from_numpy
    numpy_of = NUMPY_TWINS.get
    prod = math.prod

    # Storage key -> the storage its first tensor was made over: tied weights and views saved
    # together share one storage after the load, as they did before the save.
    by_key: dict[Any, torch.UntypedStorage] = {}

    def from_array(entry: _Pending, size: tuple[int, ...], stride: tuple[int, ...]) -> Any:
        """The tensor over the whole of ``entry``'s storage, or None if it does not cover it.

        The shape is given in numpy (a reshape of the array) rather than by a torch ``view``
        of the tensor, which costs more: this runs once per tensor of the state."""
        _, _, key, location, numel = entry.saved_id
        if location != "cpu" or type(numel) is not int or not numel or prod(size) != numel:
            return None
        if not (stride == (1,) if len(size) == 1 else _contiguous(size, stride)):
            return None
        dtype = entry.dtype
        nbytes = numel * dtype.itemsize
        array = load_array(str(key), nbytes)  # type: ignore[misc]
        if array is None or array.nbytes != nbytes:
            return None
        as_numpy = numpy_of(dtype)
        if as_numpy is not None:
            return from_numpy(array.view(as_numpy).reshape(size))
        # bfloat16, float8, ...: no numpy twin; the same bytes viewed in torch
        tensor = from_numpy(array).view(dtype)
        return tensor if len(size) == 1 else tensor.view(size)

    def pending_tensor(
        entry: _Pending, offset: Any, size: Any, stride: Any
    ) -> torch.Tensor:  # fmt: skip
        if entry.used:  # the memo handed one persistent id out twice
            raise _NotFast
        entry.used = True
        key = entry.saved_id[2]
        untyped = by_key.get(key)
        if untyped is None and offset == 0 and type(size) is tuple and type(stride) is tuple:
            tensor = from_array(entry, size, stride)
            if tensor is not None:
                by_key[key] = tensor.untyped_storage()
                return tensor
        if untyped is None:  # a view into part of its storage: the storage the usual way
            typed = persistent_load(entry.saved_id)
            untyped = by_key[key] = typed._untyped_storage
        return empty((0,), dtype=entry.dtype).set_(untyped, offset, size, stride)

    def rebuild(
        storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
        hooks: Any, metadata: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        if hooks or metadata or type(hooks) is not collections.OrderedDict:
            raise _NotFast
        if type(requires_grad) is not bool:
            raise _NotFast
        if type(storage) is _Pending:
            tensor = pending_tensor(storage, offset, size, stride)
        else:
            entry = made.get(id(storage))
            if entry is None or entry[0] is not storage:
                raise _NotFast
            _, untyped, dtype = entry
            tensor = empty((0,), dtype=dtype, device=untyped.device).set_(
                untyped, offset, size, stride
            )
        if requires_grad:
            tensor.requires_grad = True
        return tensor

    allowed = {
        ("torch._utils", "_rebuild_tensor_v2"): rebuild,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed.get((module, name))
            if found is not None:
                return found
            if module == "torch" and name.endswith("Storage"):
                try:
                    return torch.serialization.StorageType(name)
                except KeyError:
                    pass
            raise _NotFast

    unpickler = _Unpickler(io.BytesIO(skeleton), encoding="utf-8")
    unpickler.persistent_load = load_storage  # type: ignore[method-assign]
    try:
        with gc_paused():
            result = unpickler.load()
        del unpickler  # its memo holds every object it made
        # Each pending storage must have been consumed by one rebuild and be referenced by
        # nothing else (only ``pending`` and the call's argument): anything more means it
        # sits in the result where a storage should be.
        for entry in pending:
            if not entry.used or sys.getrefcount(entry) > _PENDING_REFS:
                return NOT_FAST
        return result
    except Exception:
        return NOT_FAST
    finally:
        # The local class is in a reference cycle (as every class is) that reaches the rebuild
        # (and through it ``made``, ``by_key`` and ``load_array``'s array over the mapping)
        # through its find_class: cleared, the storages (and the pins of a zero-copy load's
        # mapping) go with the last reference to the result, not at the next GC pass.
        allowed.clear()
        made.clear()
        pending.clear()
        by_key.clear()
