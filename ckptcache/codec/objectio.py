"""Write a flattened object into a mapped segment, and rebuild it from one (through
:func:`~ckptcache.codec.decode.decode`).

Shared by the daemon client and by the data-loader batch cache, so every shared-memory object
in ckptcache has one layout (header, torch.save-compatible archive, manifest, digests).
"""

from __future__ import annotations

import dataclasses
import mmap
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptcache.codec.decode import Stored, decode
from ckptcache.codec.flatten import Flattened, MapLocation
from ckptcache.codec.gpu.copy import Item, Ready, copy_to_segment
from ckptcache.codec.plan.walk import Sources
from ckptcache.codec.shm import (
    checked_nbytes,
    copy_cpu_storages,
    copy_sources,
    copy_storage_into,
    copy_storages_into,
    device_type,
)
from ckptcache.format.archive import parse_archive, plan_archive
from ckptcache.format.layout import HEADER_SIZE, plan_segment
from ckptcache.format.manifest import (
    Manifest,
    ObjectPlan,
    encode_records,
    make_record,
    verify_digests,
)
from ckptcache.format.packed_records import PackedColumns

__all__ = [
    "Runs",
    "plan_object",
    "read_archive_object",
    "read_object",
    "replan",
    "write_metadata",
    "write_object",
]

#: What a save makes of its CPU storages' runs before the copy: columns of offsets in the
#: segment (``int64``), addresses (``uint64``) and sizes (``int64``) in, the same out.
Runs = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def plan_object(flat: Flattened, path: str, namespace: str, table: str = "") -> ObjectPlan:
    """Compute the archive, the manifest and the segment layout for ``flat``; ``table``: its
    tensor table, if it has one (:mod:`ckptcache.codec.table.table`)."""
    created = time.time()
    infos = flat.infos
    archive = plan_archive(
        flat.skeleton, [i.nbytes for i in infos], serialization_id=_serialization_id(created)
    )
    offsets = [HEADER_SIZE + off for off in archive.storage_offsets]
    columns = (
        [i.key for i in infos], offsets, [i.nbytes for i in infos], [i.dtype for i in infos],
        [i.location for i in infos], [i.name for i in infos],
    )  # fmt: skip
    records = tuple(map(make_record, zip(*columns, strict=True)))
    manifest = Manifest(
        path=path,
        namespace=namespace,
        payload_offset=HEADER_SIZE,
        payload_size=archive.size,
        pickle_offset=HEADER_SIZE + archive.pickle_offset,
        pickle_size=archive.pickle_size,
        storages=records,
        created=created,
        table=table,
    )
    encoded_records = encode_records(records)
    encoded = manifest.to_json(encoded_records)
    layout = plan_segment(archive.size, len(encoded), len(records))
    return ObjectPlan(layout, archive, manifest, encoded, encoded_records)


def replan(plan: ObjectPlan, path: str, namespace: str) -> ObjectPlan:
    """``plan`` for another save of the same structure: the same archive (but for its
    serialization id) and records, stamped with this save's time, path and namespace. No
    per-storage work: what a repeated save of a state dict of thousands of tensors needs."""
    created = time.time()
    archive = plan.archive.with_serialization_id(_serialization_id(created))
    manifest = dataclasses.replace(plan.manifest, path=path, namespace=namespace, created=created)
    encoded = manifest.to_json(plan.records_json or None)
    layout = plan_segment(archive.size, len(encoded), len(manifest.storages))
    return ObjectPlan(layout, archive, manifest, encoded, plan.records_json)


def _serialization_id(created: float) -> str:
    return f"{int(created * 1e9):040d}"


def write_metadata(
    mapping: mmap.mmap, plan: ObjectPlan, *, only: Sequence[int] | None = None
) -> None:
    """Write the archive's metadata and the manifest of ``plan`` to their places in
    ``mapping``; the storages' bytes are the caller's (see :func:`write_object`). ``only``:
    of the archive's pieces, these alone (the others are copied with the storages)."""
    view = memoryview(mapping)
    try:
        if only is None:
            plan.archive.write_metadata(view[HEADER_SIZE : HEADER_SIZE + plan.archive.size])
        for index in only or ():
            offset, data = plan.archive.pieces[index]
            view[HEADER_SIZE + offset : HEADER_SIZE + offset + len(data)] = data
        offset = plan.layout.manifest_offset
        view[offset : offset + len(plan.manifest_bytes)] = plan.manifest_bytes
    finally:
        view.release()


_nbytes_of = operator.attrgetter("nbytes")
_offset_of = operator.attrgetter("offset")
#: Pieces of this many bytes or more are written by slice, not as runs of the copy.
_BY_SLICE_FROM = 4096


