"""Object <-> (skeleton, storages): the ``torch.save`` object model without the copies.

``flatten`` pickles an object the way ``torch.save`` does (same ``persistent_id`` records, so
shared storages stay shared, views and non-contiguous tensors keep their strides, every dtype
round-trips), but instead of writing storage bytes it returns the storages so the caller can
copy each one once, straight into its final place. The inverse, ``unpickle``, unpickles a
skeleton with the storages that ``storage_loader`` makes from a callback's bytes, with
``weights_only`` semantics of ``torch.load``; which decoder rebuilds an object (this one or a
faster one) is chosen in :mod:`ckptcache.codec.decode` alone.
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptcache.errors import SerializationError, UnsafeUnpickle
from ckptcache.format.gcpause import gc_paused
from ckptcache.format.names import first_paths

__all__ = [
    "Flattened",
    "MapLocation",
    "StorageInfo",
    "extra_safe_globals",
    "flatten",
    "gc_paused",
    "restore_location",
    "storage_loader",
    "tensor_names",
    "unpickle",
    "v3_dtypes",
]

MapLocation = (
    str | torch.device | Mapping[str, str] | Callable[[torch.UntypedStorage, str], Any] | None
)

#: ``torch.save``'s default pickle protocol; matching it keeps skeletons interchangeable.
PICKLE_PROTOCOL = 2


@dataclass(frozen=True)
class StorageInfo:
    """One storage of a flattened object: record ``data/<key>`` of the archive."""

    key: str
    nbytes: int
    dtype: str
    location: str
    #: The state-dict path of the first tensor that uses this storage (for error messages).
    name: str


@dataclass(frozen=True)
class Flattened:
    """A flattened object: the pickle skeleton plus its storages in key order."""

    skeleton: bytes
    infos: tuple[StorageInfo, ...]
    #: In key order; where the compiled walk found them, a
    #: :class:`~ckptcache.codec.plan.walk.Sources` (their addresses and sizes for the copy).
    storages: Sequence[torch.UntypedStorage]
    #: Every tensor object pickled, wherever it sat (containers, Namespaces, dataclasses,
    #: custom objects, a Parameter and its ``.data``): what a non-blocking save checks.
    tensors: tuple[torch.Tensor, ...] = ()
    #: Per tensor of :attr:`tensors`, where the walk that found them took them already
    #: (empty: not taken): its version counter (``None``: it has none) and storage ``_cdata``.
    versions: tuple[int | None, ...] = ()
    storage_ids: tuple[int, ...] = ()
    #: Whether every storage is on the CPU, decided once where the storages were found (the
    #: copy into a segment and a non-blocking save's CUDA events follow it). ``False`` when
    #: not known: the copy then sorts the storages by device itself.
    on_cpu: bool = False

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(i.nbytes for i in self.infos)


def tensor_names(obj: Any) -> dict[int, str]:
    """Map each storage (by ``_cdata``) to the path of the first tensor that uses it."""
    return first_paths(obj, _is_tensor, _storage_id, _named_children)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage_id(value: torch.Tensor) -> int | None:
    try:
        return int(value.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None  # sparse/quantized/subclass tensors: unnamed, still saved


def _named_children(value: Any) -> list[tuple[str, Any]] | None:
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(value)]
    if isinstance(value, argparse.Namespace):
        return list(vars(value).items())
    return None


_PLAIN_DEVICES = frozenset({"cpu", "cuda"})


def _reduce_tensor(obj: Any) -> Any:
    """``Tensor.__reduce_ex__``'s result for a plain dense tensor, without its generic work.

    A state dict holds hundreds of tensors, and torch's reduction inspects each for Python
    state, hooks, subclasses and exotic layouts before it builds the same tuple as here; that
    was a third of a save's pickling. Every other object (and any tensor that is not a plain
    ``torch.Tensor`` with strided CPU/CUDA storage, no Python attributes and no hooks) goes
    the normal way: ``NotImplemented``. The records are the ones torch writes, byte for byte.
    """
    if (
        type(obj) is not torch.Tensor
        or obj.layout is not torch.strided
        or obj.is_quantized
        or obj.is_nested
        or obj.device.type not in _PLAIN_DEVICES
        or obj._backward_hooks
        or obj.__dict__
        or obj.dtype in v3_dtypes()
    ):
        return NotImplemented
    storage = torch.storage.TypedStorage(
        wrap_storage=obj.untyped_storage(), dtype=obj.dtype, _internal=True
    )
    args: tuple[Any, ...] = (
        storage,
        obj.storage_offset(),
        tuple(obj.size()),
        obj.stride(),
        obj.requires_grad,
        collections.OrderedDict(),  # torch never saves hooks (an empty OrderedDict)
    )
    metadata = torch._utils.get_tensor_metadata(obj)
    if metadata:
        args += (metadata,)
    return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        # Every object the pickle reaches passes here (builtin scalars and containers aside),
        # so this sees each tensor whose storage the skeleton records, however it is held.
        if type(obj) is collections.OrderedDict and not obj and not obj.__dict__:
            # Each tensor's (empty) hooks: OrderedDict's own reduction asks copyreg for the
            # class's slot names every time (a builtin type cannot cache them), a third of a
            # save's pickling. This writes the same records.
            return _EMPTY_ORDERED_DICT
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
        return _reduce_tensor(obj)


_EMPTY_ORDERED_DICT = (collections.OrderedDict, ())


@functools.cache
def v3_dtypes() -> frozenset[torch.dtype]:
    """Dtypes torch saves through ``_rebuild_tensor_v3`` (left to torch's own reduction)."""
    return frozenset(torch.storage._new_dtypes())


def flatten(obj: Any) -> Flattened:
    """Pickle ``obj``'s skeleton and collect its storages (no tensor bytes are copied).

    Raises :class:`SerializationError` for values ``torch.save`` could not save either.
    """
    names = tensor_names(obj)
    keys: dict[int, str] = {}
    storages: list[torch.UntypedStorage] = []
    infos: list[StorageInfo] = []
    dtypes_by_ptr: dict[int, torch.dtype] = {}
    locations: set[str] = set()

    storage_types = (torch.storage.TypedStorage, torch.UntypedStorage)

    def persistent_id(value: Any) -> tuple[Any, ...] | None:
        # Called for every object pickled (thousands per optimizer state): one C-level check
        # answers the common case, a value that is not a storage.
        if not isinstance(value, storage_types):
            return None
        if isinstance(value, torch.storage.TypedStorage):
            storage = value._untyped_storage
            dtype = value.dtype
            storage_type = getattr(torch, value._pickle_storage_type())
            numel = value._size()
        elif type(value) is torch.UntypedStorage:  # as torch.is_storage: the exact class
            storage = value
            dtype = torch.uint8
            storage_type = torch.UntypedStorage
            numel = storage.nbytes()
        else:
            return None
        ptr = storage.data_ptr()
        # As torch.save: one storage cannot be read back as two dtypes.
        allocated = storage.device.type != "meta" and ptr != 0
        if allocated and dtypes_by_ptr.setdefault(ptr, dtype) != dtype:
            raise SerializationError(
                "cannot save tensors that view the same data as different dtypes "
                f"({dtypes_by_ptr[ptr]} and {dtype}); clone one of them before saving"
            )
        key = keys.get(storage._cdata)
        if key is None:
            key = keys[storage._cdata] = str(len(keys))
            storages.append(storage)
            location = torch.serialization.location_tag(storage)
            locations.add(location)
            infos.append(
                StorageInfo(
                    key=key,
                    nbytes=storage.nbytes(),
                    dtype=str(dtype).removeprefix("torch."),
                    location=location,
                    name=names.get(storage._cdata, f"<storage {key}>"),
                )
            )
        return ("storage", storage_type, key, infos[int(key)].location, numel)

    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=PICKLE_PROTOCOL)
    # An instance attribute: the C pickler calls it without a Python method dispatch.
    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    try:
        with gc_paused():
            pickler.dump(obj)
    except SerializationError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as e:
        raise SerializationError(
            f"cannot save this object: {e}. ckptcache.save accepts what torch.save accepts "
            "(tensors, containers, and picklable Python values); convert or drop the "
            "offending value"
        ) from e
    return Flattened(
        buf.getvalue(), tuple(infos), tuple(storages), tuple(pickler.tensors),
        on_cpu=locations <= {"cpu"},
    )  # fmt: skip


