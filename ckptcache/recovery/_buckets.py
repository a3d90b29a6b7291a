"""Bucket plans: many tensors per collective, and no collective larger than the bucket size.

Every rank derives the same plan from the same tensor specs, so only the specs travel.
Tensors smaller than the bucket are packed back to back into buckets of one dtype; a larger
tensor is cut into bucket-sized chunks, each its own bucket. A bucket made of a single segment
is sent straight from (and received straight into) the tensor when its memory allows, so large
tensors cost no extra copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptcache.recovery._state import TensorSpec

__all__ = ["Bucket", "BufferPool", "Segment", "pack", "plan_buckets", "segment_view", "unpack"]

#: Default bucket size: large enough to run at link bandwidth, small enough to pipeline.
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


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
    specs: Sequence[TensorSpec], bucket_bytes: int, *, include: Sequence[int] | None = None
) -> tuple[Bucket, ...]:
    """Lay the tensors ``include`` (default: all) of ``specs`` out in buckets, grouped by dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    indices = range(len(specs)) if include is None else include
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in indices:
        if specs[i].numel:
            by_dtype.setdefault(specs[i].dtype, []).append(i)
    buckets: list[Bucket] = []
    for dtype, members in by_dtype.items():
        capacity = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        open_segments: list[Segment] = []
        used = 0
        for i in members:
            n = specs[i].numel
            if n >= capacity:
                # Whole chunks of one tensor: aligned to its start so each can go zero-copy.
                for start in range(0, n, capacity):
                    size = min(capacity, n - start)
                    buckets.append(Bucket(dtype, size, (Segment(i, start, size, 0),)))
                continue
            if used + n > capacity:
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


def direct_view(bucket: Bucket, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A view to send/receive a single-segment bucket in place, or None if a copy is needed."""
    if len(bucket.segments) != 1 or t.device != device or t.dtype != bucket.dtype:
        return None
    return segment_view(t, bucket.segments[0])


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
    """Reuses flat bucket buffers: fresh host allocations page-fault on first touch (~10x)."""

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
