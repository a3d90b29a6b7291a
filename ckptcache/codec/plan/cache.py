"""Save plans reused across saves of the same structure, as DCP caches its save plans.

A training loop saves the same state dict shape again and again: the same keys, the same tensor
shapes, dtypes and strides, the same storage sharing, only the bytes differ. Pickling the
skeleton, laying out the archive and encoding the manifest cost time per tensor (most of a
save of thousands of small tensors) and give the same result every time. Here one
walk over the object describes its structure (:func:`describe`): everything the skeleton and
the plan depend on, and nothing they do not (the tensors' bytes). A structure seen before reuses
its skeleton and plan (:meth:`PlanCache.prepare`); only the time stamp, path and serialization
id are new.

Objects built of the common containers and values take this path: ``dict``, ``OrderedDict``
(with its attributes, as ``state_dict()``'s ``_metadata``), ``list``, ``tuple``, ``str``,
``bytes``, ``int``, ``float``, ``bool``, ``None`` and plain dense CPU/CUDA tensors (no
subclass, Python attributes, hooks, conj/neg bits or exotic layout); and, for the rest, the
objects whose reduction is known (:mod:`ckptcache.codec.plan.reduced`): ``torch.Size``, enum
members, named tuples, and instances pickled by ``object``'s default reduction (dataclasses,
DeepSpeed's ``LossScaler``), each described by its class and its reduction's output, described
in turn. Anything else is flattened afresh on every save, as before. A cached plan is only
stored when a fresh flatten of the same object agrees with the walk on every tensor and
storage, in order.

Where the package's C++ module is built, a save walks in C++ first
(:mod:`ckptcache.codec.plan.walk`): a compact byte key, equal for two objects exactly when
:func:`describe`'s keys are, and the storages as addresses and sizes for the copy. A plan is
kept under that key only where, on the miss that made it, the compiled walker's reference
key (the same walk writing :func:`describe`'s tuple) equals :func:`describe`'s, token for
token; what the compiled walk does not describe is walked here.

Why equal keys give equal skeletons: the walk visits what the pickler writes, in the order it
writes it, and the key records every value that decides a written byte (kinds, scalar values,
lengths, classes, tensor geometry) and, for what the pickler memoizes by identity (dicts,
lists, tensors, reduced objects), whether this is a first visit or which earlier one it repeats.
The pickler's output is a function of that sequence alone. Two equal strings, bytes or tuples
held as one object or as two pickle differently but load equal; that is the only freedom.
Integers that pickle as ``BININT1``, ``BININT2`` or ``BININT`` are the exception: the key has
their width (which fixes where every other byte goes) and :attr:`Structure.ints` their values,
which :class:`PlanCache` writes into a reused skeleton once it knows where they lie.

A structure met for the first time may find its plan kept by the daemon, in the segment of an
earlier save of the same structure (a job's first save, in a process that has planned
nothing yet): the caller's ``stored`` hook hands over the skeleton, tensor table and records
such a segment holds, checked against the compiled walk's key
(:mod:`ckptcache.codec.plan.stored`); only the archive's layout and manifest are made here.
The plans this cache makes, or takes so, wait in :meth:`PlanCache.to_keep` for the caller to
tell the daemon where they lie once their save is committed.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptcache.codec.flatten import Flattened, flatten, gc_paused, v3_dtypes
from ckptcache.codec.objectio import plan_object, replan
from ckptcache.codec.plan.columns import NotPlain, tensor_columns, tensor_items
from ckptcache.codec.plan.reduced import Reduction, reduction_of
from ckptcache.codec.plan.stored import (
    StoredPlan,
    plan_check,
    record_columns,
    structure_digest,
)
from ckptcache.codec.plan.walk import REF, Walk, reference_key, walk
from ckptcache.codec.skeleton import encode_flattened
from ckptcache.codec.table.table import encode_table
from ckptcache.format.manifest import ObjectPlan

__all__ = ["PlanCache", "Structure", "describe"]

_Tensor = torch.Tensor
_OrderedDict = collections.OrderedDict
_SCALARS = frozenset({int, bool, str, bytes, type(None)})
_REF = REF  # in a key: "the container or tensor first seen at index ..." follows
_NEWOBJ = object()  # in a key: a reduction written as ``NEWOBJ`` (class, then arguments)
_STATE = object()  # in a key: a reduced object's state follows (its ``BUILD``)
_strided = torch.strided
_double = struct.Struct("<d").pack
#: Per pickled width of an integer, its opcode (the byte before its little-endian payload).
_INT_OPCODES = {1: ord("K"), 2: ord("M"), 4: ord("J")}


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
    #: The values of the integers that :attr:`key` holds by their pickled width only
    #: (``BININT1``, ``BININT2`` or ``BININT``), in pickling order.
    ints: tuple[int, ...] = ()
    #: Per tensor, as :func:`tensor_columns` reads them: dtypes, shapes, strides, storage
    #: offsets, storage indices, ``requires_grad``, devices; then each storage's size.
    columns: tuple[Any, ...] = ()
    #: Whether the object is made of the common containers, values and tensors only (no
    #: object described by its reduction): what a tensor table may stand for.
    plain: bool = False
    #: Whether every tensor is on the CPU (:attr:`Flattened.on_cpu`).
    on_cpu: bool = False


def describe(obj: Any, *, versions: bool = True) -> Structure | None:
    """The structure of ``obj``, or ``None`` if it holds anything but the common containers,
    values and plain tensors (see the module docstring); ``versions``: read the tensors'
    version counters too (:attr:`Structure.versions`, for a non-blocking save's check)."""
    key: list[Any] = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}  # id() of a tensor, dict or list -> index of its first visit
    keep: list[Any] = []  # what ``seen`` names by id() stays alive while it is in use
    ints: list[int] = []  # the integers the key has by width only, in pickling order
    int_append = ints.append
    # Per class, how the pickler reduces its instances (decided once per walk: a class
    # patched between two saves is judged afresh).
    reductions: dict[type, Reduction | None] = {}
    reducing: set[int] = set()  # id() of the objects whose reduction is being walked
    add = key.append
    v3 = v3_dtypes()

    def visit(value: Any) -> None:
        kind = type(value)
        if kind in _SCALARS:
            add(kind)
            if kind is int and -2147483648 <= value <= 2147483647:  # BININT1/BININT2/BININT
                # Its pickled width, not its value: a counter that changes from save to save
                # is patched into a reused skeleton (``PlanCache``); the width fixes where
                # every other byte goes.
                add(1 if 0 <= value < 256 else 2 if 0 <= value < 65536 else 4)
                int_append(value)
            else:
                add(value)
            return
        if kind is float:
            add(kind)
            # Its bits, as the pickler writes them: 0.0 == -0.0 and NaN != NaN, and NaNs of
            # other signs or payloads pickle differently.
            add(_double(value))
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
            # Its fields go in columns after the walk (:func:`tensor_columns`): read for all
            # tensors at once, by C loops, not a dozen Python attribute reads per tensor.
            tensors.append(value)
        elif kind is dict or kind is _OrderedDict:
            add(len(value))
            for k, v in () if tensor_items(value, key, seen, tensors) else value.items():
                if type(k) is str:  # as ``visit(k)`` would add it, without the call
                    add(str)
                    add(k)
                else:
                    visit(k)
                if type(v) is _Tensor:  # as ``visit(v)`` would add it, without the call
                    first = seen.get(id(v))
                    if first is None:
                        seen[id(v)] = len(key)  # ``tensors`` keeps it alive
                        add(_Tensor)
                        tensors.append(v)
                    else:
                        add(_REF)
                        add(first)
                else:
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
            raise NotPlain
        if how.by_name:  # a class: written by name, equal exactly when it is the same class
            add(value)
            return
        if id(value) in reducing:
            raise NotPlain  # reached from its own arguments: the pickler's recursive case
        assert how.reduce is not None
        reducing.add(id(value))
        output = how.reduce(value)
        if output is None:
            raise NotPlain
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
            storages, counters, cdatas, columns, on_cpu = tensor_columns(tensors, v3, versions)
            key.extend(columns)
        return Structure(
            tuple(key), tuple(tensors), tuple(storages), tuple(counters), tuple(cdatas),
            tuple(ints), columns, plain=not reductions, on_cpu=on_cpu,
        )  # fmt: skip
    except (
        NotPlain,
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
        for held in (keep, seen, tensors, key, reductions, reducing, ints):
            held.clear()


@dataclass(frozen=True)
class _Entry:
    flat: Flattened
    plan: ObjectPlan
    #: The integers the skeleton holds where the key has their widths (``Structure.ints``).
    ints: tuple[int, ...] = ()
    #: Integer index -> (offset of its payload in the skeleton, width): the integers seen to
    #: change between two saves of this structure, whose places were learnt then.
    slots: Mapping[int, tuple[int, int]] = field(default_factory=dict)


class PlanCache:
    """The plans of the last ``size`` structures saved (per client: a trainer saves a few
    shapes in turn, the model and the optimizer state, say).

    Integers are part of a structure by their pickled width only. A save whose integers all
    equal the cached plan's reuses it as it is. A save whose integers differ (a step counter)
    flattens afresh the first time; the bytes of that skeleton and the cached one then differ
    only in those integers' payloads, which places them (:func:`_learn`, checked by patching
    the old skeleton into the new one byte for byte). From then on a save that changes only
    integers so placed gets the cached skeleton with its values written in (:func:`_patched`).
    """

    def __init__(self, size: int = 8):
        self._size = size
        # Newest last. Found by equality alone: a key is tens of thousands of items long, and
        # hashing it costs as much as comparing it (keys of other lengths differ at once).
        # Keys: the compiled walk's bytes, or the Python walk's tuple where it described the
        # object alone.
        self._entries: list[tuple[tuple[Any, ...] | bytes, _Entry]] = []
        self._lock = threading.Lock()
        #: Saves that reused a plan, and saves that flattened afresh (for tests and tuning).
        self.hits = 0
        self.misses = 0
        #: Plans taken from the daemon's copy of an earlier save (for tests and tuning).
        self.adopted = 0
        #: Path -> (structure digest, plan check, integers) of the plans made or taken for a
        #: save of that path, until the caller takes them (:meth:`to_keep`).
        self._to_keep: dict[str, tuple[str, str, tuple[int, ...]]] = {}

    def prepare(
        self,
        obj: Any,
        path: str,
        namespace: str,
        *,
        versions: bool = True,
        stored: Callable[[bytes, str], StoredPlan | None] | None = None,
    ) -> tuple[Flattened, ObjectPlan]:
        """``flatten(obj)`` and its plan for ``path``, reused where the structure is known;
        ``versions``: record the tensors' version counters (:attr:`Flattened.versions`);
        ``stored(key, path)``: where a structure met for the first time may find its plan
        kept by the daemon (asked on a miss whose object the compiled walk described, with
        its key; :mod:`ckptcache.codec.plan.stored`). With it, the plan made or taken on a
        miss waits in :meth:`to_keep`.

        Raises :class:`~ckptcache.errors.SerializationError` as :func:`flatten` does.
        """
        # The compiled walk where it describes the object, else the Python one.
        walked = walk(obj, versions=versions)
        structure = None if walked is not None else describe(obj, versions=versions)
        found: Walk | Structure | None = walked if walked is not None else structure
        previous = None  # a plan of this structure with other integers, none of them placed
        if found is not None:
            entry, previous = self._find(found)
            if (
                entry is None
                and previous is None
                and walked is not None
                and stored is not None
                and self._take(stored(walked.key, path), walked, path, namespace)
            ):
                entry, previous = self._find(found)
            if entry is not None:
                return _reused(entry, found), replan(entry.plan, path, namespace)
        if walked is not None:
            # A miss: the Python walk decides (it describes every object the compiled one
            # does), and the compact key is kept only where the two walks agree.
            structure = describe(obj, versions=versions)
            if structure is not None and not _walks_agree(obj, walked, structure):
                structure = None
        fast = None
        if structure is not None and structure.plain:
            # Written from the walk, byte for byte what ``flatten`` pickles (or None: pickle).
            fast = encode_flattened(
                obj, structure.tensors, structure.storages, structure.columns,
                structure.storage_ids,
            )  # fmt: skip
        flat = flatten(obj) if fast is None else fast
        agrees = structure is not None and _agrees(structure, flat)
        table = ""
        if agrees and structure is not None and structure.plain:
            table = encode_table(obj, structure.tensors, structure.columns)
        plan = plan_object(flat, path, namespace, table=table)
        with self._lock:
            self.misses += 1
            if agrees and structure is not None:
                slots = _learn(previous, structure.ints, flat.skeleton) if previous else {}
                # Only the skeleton and plan are kept: no reference to the caller's tensors.
                entry = _Entry(
                    Flattened(flat.skeleton, flat.infos, (), ()), plan, structure.ints, slots
                )
                key = walked.key if walked is not None else structure.key
                self._entries = [(k, e) for k, e in self._entries if e is not previous]
                self._entries.append((key, entry))
                del self._entries[: -self._size]
                if stored is not None and walked is not None:
                    # Where the next trainer's first save may find it (see ``to_keep``).
                    records = record_columns(flat.infos)
                    check = plan_check(walked.key, structure.ints, flat.skeleton, table, records)
                    self._keep(path, structure_digest(walked.key), check, structure.ints)
        return flat, plan

    def _find(self, found: Walk | Structure) -> tuple[_Entry | None, _Entry | None]:
        """The plan of ``found``'s structure and integers (counted as a hit), else ``None``
        and the plan of its structure with other integers, none of them placed, if any."""
        with self._lock:
            for i, (key, known) in enumerate(self._entries):
                if key == found.key:
                    entry = known if known.ints == found.ints else _patched(known, found.ints)
                    if entry is None:
                        return None, known
                    del self._entries[i]
                    self._entries.append((key, entry))
                    self.hits += 1
                    return entry, None
        return None, None

    def _take(self, stored: StoredPlan | None, walked: Walk, path: str, namespace: str) -> bool:
        """Keep ``stored``, a plan proven to be of the object the daemon holds, where that is
        of ``walked``'s structure; whether it was kept."""
        if stored is None or stored.key != walked.key:
            return False  # none, or of another structure: this save plans afresh
        plan = stored.plan or plan_object(stored.flat, path, namespace, table=stored.table)
        with self._lock:
            self.adopted += 1
            self._keep(path, structure_digest(stored.key), stored.check, stored.ints)
            self._entries = [(k, e) for k, e in self._entries if k != stored.key]
            self._entries.append((stored.key, _Entry(stored.flat, plan, stored.ints)))
            del self._entries[: -self._size]
        return True

    def to_keep(self, path: str) -> tuple[str, str, tuple[int, ...]] | None:
        """The structure digest, plan check and integers of the plan made or taken on a miss
        for a save of ``path`` (once): what the daemon is told once that save is committed."""
        with self._lock:
            return self._to_keep.pop(path, None)

    def _keep(self, path: str, digest: str, check: str, ints: tuple[int, ...]) -> None:
        # Under the lock. A save that never committed leaves its entry: the oldest go.
        self._to_keep.pop(path, None)
        self._to_keep[path] = (digest, check, ints)
        while len(self._to_keep) > self._size:
            del self._to_keep[next(iter(self._to_keep))]

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._entries.clear()


def _reused(entry: _Entry, found: Walk | Structure) -> Flattened:
    """A cached plan's skeleton with this save's tensors and storages."""
    return Flattened(
        entry.flat.skeleton, entry.flat.infos, found.storages, found.tensors, found.versions,
        found.storage_ids, on_cpu=found.on_cpu,
    )  # fmt: skip


def _walks_agree(obj: Any, walked: Walk, structure: Structure) -> bool:
    """Whether the compiled walk of ``obj`` saw what the Python walk did: its reference key
    (the same walker, making ``describe``'s tuple) equal to ``structure``'s, token for token
    (which holds the tensors' columns), the same tensors, storages and integers in order."""
    reference = reference_key(obj, versions=True)
    return (
        reference is not None
        and reference.key == structure.key
        and walked.ints == structure.ints
        and len(reference.tensors) == len(structure.tensors)
        and all(a is b for a, b in zip(reference.tensors, structure.tensors, strict=True))
        and tuple(reference.storage_ids) == structure.storage_ids
        and len(walked.storages) == len(structure.storages)
    )


def _payload(value: int, width: int) -> bytes:
    """An integer's bytes after its opcode: ``BININT1``/``BININT2`` unsigned, ``BININT``
    signed, little-endian."""
    return value.to_bytes(width, "little", signed=width == 4)


def _patched(known: _Entry, ints: tuple[int, ...]) -> _Entry | None:
    """``known`` with the integers ``ints`` written in, or ``None`` if one that differs has
    no learnt place."""
    if len(ints) != len(known.ints) or not known.slots:
        return None
    slots = known.slots
    changed = [j for j, (new, old) in enumerate(zip(ints, known.ints, strict=True)) if new != old]
    if not all(j in slots for j in changed):
        return None
    skeleton = bytearray(known.flat.skeleton)
    for j in changed:
        offset, width = slots[j]
        skeleton[offset : offset + width] = _payload(ints[j], width)
    pickled = bytes(skeleton)
    # The tensor table's tree holds the old integers: this save goes without one (a load
    # takes the skeleton's path).
    plan = dataclasses.replace(
        known.plan,
        archive=known.plan.archive.with_pickle(pickled),
        manifest=dataclasses.replace(known.plan.manifest, table=""),
    )
    flat = Flattened(pickled, known.flat.infos, (), ())
    return _Entry(flat, plan, ints, slots)


def _learn(
    previous: _Entry, ints: tuple[int, ...], skeleton: bytes
) -> Mapping[int, tuple[int, int]]:
    """Where the integers that differ between ``previous`` and a fresh skeleton of the same
    key (``ints``, ``skeleton``) lie, added to those ``previous`` knew; empty when that
    cannot be told for sure.

    With equal keys the two skeletons have the same length and differ only inside the
    payloads of the integers that differ (the pickler writes each in order, its width fixed
    by the key). Each such integer is placed at the first differing byte not yet explained,
    where the opcode of its width precedes it and its old and new values decode; exactly one
    such place must exist. The result is checked whole: the old skeleton with the new values
    written at those places must be the fresh skeleton, byte for byte.
    """
    old_skeleton, old = previous.flat.skeleton, previous.ints
    if len(old_skeleton) != len(skeleton) or len(old) != len(ints):
        return {}
    differ = np.flatnonzero(
        np.frombuffer(old_skeleton, np.uint8) != np.frombuffer(skeleton, np.uint8)
    ).tolist()
    slots = dict(previous.slots)
    at = 0  # the next differing byte to explain
    for j in (j for j, (new, was) in enumerate(zip(ints, old, strict=True)) if new != was):
        if at >= len(differ):
            return {}
        width = 1 if 0 <= ints[j] < 256 else 2 if 0 <= ints[j] < 65536 else 4
        opcode, first = _INT_OPCODES[width], differ[at]
        places = [
            p
            for p in range(max(1, first - width + 1), first + 1)
            if skeleton[p - 1] == opcode == old_skeleton[p - 1]
            and skeleton[p : p + width] == _payload(ints[j], width)
            and old_skeleton[p : p + width] == _payload(old[j], width)
        ]
        if len(places) != 1 or slots.get(j, (places[0], width)) != (places[0], width):
            return {}
        slots[j] = (places[0], width)
        while at < len(differ) and differ[at] < places[0] + width:
            at += 1
    if at != len(differ):
        return {}  # bytes that differ for another reason than the integers
    patched = bytearray(old_skeleton)
    for j, (offset, width) in slots.items():
        patched[offset : offset + width] = _payload(ints[j], width)
    return slots if patched == skeleton else {}


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
