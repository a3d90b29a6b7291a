"""Save plans reused across saves of the same structure, as DCP caches its save plans.

A training loop saves the same state dict shape again and again: the same keys, the same tensor
shapes, dtypes and strides, the same storage sharing, only the bytes differ. Pickling the
skeleton, laying out the archive and encoding the manifest cost tens of microseconds per tensor
(most of a save of thousands of small tensors) and give the same result every time. Here one
walk over the object describes its structure (:func:`describe`): everything the skeleton and
the plan depend on, and nothing they do not (the tensors' bytes). A structure seen before reuses
its skeleton and plan (:meth:`PlanCache.prepare`); only the time stamp, path and serialization
id are new.

Objects built of the common containers and values take this path: ``dict``, ``OrderedDict``
(with its attributes, as ``state_dict()``'s ``_metadata``), ``list``, ``tuple``, ``str``,
``bytes``, ``int``, ``float``, ``bool``, ``None`` and plain dense CPU/CUDA tensors (no
subclass, Python attributes, hooks, conj/neg bits or exotic layout); and, for the rest, the
objects whose reduction is known (:mod:`ckptcache.format._reduced`): ``torch.Size``, enum
members, named tuples, and instances pickled by ``object``'s default reduction (dataclasses,
DeepSpeed's ``LossScaler``), each described by its class and its reduction's output, described
in turn. Anything else is flattened afresh on every save, as before. A cached plan is only
stored when a fresh flatten of the same object agrees with the walk on every tensor and
storage, in order.

Why equal keys give equal skeletons: the walk visits what the pickler writes, in the order it
writes it, and the key records every value that decides a written byte (kinds, scalar values,
lengths, classes, tensor geometry) and, for what the pickler memoizes by identity (dicts,
lists, tensors, reduced objects), whether this is a first visit or which earlier one it repeats.
The pickler's output is a function of that sequence alone. Two equal strings, bytes or tuples
held as one object or as two pickle differently but load equal; that is the only freedom.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ckptcache.format._reduced import Reduction, reduction_of
from ckptcache.format.flatten import Flattened, flatten, gc_paused, v3_dtypes
from ckptcache.format.manifest import ObjectPlan
from ckptcache.format.objectio import plan_object, replan

__all__ = ["PlanCache", "Structure", "describe"]

_Tensor = torch.Tensor
_OrderedDict = collections.OrderedDict
_SCALARS = frozenset({int, bool, str, bytes, type(None)})
_REF = object()  # in a key: "the container or tensor first seen at index ..." follows
_NEWOBJ = object()  # in a key: a reduction written as ``NEWOBJ`` (class, then arguments)
_STATE = object()  # in a key: a reduced object's state follows (its ``BUILD``)
_strided = torch.strided


class _NotPlain(Exception):
    """The object holds something the walk does not describe: flatten it afresh."""


@dataclass(frozen=True)
class Structure:
    """What a save's skeleton and plan depend on, and the tensors and storages it pickles."""

    #: Equal for two objects exactly when their skeletons and plans are the same.
    key: tuple[Any, ...]
    #: Every tensor pickled, in pickling order (each once), as :attr:`Flattened.tensors`.
    tensors: tuple[torch.Tensor, ...]
    #: Every storage, in the order ``flatten`` numbers them (``data/0``, ``data/1``, ...).
    storages: tuple[torch.UntypedStorage, ...]
    #: Per tensor: its version counter (``None`` for an inference-mode tensor, which has
    #: none), and its storage's ``_cdata``, as a non-blocking save's check records them.
    versions: tuple[int | None, ...] = ()
    storage_ids: tuple[int, ...] = ()