def extra_safe_globals() -> list[Any]:
    """Globals allowed under ``weights_only=True`` beyond torch's own allowlist.

    Checkpoints of Megatron-LM and friends carry an ``argparse.Namespace`` and NumPy values;
    those are data, not code, so they are allowed here (torch.load would need
    ``add_safe_globals`` for them).
    """
    import numpy as np

    allowed: list[Any] = [argparse.Namespace, collections.OrderedDict, np.ndarray, np.dtype]
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    allowed += [multiarray._reconstruct, multiarray.scalar]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return allowed


def restore_location(
    storage: torch.UntypedStorage, location: str, map_location: MapLocation
) -> torch.UntypedStorage:
    """Move a loaded CPU storage where ``map_location`` says, with ``torch.load``'s rules."""
    if map_location is None:
        result = torch.serialization.default_restore_location(storage, location)
    elif isinstance(map_location, Mapping):
        target = map_location.get(location, location)
        result = torch.serialization.default_restore_location(storage, target)
    elif isinstance(map_location, (str, torch.device)):
        result = torch.serialization.default_restore_location(storage, str(map_location))
    elif callable(map_location):
        result = map_location(storage, location)
        if result is None:
            result = torch.serialization.default_restore_location(storage, location)
    else:
        raise TypeError(
            "map_location must be None, a str, a torch.device, a dict or a callable, "
            f"not {type(map_location).__name__}"
        )
    return result


