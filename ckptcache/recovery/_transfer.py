"""Moving a flat tensor list from one rank to the rest of a group, bucket by bucket.

Pipeline per bucket: take buffer -> (source) pack -> broadcast (async) -> wait -> (receiver)
unpack -> give buffer back. ``depth`` broadcasts are in flight at once so that packing the next
bucket overlaps sending the current one; the memory held is ``depth`` buckets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from ckptcache.recovery._buckets import Bucket, BufferPool, direct_view, pack, unpack

__all__ = ["Role", "broadcast_buckets"]

#: What a rank does in a transfer: send its tensors, receive into its tensors, or only relay.
Role = Literal["source", "receiver", "bystander"]


@dataclass
class _InFlight:
    work: Any
    bucket: Bucket
    buf: torch.Tensor
    direct: bool


def broadcast_buckets(
    buckets: Sequence[Bucket],
    tensors: Sequence[torch.Tensor] | None,
    *,
    role: Role,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    pool: BufferPool,
    depth: int = 2,
) -> int:
    """Broadcast ``buckets`` of ``tensors`` from global rank ``src``; return the bytes moved.

    The source passes its tensors, receivers the tensors to overwrite (in place), bystanders
    (group members that neither send nor need the state) pass None and receive into scratch.
    Every rank of ``group`` must call this with the same buckets.
    """
    pending: deque[_InFlight] = deque()
    moved = 0
    for bucket in buckets:
        buf, direct = _buffer(bucket, tensors, device, pool)
        if role == "source" and not direct:
            assert tensors is not None
            pack(bucket, tensors, buf)
        work = dist.broadcast(buf, src=src, group=group, async_op=True)
        pending.append(_InFlight(work, bucket, buf, direct))
        moved += buf.numel() * buf.element_size()
        while len(pending) >= max(1, depth):
            _finish(pending.popleft(), role, tensors, pool)
    while pending:
        _finish(pending.popleft(), role, tensors, pool)
    if device.type == "cuda":
        # Unpacks into host tensors (Adam's CPU step counters) were queued asynchronously.
        torch.cuda.current_stream(device).synchronize()
    return moved


def _buffer(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor] | None,
    device: torch.device,
    pool: BufferPool,
) -> tuple[torch.Tensor, bool]:
    if tensors is not None and len(bucket.segments) == 1:
        view = direct_view(bucket, tensors[bucket.segments[0].tensor], device)
        if view is not None:
            return view, True
    return pool.take(bucket.dtype, bucket.numel), False


def _finish(
    item: _InFlight,
    role: Role,
    tensors: Sequence[torch.Tensor] | None,
    pool: BufferPool,
) -> None:
    item.work.wait()
    if item.direct:
        return
    if role == "receiver":
        assert tensors is not None
        unpack(item.bucket, item.buf, tensors)
    pool.give(item.buf)
