"""A freed segment made to hold its path's newest save, so that the next save into it copies
only what changed since that save (``ckptcache/client/_unchanged.py``).

A save skips the storages the kernel proves unwritten since the save whose bytes its segment
holds. The daemon keeps two generations of a path, so the segment a save is handed held the
save three before it, and the save copied all that changed over three intervals: every
expert of a mixture-of-experts model touched in any of them. Once saves pause, the digester
copies the path's newest generation (for a checkpoint saved under a new path each step, the
newest save of the same layout) into such a freed segment (its payload, at the same
offsets, less the storages the segment holds already: a frozen base is not copied again),
hashes every storage of the copy, and only where they equal that generation's digests gives the
segment that generation's content token. The client that made the newest save then finds its
own record of that save under the token, and copies only what changed since.

The copy is background work: a chunk at a time, paused while a save is in flight, and given
up the moment anything needs the segment (:class:`~ckptcache.server.memory.arena.Fill`).
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

from ckptcache.format.fastcopy import copy_runs

if TYPE_CHECKING:
    from ckptcache.server.memory.arena import Fill, Segment
    from ckptcache.server.memory.index import Generation
    from ckptcache.server.quiet import SavesInFlight
    from ckptcache.server.state import CacheState

__all__ = ["CHUNK", "copy_ranges", "differing", "merged", "source_for", "within_payload"]

#: Bytes copied between two looks at whether to stop: what a reservation that needs the
#: segment may wait for (a few milliseconds).
CHUNK = 16 << 20
#: How often a copy paused for a save looks again.
_PAUSE = 0.002


def source_for(state: CacheState, left: Generation) -> Generation | None:
    """The generation whose bytes the segment ``left`` leaves should take (call under the
    state lock): the newest of the same path; else, for a checkpoint saved under a new path
    each time (as the frameworks name theirs by step), the newest save committed after
    ``left`` whose storages lie at the same offsets with the same sizes. Either must be in
    another segment of the same owner, made by a client that skips unchanged storages (its
    segment has a content token), not found corrupt, its payload fitting. ``None`` when
    there is none."""
    newest = state.index.newest(left.key)
    if newest is not None and _fits(newest, left):
        return newest
    layout = None
    best: Generation | None = None
    for gen in state.index:
        after = best.committed if best is not None else left.committed
        if gen.committed <= after or len(gen.manifest.storages) != len(left.manifest.storages):
            continue
        if not _fits(gen, left):
            continue
        layout = layout if layout is not None else _layout(left)
        if _layout(gen) == layout:
            best = gen
    return best


def _fits(gen: Generation, left: Generation) -> bool:
    segment, source = left.segment, gen.segment
    if gen is left or gen.corrupt or gen.removed or source is segment:
        return False
    if not source.content or source.owner != segment.owner:
        return False
    header = source.read_header()
    return header.payload_offset + header.payload_size <= segment.capacity


def _layout(gen: Generation) -> list[tuple[int, int]]:
    return [(r.offset, r.nbytes) for r in gen.manifest.storages]


def differing(
    left: Generation, had: list[int], source: Generation, has: list[int]
) -> list[tuple[int, int]]:
    """The ranges of ``source``'s payload to copy over the bytes ``left`` left in its segment
    (``had``, ``has``: the two generations' digests): all of it but the storages ``left``
    held at the same offset, of the same size and digest: the hash of every storage after the
    copy checks those as it checks the rest."""
    header = source.segment.read_header()
    start, end = header.payload_offset, header.payload_offset + header.payload_size
    before = {(r.offset, r.nbytes): d for r, d in zip(left.manifest.storages, had, strict=True)}
    ranges, at = [], start
    for record, digest in sorted(
        zip(source.manifest.storages, has, strict=True), key=lambda pair: pair[0].offset
    ):
        if before.get((record.offset, record.nbytes)) != digest or record.offset < at:
            continue
        if record.offset > at:
            ranges.append((at, record.offset))
        at = record.offset + record.nbytes
    if at < end:
        ranges.append((at, end))
    return ranges


def within_payload(source: Generation, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside ``source``'s payload (nothing past it is read)."""
    header = source.segment.read_header()
    lo, hi = header.payload_offset, header.payload_offset + header.payload_size
    return [(max(a, lo), min(b, hi)) for a, b in ranges if max(a, lo) < min(b, hi)]


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, overlapping and adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def copy_ranges(
    source: Segment, segment: Segment, ranges: list[tuple[int, int]], fill: Fill,
    saves: SavesInFlight,
) -> bool:  # fmt: skip
    """Copy ``ranges`` of ``source`` into ``segment`` at the same offsets, a :data:`CHUNK`
    at a time (the interpreter lock released), waiting while a save is in flight; ``False``
    when ``fill`` was stopped first. The caller pins ``source`` and marks ``segment`` filled."""
    src = ctypes.c_char.from_buffer(source.mapping)
    dst = ctypes.c_char.from_buffer(segment.mapping)
    try:
        src_at, dst_at = ctypes.addressof(src), ctypes.addressof(dst)
        for first, last in ranges:
            for at in range(first, last, CHUNK):
                while saves.open and not fill.stopped:  # never beside a save's copy
                    time.sleep(_PAUSE)
                if fill.stopped:
                    return False
                copy_runs([(dst_at + at, src_at + at, min(CHUNK, last - at))])
    finally:
        del src, dst
    return True