#: ``load_storage(key, nbytes)``: the CPU storage of a skeleton's storage record ``key``.
StorageLoader = Callable[[str, int], torch.UntypedStorage]
#: An unpickler's ``persistent_load``: a storage record of the skeleton to its typed storage.
PersistentLoad = Callable[[Any], torch.storage.TypedStorage]


def storage_loader(
    load_storage: StorageLoader, map_location: MapLocation = None, placed: bool = False
) -> PersistentLoad:
    """The ``persistent_load`` of an unpickler of a skeleton: each storage record made into a
    typed storage over ``load_storage(key, nbytes)``'s CPU storage, moved where
    ``map_location`` says (``placed``: storages already there, left there), once per key."""
    loaded: dict[str, torch.storage.TypedStorage] = {}
    sizes: dict[Any, tuple[torch.dtype, int]] = {}  # storage class -> (dtype, element size)
    typed_storage = torch.storage.TypedStorage

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if type(saved_id) is not tuple or len(saved_id) != 5 or saved_id[0] != "storage":
            raise UnsafeUnpickle(f"unexpected persistent id in skeleton: {saved_id!r:.80}")
        _, storage_type, key, location, numel = saved_id
        typed = loaded.get(key)
        if typed is not None:
            return typed
        known = sizes.get(storage_type)
        if known is None:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            known = sizes[storage_type] = (dtype, torch._utils._element_size(dtype))
        dtype, element = known
        storage = load_storage(key, numel * element)
        # torch.load: "cpu" stays put. A placed storage skips torch's check of the device
        # and its move, per storage.
        if not placed and (map_location is not None or location != "cpu"):
            storage = restore_location(storage, location, map_location)
        typed = loaded[key] = typed_storage(wrap_storage=storage, dtype=dtype, _internal=True)
        return typed

    return persistent_load


def unpickle(
    skeleton: bytes | memoryview, persistent_load: PersistentLoad, *, weights_only: bool = True
) -> Any:
    """Rebuild an object from its skeleton with pickle's unpickler (torch's weights-only one
    under ``weights_only``), its storages from ``persistent_load`` (:func:`storage_loader`):
    the decoder of every skeleton, the last that :func:`~ckptcache.codec.decode.decode_skeleton`
    tries.

    With ``weights_only=True`` only torch's allowlist plus :func:`extra_safe_globals` may be
    unpickled; anything else raises :class:`UnsafeUnpickle`.
    """
    if weights_only:
        from torch import _weights_only_unpickler

        base: type[pickle.Unpickler] = _weights_only_unpickler.Unpickler  # type: ignore[assignment]
    else:
        base = pickle.Unpickler

    class _Unpickler(base):  # type: ignore[valid-type,misc]
        def find_class(self, module: str, name: str) -> Any:
            # Storage classes are rebuilt as StorageType, exactly as torch.load does.
            if "Storage" in name:
                try:
                    return torch.serialization.StorageType(name)
                except KeyError:
                    pass
            return super().find_class(module, name)

    unpickler = _Unpickler(io.BytesIO(skeleton), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    if not weights_only:
        return unpickler.load()
    try:
        with torch.serialization.safe_globals(extra_safe_globals()):
            return unpickler.load()
    except pickle.UnpicklingError as e:
        raise UnsafeUnpickle(
            f"refused to unpickle the checkpoint skeleton with weights_only=True: {e}. "
            "Load with weights_only=False only if you trust where the checkpoint came from, "
            "or allow the type with torch.serialization.add_safe_globals"
        ) from e
