"""A save plan kept by the daemon: taken from the segment of an earlier save of the same
structure, checked against the save's own key before it is used.

A job's first save of a structure plans it afresh: the skeleton, the tensor table, the
archive's layout and manifest, tens of milliseconds for thousands of tensors, and most of a
first save whose process has just started. The daemon outlives trainers, and the segment of
an earlier save of the same structure holds that plan already: its skeleton, its tensor table
and its storages' records. So the client that plans a structure afresh tells the daemon where
the plan lies once its save is committed (``keep_plan``: :func:`structure_digest` of the
compiled walk's key, and :func:`plan_check`); the first save of a later trainer of the same
user whose walk gives the same key asks where it lies (``find_plan``: the path, and the
segment of its newest generation) and reads the plan from that segment's file
(:func:`plan_from_segment`: two ``pread``, no mapping, no pin); only the archive's layout and
manifest are made afresh.

What is read is never taken on trust (the segment may hold a newer save of another
structure, or bytes written over, or a save of another release of this package, or have
been reused or cut while it was read):
:func:`plan_check` is a digest over the package's release, the save's own key and the
integers it holds by width, the skeleton, the tensor table and every storage's record, and
the plan is used only where the digest of what the segment holds, with the save's own key,
is the one its planner sent. Equal keys give byte-equal plans (:mod:`ckptcache.codec.plan.cache`),
so a plan checked so is the plan this save would make; the storages' bytes are copied by the
save as always. A plan of another structure, or none, and the save plans afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptcache._version import __version__
from ckptcache.codec.flatten import Flattened, StorageInfo
from ckptcache.codec.objectio import plan_object
from ckptcache.format.manifest import Manifest, ObjectPlan

__all__ = [
    "SegmentPlan",
    "StoredPlan",
    "checked",
    "plan_check",
    "plan_from_segment",
    "read_ahead",
    "read_plan",
    "record_columns",
    "structure_digest",
]

#: What :func:`plan_check` binds besides the plan: the form of the digest and the release
#: whose encoders made the plan.
_CHECK_PERSON = b"ckptcache-plan1"
_length = struct.Struct("<Q").pack


@dataclass(frozen=True)
class StoredPlan:
    """A plan read from a segment, checked: the compiled walk's key it is the plan of, the
    integers its skeleton holds, its skeleton and storages (:attr:`flat`, no storage held),
    its tensor table and its :func:`plan_check`; :attr:`plan`: its archive's layout and
    manifest, where they were made ahead (for another path: a save replans them)."""

    key: bytes
    ints: tuple[int, ...]
    flat: Flattened
    table: str
    check: str
    plan: ObjectPlan | None = None


@dataclass(frozen=True)
class SegmentPlan:
    """A plan as a segment holds it, not checked yet (:func:`checked`): its skeleton and
    storages, its tensor table, its records as :func:`plan_check` reads them, and its
    archive's layout and manifest where they were made ahead (:func:`read_ahead`)."""

    flat: Flattened
    table: str
    records: tuple[Sequence[Any], ...]
    plan: ObjectPlan | None = None


def structure_digest(key: bytes) -> str:
    """The name under which the daemon keeps the plan of the structure whose compiled walk's
    key is ``key`` (hex)."""
    return hashlib.blake2b(key, digest_size=32).hexdigest()


def plan_check(
    key: bytes,
    ints: Sequence[int],
    skeleton: bytes,
    table: str,
    records: Sequence[Sequence[Any]],
) -> str:
    """The digest (hex) that binds a plan (``skeleton``, ``table``, the storages' records as
    five columns: keys, sizes, dtypes, locations, names) to the structure key ``key`` and
    its integers ``ints``, in this release."""
    h = hashlib.blake2b(digest_size=32, person=_CHECK_PERSON)
    keys, sizes, dtypes, locations, names = records
    parts = (
        __version__.encode(), key, ",".join(map(str, ints)).encode(), skeleton,
        table.encode("utf-8", "surrogatepass"), "\0".join(keys).encode("utf-8", "surrogatepass"),
        ",".join(map(str, sizes)).encode(), "\0".join(dtypes).encode("utf-8", "surrogatepass"),
        "\0".join(locations).encode("utf-8", "surrogatepass"),
        "\0".join(names).encode("utf-8", "surrogatepass"),
    )  # fmt: skip
    for part in parts:
        h.update(_length(len(part)))
        h.update(part)
    return h.hexdigest()


