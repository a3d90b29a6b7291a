"""A deterministic, optionally slow loader used by the batch-cache tests and workers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from tests.helpers import wait_until


def make_batch(epoch: int, index: int, numel: int = 256) -> dict[str, Any]:
    """Batch ``index`` of ``epoch``: a dict of tensors and plain values, seeded by position."""
    g = torch.Generator().manual_seed(epoch * 100_003 + index)
    return {
        "x": torch.randn(numel, generator=g),
        "y": torch.randint(0, 10, (4,), generator=g),
        "meta": [epoch, index, "text"],
    }


def batch_digest(batch: dict[str, Any]) -> str:
    """A digest of every value of a batch (what "the same batch" means in these tests)."""
    h = xxhash.xxh3_64()
    h.update(batch["x"].contiguous().numpy().tobytes())
    h.update(batch["y"].contiguous().numpy().tobytes())
    h.update(repr(batch["meta"]).encode())
    return h.hexdigest()


class SeqLoader:
    """``n`` batches per epoch; shuffles nothing but depends on the epoch via ``set_epoch``.

    ``open_delay`` and ``item_delay`` simulate a remote dataset; ``gate`` makes creation block
    until that file exists (proof that a consumer was served without the real loader);
    ``fail_at`` makes iteration raise ``OSError`` instead of yielding that batch.
    """

    def __init__(
        self,
        n: int,
        numel: int = 256,
        *,
        open_delay: float = 0.0,
        item_delay: float = 0.0,
        gate: str | None = None,
        with_skip: bool = False,
        fail_at: int | None = None,
    ):
        if gate is not None:
            wait_until(lambda: os.path.exists(gate), 30, f"gate {gate} to open")
        time.sleep(open_delay)  # the simulated cost of opening the data set
        self.n, self.numel, self.item_delay, self.fail_at = n, numel, item_delay, fail_at
        self.epoch = 0
        self.start = 0
        self.produced: list[tuple[int, int]] = []
        if with_skip:
            self.skip = self._skip

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _skip(self, n: int) -> None:
        self.start = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start, self.start = self.start, 0
        for i in range(start, self.n):
            time.sleep(self.item_delay)
            if i == self.fail_at:
                raise OSError(f"transient storage error at batch {i}")
            self.produced.append((self.epoch, i))
            yield make_batch(self.epoch, i, self.numel)
