"""How a multipart upload that copies ranges of the object it replaces is cut into parts.

S3's rules: every part but the last holds at least :data:`MIN_PART` bytes and at most
:data:`MAX_PART`, and an upload has at most :data:`MAX_PARTS` parts. A range copied from the
previous object (``UploadPartCopy``) is whole parts of its own, so the bytes uploaded before
it, and between two copied ranges, are parts too and must reach :data:`MIN_PART`: a copied
range that starts sooner after the last one is shortened at its start (its first bytes are
uploaded), and one left shorter than a part is not copied at all. Torch-free and pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["MAX_PART", "MAX_PARTS", "MIN_PART", "copy_pieces", "parts_needed", "place_copies"]

MIN_PART = 5 << 20
MAX_PART = 5 << 30
MAX_PARTS = 10_000


def place_copies(
    runs: Sequence[tuple[int, int]], *, size: int, part_size: int
) -> list[tuple[int, int]]:
    """The ranges of the new object to copy, from ``runs``: sorted, disjoint ``[start, end)``
    ranges that the previous object holds with the same bytes at the same offsets. Each kept
    range lies in one run, holds at least :data:`MIN_PART` bytes and starts at least
    :data:`MIN_PART` bytes after the end of the one before (or after the object's start);
    the object's last byte (``size``) is never copied, so the upload ends with an uploaded
    part. Empty when the upload would need more than :data:`MAX_PARTS` parts."""
    kept: list[tuple[int, int]] = []
    uploaded_from = 0
    for start, end in runs:
        start = max(start, uploaded_from + MIN_PART)
        end = min(end, size - 1)
        if end - start < MIN_PART:
            continue
        kept.append((start, end))
        uploaded_from = end
    if parts_needed(kept, size=size, part_size=part_size) > MAX_PARTS:
        return []
    return kept


def copy_pieces(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` as parts of at most :data:`MAX_PART` bytes, of equal size (each at
    least :data:`MIN_PART`, since the range is)."""
    count = -(-(end - start) // MAX_PART)
    bounds = [start + (end - start) * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


def parts_needed(copies: Sequence[tuple[int, int]], *, size: int, part_size: int) -> int:
    """Parts of an upload of ``size`` bytes copying ``copies``, uploaded runs cut every
    ``part_size`` bytes (at least one part per run)."""
    count, at = 0, 0
    for start, end in [*copies, (size, size)]:
        if start > at:
            count += max(1, (start - at) // part_size)
        if end > start:
            count += len(copy_pieces(start, end))
        at = end
    return count
