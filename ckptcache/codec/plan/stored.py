"""A save plan taken from an object the daemon holds, proven against it before it is used.

A job's first save of a structure plans it afresh: the skeleton, the tensor table, the
archive's layout and manifest, tens of milliseconds for thousands of tensors, and most of a
first save whose process has just started. The daemon outlives trainers, and what it holds of
an earlier save of the same structure (an earlier job's ``step-100/model.pt`` for this job's
``step-200/model.pt``) carries that plan already: its segment holds the skeleton, the tensor
table and the storages' records. :func:`plan_of_stored` takes them from the segment, and the
plan cache (:meth:`~ckptcache.codec.plan.cache.PlanCache.prepare`) uses them for a state whose
compiled walk gives the same key.

Nothing stored is taken on trust (another process wrote it, maybe another release of this
package, maybe for another structure under the same name): the skeleton is decoded over the
segment and walked, and so is the tensor table where there is one; both must give the key
the save's own walk gives, with every storage found at the place its record names, in the
order the key numbers them. A skeleton that loads to an object of the save's exact structure
(keys, scalar values, tensor geometry, storage sharing) is the skeleton of that structure,
whichever encoder wrote it: with the save's storages copied at its records' places, a load
gives the save's object. The storages' records are not reused (their offsets are planned
afresh around this skeleton); their dtypes, locations and names are read from the decoded
object, as a fresh plan reads them from the trainer's.

Where anything does not check out (the compiled walk not built, a structure it does not
describe, a skeleton only torch's unpickler reads, another key), :func:`plan_of_stored`
gives ``None`` and the save plans afresh.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptcache.codec.decode import Stored, decode
from ckptcache.codec.flatten import Flattened, StorageInfo, tensor_names
from ckptcache.codec.plan.walk import Walk, reference_key, walk
from ckptcache.format.manifest import Manifest
from ckptcache.format.packed_records import PackedColumns

__all__ = ["StoredPlan", "plan_of_stored"]


@dataclass(frozen=True)
class StoredPlan:
    """A stored object's plan, proven: the compiled walk's key and integers of the object it
    decodes to, its skeleton and storages (:attr:`flat`, no storage held) and tensor table."""

    key: bytes
    ints: tuple[int, ...]
    flat: Flattened
    table: str


def plan_of_stored(
    mapping: mmap.mmap, manifest_offset: int, manifest_size: int
) -> StoredPlan | None:
    """The plan of the object stored in ``mapping`` (a segment, mapped copy-on-write, whose
    manifest lies at ``manifest_offset``), or ``None`` where it cannot be proven (see the
    module docstring). Decodes what the segment holds: raises nothing a damaged or foreign
    segment could cause."""
    try:
        return _proven(mapping, manifest_offset, manifest_size)
    except Exception:  # a segment that does not decode: no plan from it
        return None


def _proven(mapping: mmap.mmap, manifest_offset: int, manifest_size: int) -> StoredPlan | None:
    view = memoryview(mapping)
    try:
        manifest = Manifest.from_json(
            view[manifest_offset : manifest_offset + manifest_size], segment_size=len(mapping),
            keep_columns=True,
        )  # fmt: skip
        po = manifest.pickle_offset
        skeleton = bytes(view[po : po + manifest.pickle_size])
    finally:
        view.release()
    columns = manifest.columns()
    keys, offsets, sizes = columns[0], columns[1], columns[2]
    n = len(keys)
    if not n or list(keys) != [str(i) for i in range(n)]:
        return None  # storages numbered as ``flatten`` numbers them, or nothing to prove
    extents: tuple[Any, Any] = (
        (columns.offsets, columns.sizes) if isinstance(columns, PackedColumns) else (offsets, sizes)
    )
    whole = np.frombuffer(mapping, dtype=np.uint8)
    base = whole.ctypes.data
    expected = (np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64))

    def places() -> dict[str, tuple[int, int]]:
        return dict(zip(keys, zip(offsets, sizes, strict=True), strict=True))

    def walked(table: str) -> tuple[Any, Walk] | None:
        stored = Stored(mapping, skeleton, places, manifest.path, "local", table, extents)
        obj = decode(stored, zero_copy=True, weights_only=True)
        found = walk(obj, versions=False)
        if found is None or not found.on_cpu or len(found.storages) != n:
            return None
        addresses, nbytes = found.storages.columns()
        if not (
            np.array_equal(addresses.astype(np.int64) - base, expected[0])
            and np.array_equal(nbytes, expected[1])
        ):
            return None  # storage i of the key is not record i: the skeleton numbers others
        return obj, found

    # The skeleton alone (no table): what torch.load and every other decoder read.
    by_skeleton = walked("")
    if by_skeleton is None:
        return None
    obj, found = by_skeleton
    if manifest.table:
        by_table = walked(manifest.table)
        if by_table is None or (by_table[1].key, by_table[1].ints) != (found.key, found.ints):
            return None  # a table that loads to anything else than its skeleton
        del by_table
    infos = _infos(obj, n)
    if infos is None:
        return None
    return StoredPlan(found.key, found.ints, Flattened(skeleton, infos, (), ()), manifest.table)


def _infos(obj: Any, n: int) -> tuple[StorageInfo, ...] | None:
    """The storages' records of ``obj`` (decoded on the CPU), as a fresh plan makes them:
    each one's dtype that of the first tensor over it, its path that tensor's."""
    reference = reference_key(obj, versions=True)
    if reference is None or reference.columns is None:
        return None
    dtypes, indices = reference.columns[0], reference.columns[4]
    first: dict[int, tuple[torch.dtype, int]] = {}
    for index, dtype, storage_id in zip(indices, dtypes, reference.storage_ids, strict=True):
        first.setdefault(index, (dtype, storage_id))
    if len(first) != n:
        return None
    sizes = reference.columns[7]
    location = torch.serialization.location_tag(reference.storages()[0])
    names = tensor_names(obj)
    return tuple(
        StorageInfo(
            key=str(s),
            nbytes=sizes[s],
            dtype=str(first[s][0]).removeprefix("torch."),
            location=location,
            name=names.get(first[s][1], f"<storage {s}>"),
        )
        for s in range(n)
    )