@dataclass
class _CopyPlan:
    """What writing a plan's archive needs, read once per plan and shared by its replans
    (which share its records, and change only the pickle and the serialization id)."""

    records: Sequence[Any]  # kept: its id() names this entry
    offsets: list[int]
    sizes: list[int]
    offset_column: np.ndarray
    size_column: np.ndarray
    #: The archive's small metadata pieces as runs of the copy (made at the first write of a
    #: plan whose storages the compiled walk found): their bytes, where they go in the
    #: mapping, their addresses in ``pieces`` and sizes; and the indices of the pieces
    #: written by slice (large ones, the pickle and the serialization id).
    pieces: np.ndarray | None = None
    piece_offsets: np.ndarray | None = None
    piece_addresses: np.ndarray | None = None
    piece_sizes: np.ndarray | None = None
    by_slice: tuple[int, ...] = ()
    #: What the runs were made from: the archive's size and piece count.
    made_for: tuple[int, int] = (-1, -1)

    def piece_runs(self, plan: ObjectPlan) -> tuple[int, ...]:
        """Make the small pieces' runs (once) and give the pieces left to write by slice."""
        archive = plan.archive
        if self.made_for != (archive.size, len(archive.pieces)):
            own = {archive.id_piece} | {
                i for i, (offset, data) in enumerate(archive.pieces)
                if len(data) >= _BY_SLICE_FROM or offset == archive.pickle_offset
            }  # fmt: skip
            small = [p for i, p in enumerate(archive.pieces) if i not in own]
            sizes = np.fromiter((len(d) for _, d in small), np.int64, len(small))
            self.pieces = np.frombuffer(b"".join(d for _, d in small), dtype=np.uint8).copy()
            self.piece_sizes = sizes
            self.piece_addresses = (np.cumsum(sizes) - sizes).astype(np.uint64)
            self.piece_addresses += np.uint64(self.pieces.ctypes.data)
            offsets = np.fromiter((o for o, _ in small), np.int64, len(small))
            self.piece_offsets = offsets + HEADER_SIZE
            self.by_slice = tuple(sorted(own - {-1}))
            self.made_for = (archive.size, len(archive.pieces))
        return self.by_slice


#: The copy plans of the last plans written, by ``id(records)`` (the records are kept, so an
#: id is never reused while it is here). A replan shares its records with the plan it came
#: from: repeated saves read no record field.
_columns: dict[int, _CopyPlan] = {}
_columns_lock = threading.Lock()


def _copy_plan(records: Sequence[Any]) -> _CopyPlan:
    """The copy plan of ``records`` (read once per plan)."""
    with _columns_lock:
        known = _columns.get(id(records))
    if known is not None and known.records is records:
        return known
    offsets, sizes = list(map(_offset_of, records)), list(map(_nbytes_of, records))
    made = _CopyPlan(
        records, offsets, sizes, np.array(offsets, dtype=np.int64), np.array(sizes, np.int64)
    )
    with _columns_lock:
        _columns[id(records)] = made
        while len(_columns) > 8:
            del _columns[next(iter(_columns))]
    return made


def _write_sources(
    mapping: mmap.mmap, plan: ObjectPlan, copy: _CopyPlan, sources: Sources, runs: Runs | None
) -> bool:
    """Write ``plan``'s object whose storages the compiled walk found: the storages and the
    archive's small metadata pieces in one copy, run by the copy threads from columns (no
    Python object per storage or piece); ``False`` (nothing written) where a storage's size
    is not the planned one."""
    addresses, sizes = sources.columns()
    if not np.array_equal(sizes, copy.size_column):
        return False
    offsets = copy.offset_column
    if runs is not None:
        offsets, addresses, sizes = runs(offsets, addresses, sizes)
    by_slice = copy.piece_runs(plan)
    assert copy.piece_offsets is not None and copy.piece_addresses is not None
    assert copy.piece_sizes is not None
    write_metadata(mapping, plan, only=by_slice)
    copy_sources(
        torch.frombuffer(mapping, dtype=torch.uint8),
        np.concatenate((offsets, copy.piece_offsets)),
        np.concatenate((addresses, copy.piece_addresses)),
        np.concatenate((sizes, copy.piece_sizes)),
    )
    return True


