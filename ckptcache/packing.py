"""Many small checkpoint items in one cached object, each still a ``torch.save`` archive.

Frameworks that write many small items into one file per rank (DCP's ``FileSystemWriter``
stores every tensor as a ``torch.save`` archive at ``(offset, length)`` of ``__{rank}_0.distcp``)
can hand the cache one object per file instead of one per item: :func:`pack` lays the items'
archives out back to back in one ``uint8`` tensor, and :func:`storage_offsets` says where that
tensor's bytes will lie in the file the daemon persists (ckptcache persists exactly the archive
``torch.save`` writes). The item at ``span`` of the blob is then at ``base + span.offset`` of the
persisted file, readable with the framework's own reader and no ckptcache installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptcache.format.archive import ARCHIVE_ALIGNMENT, ArchivePlan, plan_archive
from ckptcache.format.flatten import Flattened, flatten
from ckptcache.format.shm import _bytes_of

__all__ = ["Span", "pack", "storage_offsets"]


@dataclass(frozen=True)
class Span:
    """Where one packed item lies in the blob."""

    offset: int
    length: int


def storage_offsets(obj: Any) -> tuple[int, ...]:
    """Where the bytes of each of ``obj``'s storages start in the archive that ``torch.save``
    (and so the daemon's persisted file, and the write-through fallback) writes for ``obj``."""
    flat = flatten(obj)
    return plan_archive(flat.skeleton, [i.nbytes for i in flat.infos]).storage_offsets


def _plan(item: torch.Tensor | bytes | memoryview) -> tuple[int, Any]:
    if isinstance(item, torch.Tensor):
        flat = flatten(item)
        plan = plan_archive(flat.skeleton, [i.nbytes for i in flat.infos])
        return plan.size, (plan, flat)
    view = memoryview(item).cast("B")
    return view.nbytes, view


def _align(n: int) -> int:
    return -(-n // ARCHIVE_ALIGNMENT) * ARCHIVE_ALIGNMENT


def pack(items: Sequence[torch.Tensor | bytes | memoryview]) -> tuple[torch.Tensor, list[Span]]:
    """One ``uint8`` tensor holding every item: a tensor as the ``torch.save`` archive of that
    tensor, bytes as they are; each item starts at a 64-byte aligned offset. One copy of the
    tensor bytes, no serialization pass."""
    planned = [_plan(item) for item in items]
    spans, offset = [], 0
    for size, _ in planned:
        spans.append(Span(offset, size))
        offset = _align(offset + size)
    blob = torch.empty(spans[-1].offset + spans[-1].length if spans else 0, dtype=torch.uint8)
    view = blob.numpy().data if blob.numel() else memoryview(b"")
    for span, (_, what) in zip(spans, planned, strict=True):
        if isinstance(what, memoryview):
            view[span.offset : span.offset + span.length] = what
        else:
            _write_archive(blob, view, span.offset, *what)
    return blob, spans


def _write_archive(
    blob: torch.Tensor, view: memoryview, at: int, plan: ArchivePlan, flat: Flattened
) -> None:
    plan.write_metadata(view[at : at + plan.size])
    for off, storage in zip(plan.storage_offsets, flat.storages, strict=True):
        n = storage.nbytes()
        if n:
            blob[at + off : at + off + n].copy_(_bytes_of(storage))
