"""Many small checkpoint items in one cached object, each still a ``torch.save`` archive.

Frameworks that write many small items into one file per rank (DCP's ``FileSystemWriter``
stores every tensor as a ``torch.save`` archive at ``(offset, length)`` of ``__{rank}_0.distcp``)
can hand the cache one object per file instead of one per item: :class:`Packed` lays the items'
archives out back to back in one ``uint8`` blob (:meth:`Client.save_packed
<ckptcache.client.Client.save_packed>` writes them straight into the cache's segment, with no
intermediate blob; :func:`pack` makes the blob as a tensor), and :func:`storage_offsets` says
where that tensor's bytes will lie in the file the daemon persists (ckptcache persists exactly
the archive ``torch.save`` writes). The item at ``span`` of the blob is then at
``base + span.offset`` of the persisted file, readable with the framework's own reader and no
ckptcache installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.shm import bytes_of, checked_nbytes, copy_storages_into
from ckptcache.format.archive import ARCHIVE_ALIGNMENT, ArchivePlan, plan_archive

__all__ = ["Packed", "Span", "pack", "storage_offsets"]


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


#: Archive plans of plain CPU tensors by geometry: a rank file repeats a few shapes many
#: times, and pickling each item's skeleton again would be most of the packing's own time.
_PLANS: dict[tuple[Any, ...], ArchivePlan] = {}
_PLANS_MAX = 4096


def _geometry(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Everything ``torch.save`` pickles for ``t`` besides its bytes, or ``None`` where that
    is more than this (subclasses, Python attributes, extra metadata, non-CPU storages)."""
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.__dict__:
        return None
    if t.requires_grad or t.is_conj() or t.is_neg() or torch._utils.get_tensor_metadata(t):
        return None
    storage = t.untyped_storage()
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), storage.nbytes())


def _plan(item: torch.Tensor | bytes | memoryview) -> tuple[int, Any]:
    if isinstance(item, torch.Tensor):
        key = _geometry(item)
        plan = _PLANS.get(key) if key is not None else None
        if plan is None:
            flat = flatten(item)
            plan = plan_archive(flat.skeleton, [i.nbytes for i in flat.infos])
            if key is not None and len(flat.storages) == 1:
                if len(_PLANS) >= _PLANS_MAX:
                    _PLANS.clear()
                _PLANS[key] = plan
            return plan.size, (plan, flat.storages, tuple(i.nbytes for i in flat.infos))
        storage = item.untyped_storage()
        return plan.size, (plan, (storage,), (storage.nbytes(),))  # as in ``key``
    view = memoryview(item).cast("B")
    return view.nbytes, view


def _align(n: int) -> int:
    return -(-n // ARCHIVE_ALIGNMENT) * ARCHIVE_ALIGNMENT


class Packed:
    """Items laid out for one blob, not yet copied anywhere: :meth:`fill` writes them into
    any ``uint8`` destination of :attr:`nbytes` (a cache segment, straight), and
    :meth:`materialize` into a new tensor (what :func:`pack` returns)."""

    def __init__(self, items: Sequence[torch.Tensor | bytes | memoryview]):
        self._planned = [_plan(item) for item in items]
        #: Where each item lies in the blob, in the order given.
        self.spans: list[Span] = []
        offset = 0
        for size, _ in self._planned:
            self.spans.append(Span(offset, size))
            offset = _align(offset + size)
        last = self.spans[-1] if self.spans else Span(0, 0)
        #: Length of the blob.
        self.nbytes = last.offset + last.length

    def fill(self, dst: torch.Tensor) -> None:
        """Write every item into ``dst`` (a CPU ``uint8`` tensor of :attr:`nbytes`): one copy
        of the tensor bytes, no serialization pass."""
        if dst.dtype != torch.uint8 or dst.numel() != self.nbytes or dst.device.type != "cpu":
            raise ValueError(f"fill needs a CPU uint8 tensor of {self.nbytes} bytes")
        view = dst.numpy().data if dst.numel() else memoryview(b"")
        end = 0
        runs: list[tuple[int, torch.UntypedStorage, int]] = []
        for span, (_, what) in zip(self.spans, self._planned, strict=True):
            # The alignment gap: zeros, never stale bytes of a reused buffer.
            view[end : span.offset] = bytes(span.offset - end)
            end = span.offset + span.length
            if isinstance(what, memoryview):
                view[span.offset : span.offset + span.length] = what
            else:
                runs += _write_archive(dst, view, span.offset, *what)
        # Every item's CPU bytes in one parallel copy: one per item would open a parallel
        # region per item, each waiting for descheduled workers on a busy node.
        copy_storages_into(dst, runs)

    def materialize(self) -> torch.Tensor:
        """A new ``uint8`` tensor holding the blob."""
        blob = torch.empty(self.nbytes, dtype=torch.uint8)
        self.fill(blob)
        return blob


def pack(items: Sequence[torch.Tensor | bytes | memoryview]) -> tuple[torch.Tensor, list[Span]]:
    """One ``uint8`` tensor holding every item: a tensor as the ``torch.save`` archive of that
    tensor, bytes as they are; each item starts at a 64-byte aligned offset."""
    packed = Packed(items)
    return packed.materialize(), packed.spans


def _write_archive(
    blob: torch.Tensor,
    view: memoryview,
    at: int,
    plan: ArchivePlan,
    storages: tuple[torch.UntypedStorage, ...],
    sizes: tuple[int, ...],
) -> list[tuple[int, torch.UntypedStorage, int]]:
    """Write an item's archive metadata and its non-CPU storages; returns the CPU storages
    with their offsets in ``blob`` and planned sizes, for the caller to copy all at once.
    A storage whose size is no longer the planned one raises
    :class:`~ckptcache.errors.TensorMutated`: it would not fit its place in ``plan``."""
    plan.write_metadata(view[at : at + plan.size])
    cpu: list[tuple[int, torch.UntypedStorage, int]] = []
    for off, storage, planned in zip(plan.storage_offsets, storages, sizes, strict=True):
        n = checked_nbytes(storage, planned)
        if n and storage.device.type == "cpu":
            cpu.append((at + off, storage, n))
        elif n:
            blob[at + off : at + off + n].copy_(bytes_of(storage))
    return cpu
