"""Bucket plans: many tensors per collective, and no collective larger than the bucket size.

Every rank derives the same plan from the same tensor specs, so only the specs travel.
Tensors smaller than ``direct_bytes`` are packed back to back into buckets of one dtype (model
tensors apart from the rest, see :func:`plan_buckets`); a larger tensor is sent alone, cut into
bucket-sized chunks when it exceeds the bucket. A bucket whose segments lie back to back in a
rank's memory (a single segment of a contiguous tensor, or tensors that are views of one flat
buffer, as :func:`allocate_flat` makes them) is sent straight from, or received straight into,
that memory: no packing copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptcache.recovery._state import TensorSpec

__all__ = [
    "Bucket",
    "BufferPool",
    "Segment",
    "allocate_flat",
    "flat_view",
    "pack",
    "plan_buckets",
    "segment_view",
    "unpack",
]

#: Default bucket size: large enough to run at link bandwidth, small enough to pipeline.
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

#: Largest packed bucket: packing buffers are reused once the pipeline has ``depth`` of them,
#: so a small one keeps the page faults of fresh memory off most of the packing.
PACK_BYTES = 4 * 1024 * 1024

#: Tensors from this size up are sent alone, straight from the source's memory: one more
#: collective costs less than packing them (a copy on the source, into memory the packing
#: buffer has not touched yet; ``benchmarks/p2p_recovery/README.md``).
DIRECT_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + numel)`` of tensor ``tensor`` at ``offset`` in the bucket."""

    tensor: int
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One collective's worth of data: a flat buffer of ``numel`` elements of ``dtype``."""

    dtype: torch.dtype
    numel: int
    segments: tuple[Segment, ...]


def plan_buckets(
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    *,
    include: Sequence[int] | None = None,
    direct_bytes: int | None = None,
    pack_bytes: int | None = None,
) -> tuple[Bucket, ...]:
    """Lay the tensors ``include`` (default: all) of ``specs`` out in buckets.

    Tensors of at least ``direct_bytes`` (default: ``bucket_bytes``) get buckets of their own;
    the others are packed into buckets of at most ``pack_bytes`` (default: ``bucket_bytes``),
    grouped by dtype and by whether they belong to the model: a
    receiver holds its model tensors already but often allocates the rest (a re-created
    optimizer's state), and a bucket made only of tensors it allocates is received in place.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    direct = bucket_bytes if direct_bytes is None else min(direct_bytes, bucket_bytes)
    packed = bucket_bytes if pack_bytes is None else min(pack_bytes, bucket_bytes)
    indices = range(len(specs)) if include is None else include
    groups: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i in indices:
        if specs[i].numel:
            groups.setdefault((specs[i].dtype, specs[i].path[:1] == ("model",)), []).append(i)
    buckets: list[Bucket] = []
    for (dtype, _), members in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        capacity = max(1, bucket_bytes // itemsize)
        alone = max(1, direct // itemsize)
        pack_capacity = max(1, packed // itemsize)
        open_segments: list[Segment] = []
        used = 0
        for i in members:
            n = specs[i].numel
            if n >= alone:
                # Whole chunks of one tensor: aligned to its start so each can go zero-copy.
                for start in range(0, n, capacity):
                    size = min(capacity, n - start)
                    buckets.append(Bucket(dtype, size, (Segment(i, start, size, 0),)))
                continue
            if open_segments and used + n > pack_capacity:
                buckets.append(Bucket(dtype, used, tuple(open_segments)))
                open_segments, used = [], 0
            open_segments.append(Segment(i, 0, n, used))
            used += n
        if open_segments:
            buckets.append(Bucket(dtype, used, tuple(open_segments)))
    return tuple(buckets)


def segment_view(t: torch.Tensor, seg: Segment) -> torch.Tensor | None:
    """The segment as a flat view of ``t``'s own memory, or None if ``t`` is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.view(-1)[seg.start : seg.start + seg.numel]


def flat_view(
    bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The bucket as one flat view of ``tensors``' memory, or None if a copy is needed.

    That is the case when every segment is contiguous on ``device`` and they lie back to back
    in one storage in bucket order: one segment of a contiguous tensor, or tensors that
    :func:`allocate_flat` made.
    """
    first: torch.Tensor | None = None
    for seg in bucket.segments:
        t = tensors[seg.tensor]
        if t.device != device or t.dtype != bucket.dtype:
            return None
        view = segment_view(t, seg)
        if view is None:
            return None
        if first is None:
            first = view
        elif view.data_ptr() != first.data_ptr() + seg.offset * first.element_size():
            return None  # usually at the second segment: separate tensors, a copy is needed
    assert first is not None
    if len(bucket.segments) == 1:
        return first
    if (first.storage_offset() + bucket.numel) * first.element_size() > (
        first.untyped_storage().nbytes()
    ):
        return None
    return first.as_strided((bucket.numel,), (1,), first.storage_offset())


def allocate_flat(
    bucket: Bucket, specs: Sequence[TensorSpec], device: torch.device
) -> dict[int, torch.Tensor] | None:
    """New tensors for the bucket's segments, all views of one flat buffer in bucket order.

    Receiving the bucket into that buffer then fills them all with no copy. None when a
    segment is only part of its tensor (a chunk of a large tensor: allocate that one whole).
    """
    if any(seg.start or seg.numel != specs[seg.tensor].numel for seg in bucket.segments):
        return None
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    return {
        seg.tensor: flat[seg.offset : seg.offset + seg.numel].view(specs[seg.tensor].shape)
        for seg in bucket.segments
    }


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's segments of ``tensors`` into the flat buffer ``out``."""
    parts = [
        tensors[seg.tensor].reshape(-1)[seg.start : seg.start + seg.numel]
        for seg in bucket.segments
    ]
    if all(p.device == out.device for p in parts):
        # One kernel call for the whole bucket: per-tensor copy_ calls cost more than the
        # copying itself for the many small tensors (biases, norms) a bucket gathers.
        torch.cat(parts, out=out)
        return
    for seg, part in zip(bucket.segments, parts, strict=True):
        out[seg.offset : seg.offset + seg.numel].copy_(part, non_blocking=True)


def unpack(bucket: Bucket, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the flat buffer ``buf`` into the bucket's segments of ``tensors`` (in place)."""
    parts = buf.split([seg.numel for seg in bucket.segments])
    views = [segment_view(tensors[seg.tensor], seg) for seg in bucket.segments]
    if all(v is not None and v.device == buf.device for v in views):
        torch._foreach_copy_([v for v in views if v is not None], list(parts))
        return
    for seg, part, dest in zip(bucket.segments, parts, views, strict=True):
        if dest is not None:
            dest.copy_(part, non_blocking=True)
            continue
        # Non-contiguous destination: write through a flat copy of the whole tensor.
        whole = tensors[seg.tensor]
        flat = whole.reshape(-1).clone()
        flat[seg.start : seg.start + seg.numel] = part.to(flat.device)
        whole.copy_(flat.view(whole.shape))


class BufferPool:
    """Reuses flat bucket buffers: fresh host allocations page-fault on first touch."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat buffer of ``numel`` elements, reusing a returned one when one is big enough."""
        free = self._free.setdefault(dtype, [])
        for i, buf in enumerate(free):
            if buf.numel() >= numel:
                return free.pop(i)[:numel]
        # Exact size: a dtype with only a few small tensors must not cost a whole bucket.
        return torch.empty(numel, dtype=dtype, device=self._device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` for reuse."""
        base = buf._base if buf._base is not None else buf
        self._free.setdefault(buf.dtype, []).append(base)
