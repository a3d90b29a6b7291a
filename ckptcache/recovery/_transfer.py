"""Moving a flat tensor list from one rank to the rest of a group, bucket by bucket.

Pipeline per bucket: take buffer (or view the tensors in place) -> (source) pack -> broadcast
(async) -> (source) hash it while it is on the wire -> wait -> (receiver) hash it while the
next bucket is on the wire -> unpack if it was not received in place -> give buffer back.
``depth`` broadcasts are in flight at once so that packing and hashing overlap the wire; the
memory held is ``depth`` buckets.

A local failure on one rank (a buffer it cannot allocate, a pack, hash or unpack that raises)
must not leave the others blocked in a broadcast until the process group times out: the rank
records the error and keeps relaying the remaining buckets through scratch buffers, so every
rank issues the same collectives; the caller then shares the error and the group falls back
together. Errors of the broadcasts themselves (a peer gone) still raise: the group is broken.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ckptcache.recovery._buckets import Bucket, BufferPool, flat_view, pack, unpack
from ckptcache.recovery._digests import DigestMode, buffer_word, fold_words

__all__ = ["Role", "Transfer", "broadcast_buckets"]

#: What a rank does in a transfer: send its tensors, receive into its tensors, or only relay.
Role = Literal["source", "receiver", "bystander"]


@dataclass
class Transfer:
    """What one rank moved: bytes, and the digest of the buckets it hashed (None when off).

    The source hashes what it sends, a receiver what it received, and a bystander its own
    tensors (the ``own`` argument), so comparing the digests checks every rank against the
    source's bytes.
    """

    nbytes: int = 0
    digest: int | None = None
    words: list[int] = field(default_factory=list)
    #: This rank's local failure (its result is unusable); None when it went through.
    error: str | None = None

    def fail(self, e: Exception) -> None:
        """Record the first local failure; the rest of the transfer only relays."""
        if self.error is None:
            self.error = f"{type(e).__name__}: {e}"


@dataclass
class _InFlight:
    index: int
    work: Any
    bucket: Bucket
    buf: torch.Tensor
    in_place: bool


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
    digest: DigestMode | None = None,
    own: Sequence[torch.Tensor] | None = None,
) -> Transfer:
    """Broadcast ``buckets`` of ``tensors`` from global rank ``src``.

    The source passes its tensors, receivers the tensors to overwrite (in place), bystanders
    (group members that neither send nor need the state) pass None and receive into scratch;
    with ``digest``, a bystander hashes ``own`` (its own copy of the state) bucket by bucket.
    Every rank of ``group`` must call this with the same buckets.
    """
    pending: deque[_InFlight] = deque()
    out = Transfer(words=[0] * len(buckets) if digest is not None else [])
    for index, bucket in enumerate(buckets):
        buf, in_place = _prepare(bucket, tensors, role, device, pool, out)
        work = dist.broadcast(buf, src=src, group=group, async_op=True)
        pending.append(_InFlight(index, work, bucket, buf, in_place))
        out.nbytes += buf.numel() * buf.element_size()
        if digest is not None and out.error is None:
            try:
                if role == "source":
                    out.words[index] = buffer_word(buf, digest)  # reads while the wire reads
                elif role == "bystander" and own is not None:
                    out.words[index] = _own_word(bucket, own, device, pool, digest)
            except Exception as e:
                out.fail(e)
        while len(pending) >= max(1, depth):
            _finish(pending.popleft(), role, tensors, pool, digest, out)
    while pending:
        _finish(pending.popleft(), role, tensors, pool, digest, out)
    if device.type == "cuda":
        # Unpacks into host tensors (Adam's CPU step counters) were queued asynchronously.
        torch.cuda.current_stream(device).synchronize()
    if digest is not None and out.error is None:
        out.digest = fold_words(out.words)
    return out


def _prepare(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor] | None,
    role: Role,
    device: torch.device,
    pool: BufferPool,
    out: Transfer,
) -> tuple[torch.Tensor, bool]:
    """The buffer to broadcast ``bucket`` through (packed on the source); after a local
    failure, a scratch buffer whose bytes nobody uses."""
    if out.error is None:
        buf: torch.Tensor | None = None
        try:
            buf, in_place = _buffer(bucket, tensors, device, pool)
            if role == "source" and not in_place:
                assert tensors is not None
                pack(bucket, tensors, buf)
            return buf, in_place
        except Exception as e:
            out.fail(e)
            if buf is not None:  # taken, then the pack failed: it still serves as scratch
                return buf, in_place
    return pool.take(bucket.dtype, bucket.numel), False


def _buffer(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor] | None,
    device: torch.device,
    pool: BufferPool,
) -> tuple[torch.Tensor, bool]:
    if tensors is not None:
        view = flat_view(bucket, tensors, device)
        if view is not None:
            return view, True
    return pool.take(bucket.dtype, bucket.numel), False


def _own_word(
    bucket: Bucket,
    own: Sequence[torch.Tensor],
    device: torch.device,
    pool: BufferPool,
    digest: DigestMode,
) -> int:
    view = flat_view(bucket, own, device)
    if view is not None:
        return buffer_word(view, digest)
    buf = pool.take(bucket.dtype, bucket.numel)
    try:
        pack(bucket, own, buf)
        return buffer_word(buf, digest)
    finally:
        pool.give(buf)


def _finish(
    item: _InFlight,
    role: Role,
    tensors: Sequence[torch.Tensor] | None,
    pool: BufferPool,
    digest: DigestMode | None,
    out: Transfer,
) -> None:
    item.work.wait()
    if role == "receiver" and out.error is None:
        try:
            if digest is not None:
                # The next bucket is already on the wire: hashing this one overlaps it.
                out.words[item.index] = buffer_word(item.buf, digest)
            if not item.in_place:
                assert tensors is not None
                unpack(item.bucket, item.buf, tensors)
        except Exception as e:
            out.fail(e)
    if not item.in_place:
        pool.give(item.buf)