def describe(obj: Any) -> Structure | None:
    """The structure of ``obj``, or ``None`` if it holds anything but the common containers,
    values and plain tensors (see the module docstring)."""
    key: list[Any] = []
    tensors: list[torch.Tensor] = []
    storages: list[torch.UntypedStorage] = []
    storage_ids: dict[int, int] = {}  # storage _cdata -> index
    storage_dtypes: list[torch.dtype] = []
    ptr_dtypes: dict[int, torch.dtype] = {}
    seen: dict[int, int] = {}  # id() of a tensor, dict or list -> index of its first visit
    keep: list[Any] = []  # what ``seen`` names by id() stays alive while it is in use
    versions: list[int | None] = []
    cdatas: list[int] = []
    # Per class, how the pickler reduces its instances (decided once per walk: a class
    # patched between two saves is judged afresh).
    reductions: dict[type, Reduction | None] = {}
    reducing: set[int] = set()  # id() of the objects whose reduction is being walked
    add = key.append
    extend = key.extend
    v3 = v3_dtypes()

    def tensor(t: torch.Tensor) -> None:
        if (
            t.layout is not _strided
            or t.is_quantized
            or t.is_nested
            or not (t.is_cpu or t.is_cuda)
            or t._backward_hooks
            or t.__dict__
            or t.is_conj()
            or t.is_neg()
        ):
            raise _NotPlain
        dtype = t.dtype
        if dtype in v3:
            raise _NotPlain
        storage = t.untyped_storage()
        cdata = storage._cdata
        index = storage_ids.get(cdata)
        if index is None:
            index = storage_ids[cdata] = len(storages)
            storages.append(storage)
            storage_dtypes.append(dtype)
            ptr = storage.data_ptr()
            if ptr and ptr_dtypes.setdefault(ptr, dtype) != dtype:
                raise _NotPlain  # flatten refuses it, with its message
            add(storage.nbytes())
        elif storage_dtypes[index] != dtype:
            raise _NotPlain
        tensors.append(t)
        cdatas.append(cdata)
        try:
            versions.append(t._version)
        except RuntimeError:  # an inference-mode tensor: no counter
            versions.append(None)
        # Flat, of atoms only (the rank first, so the sizes and strides cannot run into the
        # next fields): no container per tensor for the cyclic collector to track and scan.
        add(dtype)
        add(t.dim())
        extend(t.shape)
        extend(t.stride())
        add(t.storage_offset())
        add(index)
        add(t.requires_grad)
        add(t.get_device())

    def visit(value: Any) -> None:
        kind = type(value)
        if kind in _SCALARS:
            add(kind)
            add(value)
            return
        if kind is float:
            add(kind)
            add(value.hex())  # 0.0 == -0.0 but they pickle differently; NaN != NaN
            return
        # Mutable containers and tensors keep their identity through a pickle (a second
        # reference is a memo lookup); tuples are rebuilt equal, which is all that is kept.
        if kind is _Tensor or kind is dict or kind is list or kind is _OrderedDict:
            first = seen.get(id(value))
            if first is not None:
                add(_REF)
                add(first)
                return
            seen[id(value)] = len(key)
            keep.append(value)
        add(kind)
        if kind is _Tensor:
            tensor(value)
        elif kind is dict or kind is _OrderedDict:
            add(len(value))
            for k, v in value.items():
                visit(k)
                visit(v)
            if kind is _OrderedDict:
                attributes = vars(value)  # pickled after the items (BUILD)
                add(len(attributes))
                if attributes:
                    visit(dict(attributes))
        elif kind is list or kind is tuple:
            add(len(value))
            for v in value:
                visit(v)
        else:
            reduced(value, kind)

    def reduced(value: Any, kind: type) -> None:
        # ``kind`` is in the key already. As the pickler: a memoized object is a GET.
        first = seen.get(id(value))
        if first is not None:
            add(_REF)
            add(first)
            return
        if kind not in reductions:
            reductions[kind] = reduction_of(kind)
        how = reductions[kind]
        if how is None:
            raise _NotPlain
        if how.by_name:  # a class: written by name, equal exactly when it is the same class
            add(value)
            return
        if id(value) in reducing:
            raise _NotPlain  # reached from its own arguments: the pickler's recursive case
        assert how.reduce is not None
        reducing.add(id(value))
        output = how.reduce(value)
        if output is None:
            raise _NotPlain
        func, args, state = output
        if func is None:  # copyreg.__newobj__: NEWOBJ writes the class, then the rest
            add(_NEWOBJ)
            visit(args[0])
            visit(args[1:])
        else:
            visit(func)
            visit(args)
        reducing.discard(id(value))
        # Memoized after its arguments, before its state, as the pickler does.
        seen[id(value)] = len(key)
        keep.append(value)
        add(_STATE)
        visit(state)

    try:
        with gc_paused():
            visit(obj)
        return Structure(
            tuple(key), tuple(tensors), tuple(storages), tuple(versions), tuple(cdatas)
        )
    except (
        _NotPlain,
        RecursionError,
        RuntimeError,
        NotImplementedError,
        TypeError,
        AttributeError,
    ):
        return None
    finally:
        # ``visit`` refers to itself (a cycle only the collector frees): what its closure
        # holds must not wait for that, or the caller's tensors would outlive their use.
        for held in (keep, seen, tensors, storages, key, versions, cdatas, reductions, reducing):
            held.clear()


@dataclass(frozen=True)
class _Entry:
    flat: Flattened
    plan: ObjectPlan


class PlanCache:
    """The plans of the last ``size`` structures saved (per client: a trainer saves a few
    shapes in turn, the model and the optimizer state, say)."""

    def __init__(self, size: int = 8):
        self._size = size
        # Newest last. Found by equality alone: a key is tens of thousands of items long, and
        # hashing it costs as much as comparing it (keys of other lengths differ at once).
        self._entries: list[tuple[tuple[Any, ...], _Entry]] = []
        self._lock = threading.Lock()
        #: Saves that reused a plan, and saves that flattened afresh (for tests and tuning).
        self.hits = 0
        self.misses = 0

    def prepare(self, obj: Any, path: str, namespace: str) -> tuple[Flattened, ObjectPlan]:
        """``flatten(obj)`` and its plan for ``path``, reused where the structure is known.

        Raises :class:`~ckptcache.errors.SerializationError` as :func:`flatten` does.
        """
        structure = describe(obj)
        if structure is not None:
            with self._lock:
                entry = None
                for i, (key, known) in enumerate(self._entries):
                    if key == structure.key:
                        entry = known
                        self._entries.append(self._entries.pop(i))
                        self.hits += 1
                        break
            if entry is not None:
                flat = Flattened(
                    entry.flat.skeleton, entry.flat.infos, structure.storages, structure.tensors,
                    structure.versions, structure.storage_ids,
                )  # fmt: skip
                return flat, replan(entry.plan, path, namespace)
        flat = flatten(obj)
        plan = plan_object(flat, path, namespace)
        with self._lock:
            self.misses += 1
            if structure is not None and _agrees(structure, flat):
                # Only the skeleton and plan are kept: no reference to the caller's tensors.
                entry = _Entry(Flattened(flat.skeleton, flat.infos, (), ()), plan)
                self._entries.append((structure.key, entry))
                del self._entries[: -self._size]
        return flat, plan

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._entries.clear()


def _agrees(structure: Structure, flat: Flattened) -> bool:
    """Whether the walk saw the tensors and storages the pickler did, in the same order."""
    return (
        len(structure.tensors) == len(flat.tensors)
        and len(structure.storages) == len(flat.storages)
        and all(a is b for a, b in zip(structure.tensors, flat.tensors, strict=True))
        and all(
            a._cdata == b._cdata for a, b in zip(structure.storages, flat.storages, strict=True)
        )
    )