def record_columns(infos: Sequence[StorageInfo]) -> tuple[list[Any], ...]:
    """``infos`` as the five columns :func:`plan_check` takes."""
    return (
        [i.key for i in infos], [i.nbytes for i in infos], [i.dtype for i in infos],
        [i.location for i in infos], [i.name for i in infos],
    )  # fmt: skip


def read_plan(segment: str, manifest_offset: int, manifest_size: int) -> SegmentPlan | None:
    """The plan the segment file ``segment`` holds (its manifest at ``manifest_offset``), not
    checked; ``None`` where it cannot be read (raises nothing a damaged, reused, cut or
    removed segment causes). Read with ``pread``: a mapping would take the process's
    address-space lock, which a trainer's first save shares with the thread mapping its
    spare segment."""
    try:
        fd = os.open(segment, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            data = _read_exactly(fd, manifest_offset, manifest_size, size)
            manifest = Manifest.from_json(data, segment_size=size, keep_columns=True)
            po = manifest.pickle_offset
            skeleton = _read_exactly(fd, po, manifest.pickle_size, size)
        finally:
            os.close(fd)
        columns = manifest.columns()
        records = tuple(columns[i] for i in (0, 2, 3, 4, 5))
        infos = tuple(map(StorageInfo, *records))
    except (OSError, ValueError, TypeError, IndexError, OverflowError):
        return None
    return SegmentPlan(Flattened(skeleton, infos, (), ()), manifest.table, records)


def _read_exactly(fd: int, offset: int, length: int, size: int) -> bytes:
    """``length`` bytes at ``offset`` of a file of ``size`` bytes; ``ValueError`` where they
    are not all there (a range outside, a file cut meanwhile)."""
    if offset < 0 or length < 0 or offset + length > size:
        raise ValueError(f"{length} bytes at {offset} are outside a segment of {size}")
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ValueError(f"read {len(data)} of {length} bytes at {offset}")
    return data


def read_ahead(segment: str, manifest_offset: int, manifest_size: int) -> SegmentPlan | None:
    """:func:`read_plan`, with the archive's layout and manifest made too (under a path of no
    meaning: the save that uses it replans it for its own): what a client reads before its
    first save, off that save."""
    read = read_plan(segment, manifest_offset, manifest_size)
    if read is None:
        return None
    plan = plan_object(read.flat, "", "", table=read.table)
    return dataclasses.replace(read, plan=plan)


def checked(
    read: SegmentPlan | None, key: bytes, ints: tuple[int, ...], check: str
) -> StoredPlan | None:
    """``read`` where its :func:`plan_check` with the save's own ``key`` and the kept
    ``ints`` is the kept ``check``; else ``None``."""
    if read is None:
        return None
    if plan_check(key, ints, read.flat.skeleton, read.table, read.records) != check:
        return None
    return StoredPlan(key, ints, read.flat, read.table, check, read.plan)


def plan_from_segment(
    segment: str,
    manifest_offset: int,
    manifest_size: int,
    key: bytes,
    ints: tuple[int, ...],
    check: str,
) -> StoredPlan | None:
    """The plan that the segment file ``segment`` holds (its manifest at
    ``manifest_offset``), where its :func:`plan_check` with ``key`` and ``ints`` is ``check``;
    else ``None`` (another structure, damaged, unreadable: raises nothing)."""
    return checked(read_plan(segment, manifest_offset, manifest_size), key, ints, check)