def write_object(
    mapping: mmap.mmap,
    plan: ObjectPlan,
    flat: Flattened,
    ready: Ready | None = None,
    runs: Runs | None = None,
) -> None:
    """Copy archive metadata, every storage and the manifest to their places in ``mapping``.

    ``ready``: for a copy on another thread than the one that made the tensors, the CUDA
    events its device-to-host copies wait for (:func:`~ckptcache.codec.gpu.copy.record_ready`).
    ``runs``: for an object all on the CPU, what the storages' runs (offsets, addresses,
    sizes) become before the copy (the runs of the bytes the segment lacks:
    :mod:`ckptcache.client._unchanged`).

    The header is left alone: whoever owns the segment's state publishes it. Each storage
    must still have the size it was planned with (else :class:`TensorMutated`, before any
    copy: see :func:`~ckptcache.codec.shm.checked_nbytes`).
    """
    records = plan.manifest.storages
    copy = _copy_plan(records)
    offsets, planned = copy.offsets, copy.sizes
    # Found by the compiled walk (the usual repeated save); a size changed: named below.
    if (
        isinstance(flat.storages, Sources)
        and flat.on_cpu
        and _write_sources(mapping, plan, copy, flat.storages, runs)
    ):
        return
    storages = list(flat.storages)
    sizes = list(map(torch.UntypedStorage.nbytes, storages))
    if sizes != planned:
        for record, storage in zip(records, storages, strict=True):  # name the one resized
            checked_nbytes(storage, record.nbytes, record.name)
    if flat.on_cpu:  # the usual case: no sort per storage
        write_metadata(mapping, plan)
        dst = torch.frombuffer(mapping, dtype=torch.uint8)
        if runs is not None:
            addresses = np.fromiter(map(torch.UntypedStorage.data_ptr, storages), np.uint64,
                                    len(storages))  # fmt: skip
            columns = runs(copy.offset_column, addresses, copy.size_column)
            if columns[2] is not copy.size_column:  # some storages lie in the segment already
                copy_sources(dst, *columns)
                return
        copy_cpu_storages(dst, offsets, storages, sizes)
        return
    placed = list(zip(offsets, storages, planned, strict=True))
    on_cpu: list[tuple[int, torch.UntypedStorage, int]] = []
    on_device: list[Item] = []
    elsewhere: list[tuple[int, torch.UntypedStorage, int]] = []
    for index, (run, kind) in enumerate(zip(placed, map(device_type, storages), strict=True)):
        if kind == "cuda":
            on_device.append((index, *run))
        else:
            (on_cpu if kind == "cpu" else elsewhere).append(run)
    # Device-to-host copies start first (DMA into the pinned segment) and overlap the CPU ones.
    wait = copy_to_segment(mapping, on_device, ready) if on_device else None
    if on_cpu:  # one parallel copy for every CPU storage
        copy_storages_into(torch.frombuffer(mapping, dtype=torch.uint8), on_cpu)
    for offset, storage, nbytes in elsewhere:
        copy_storage_into(mapping, offset, storage, nbytes)
    if wait is not None:
        wait()
    # Last: a gathered device run also wrote the bytes between its storages, which are all
    # archive metadata.
    write_metadata(mapping, plan)


def read_object(
    mapping: mmap.mmap,
    manifest_offset: int,
    manifest_size: int,
    *,
    zero_copy: bool = True,
    weights_only: bool = True,
    map_location: MapLocation = None,
    digests: Sequence[int] | None = None,
    tier: str = "local",
) -> Any:
    """Rebuild the object stored in ``mapping``.

    With ``zero_copy`` the CPU storages are views of ``mapping`` (which they keep alive);
    otherwise private copies. ``digests``, when given, are checked first and a mismatch raises
    :class:`~ckptcache.errors.CorruptCheckpoint` naming the tensor. The decoders are tried in
    :mod:`ckptcache.codec.decode`'s order.
    """
    view = memoryview(mapping)
    try:
        manifest = Manifest.from_json(
            view[manifest_offset : manifest_offset + manifest_size], segment_size=len(mapping),
            keep_columns=True,
        )  # fmt: skip
        if digests is not None:
            verify_digests(view, manifest, digests, tier=tier)
        po = manifest.pickle_offset
        skeleton = bytes(view[po : po + manifest.pickle_size])
    finally:
        view.release()
    columns = manifest.columns()  # key, offset, nbytes, ...
    # Packed records give their offsets and sizes as arrays: no list made of them.
    extents: tuple[Any, Any] = (
        (columns.offsets, columns.sizes)
        if isinstance(columns, PackedColumns)
        else (columns[1], columns[2])
    )

    def places() -> dict[str, tuple[int, int]]:
        return dict(zip(columns[0], zip(columns[1], columns[2], strict=True), strict=True))

    stored = Stored(mapping, skeleton, places, manifest.path, tier, manifest.table, extents)
    return decode(stored, zero_copy=zero_copy, weights_only=weights_only, map_location=map_location)


def read_archive_object(
    mapping: mmap.mmap,
    *,
    path: str,
    weights_only: bool = True,
    map_location: MapLocation = None,
) -> Any:
    """Rebuild the object of the ``torch.save`` archive that fills ``mapping`` (a stored file
    read into memory, already checked: :func:`ckptcache.codec.stored_load.read_verified`); the
    CPU storages are views of ``mapping``, which they keep alive."""
    view = memoryview(mapping)
    try:
        parsed = parse_archive(view)
        po = parsed.pickle_offset
        skeleton = bytes(view[po : po + parsed.pickle_size])
    finally:
        view.release()
    stored = Stored(mapping, skeleton, lambda: dict(parsed.storages), path, "storage")
    return decode(stored, weights_only=weights_only, map_location=map_location)
