"""Positions in the batch stream and the file names they map to.

A position is ``(epoch, step)``: ``step`` counts batches from the start of ``epoch``. Epoch
lengths are learnt only when the real loader runs out, so distances across an epoch boundary
need the length of the earlier epoch (``ends``); without it a later epoch is "far away".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Pos", "batch_name", "distance", "end_name", "parse_batch_name", "parse_end_name"]

_BATCH = re.compile(r"^e(\d{6})-s(\d{12})\.batch$")
_END = re.compile(r"^e(\d{6})\.end$")

#: Returned by :func:`distance` when the gap cannot be known yet (treated as too far).
FAR = 1 << 62


@dataclass(frozen=True, order=True)
class Pos:
    """A position in the stream; orders by epoch, then step."""

    epoch: int
    step: int

    def next(self, ends: Mapping[int, int]) -> Pos:
        """The position after this one, rolling into the next epoch at a known end."""
        if ends.get(self.epoch) == self.step + 1:
            return Pos(self.epoch + 1, 0)
        return Pos(self.epoch, self.step + 1)

    def normalized(self, ends: Mapping[int, int]) -> Pos:
        """Map "just past the end of an epoch" to the start of the next one."""
        end = ends.get(self.epoch)
        if end is not None and self.step >= end:
            return Pos(self.epoch + 1, 0)
        return self


def distance(a: Pos, b: Pos, ends: Mapping[int, int]) -> int:
    """Batches from ``a`` forward to ``b`` (negative if ``b`` is behind, FAR if unknowable)."""
    if a.epoch == b.epoch:
        return b.step - a.step
    if b < a:
        return -distance(b, a, ends)
    total = 0
    epoch, step = a.epoch, a.step
    while epoch < b.epoch:
        end = ends.get(epoch)
        if end is None:
            return FAR
        total += end - step
        epoch, step = epoch + 1, 0
    return total + b.step


def batch_name(pos: Pos) -> str:
    """File name of the cached batch at ``pos``."""
    return f"e{pos.epoch:06d}-s{pos.step:012d}.batch"


def parse_batch_name(name: str) -> Pos | None:
    """Inverse of :func:`batch_name`; ``None`` for any other file."""
    m = _BATCH.match(name)
    return Pos(int(m.group(1)), int(m.group(2))) if m else None


def end_name(epoch: int) -> str:
    """File name of the marker recording how many batches ``epoch`` has."""
    return f"e{epoch:06d}.end"


def parse_end_name(name: str) -> int | None:
    """Inverse of :func:`end_name`."""
    m = _END.match(name)
    return int(m.group(1)) if m else None
