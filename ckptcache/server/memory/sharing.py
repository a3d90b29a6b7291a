"""Generations that share memory: pages of an older generation equal to a newer one's are
given back to the system and read from the newer one's segment.

Under LoRA fine-tuning most of a checkpoint (the frozen base) is the same in every save, and a
daemon keeping two generations of a path (or the checkpoints of several steps) held it once
per generation. The sharer (:mod:`ckptcache.server.memory.sharer`) compares an older
generation's pages with a newer one's; where they are equal, the older segment's pages are
punched (``MADV_REMOVE``: a hole in its tmpfs file, its memory back to the system) and
recorded as *runs*: ``[start, end)`` of this segment lies at the same offsets of the backing
segment. Rules that keep every byte:

* **Only pages inside storages are shared**, so bringing a generation whole again is checked
  against the digests it recorded at its commit: a backing page changed since (a write into a
  committed segment, a flipped bit) is found and the generation refused, never served.
* **A backing page is always resident**: a run never points at a hole. When a backing segment
  is itself hollowed, the runs of the segments it backs move to the new backing first.
* **A segment backing others is never freed**: once its generation leaves memory it stays as
  a backing only (:attr:`Segment.orphan`, counted in the budget) until its last dependent goes;
  so does one read without the lock (``readers``: the sharer's comparison, a copy back).
* **Nothing reads a hole**: every reader of a generation pins it first, and a pin makes it
  whole (:meth:`Sharing.whole`, from ``CacheState.pin_locked``; a load copies back before,
  outside the lock: ``CacheState.make_whole``). A freed segment with holes is neither handed
  out nor made a spare before they are allocated again (``Arena.take_free``, the pool).
* **A restart rebuilds the sharing**: each hollow segment's runs are written to
  ``<segments>/.shared/<name>`` before its pages are punched, and the file goes once they are
  filled again; :func:`ckptcache.server.reindex.recover` reads them back.

Every method runs under the state lock, except :meth:`Sharing.copy_whole` (its segment's
generation pinned) and :func:`allocate_holes` (a freed segment the refill holds).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ckptcache._secure_fs import ensure_private_dir
from ckptcache._units import format_bytes
from ckptcache.errors import BudgetExceeded
from ckptcache.format.digest import digest_bytes
from ckptcache.format.fastcopy import copy_runs


class Segment(Protocol):
    """What this module reads and changes of an arena's segment
    (:class:`ckptcache.server.memory.arena.Segment`, which holds these fields)."""

    name: str
    path: str
    mapping: mmap.mmap
    runs: list[Run]
    holes: list[tuple[int, int]]
    hollow: int
    orphan: bool
    readers: int
    copying: int
    #: The token of the bytes it holds (0: none a refill or a save may rely on).
    content: int

    @property
    def dependents(self) -> set[Any]:
        """The segments whose runs lie in this one."""


class Arena(Protocol):
    """What this module needs of the arena (:class:`ckptcache.server.memory.arena.Arena`)."""

    directory: str
    limit: int

    @property
    def used(self) -> int:
        """Bytes the budget counts now."""

    @property
    def segments(self) -> Mapping[str, Segment]:
        """Every segment by name."""

    def release(self, segment: Any) -> None:
        """Free a segment."""

    def shrink_free(self, needed: int) -> None:
        """Unlink free segments until ``needed`` bytes fit."""


__all__ = [
    "Run",
    "SharedRecords",
    "Sharing",
    "allocate_holes",
    "intersect",
    "storage_pages",
    "subtract",
]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE

Range = tuple[int, int]


@dataclass(frozen=True)
class Run:
    """``[start, end)`` of a hollow segment lies at the same offsets of ``backing``."""

    start: int
    end: int
    backing: Segment

    @property
    def span(self) -> Range:
        """``(start, end)``."""
        return self.start, self.end


def storage_pages(storages: Iterable[Range], stop: int) -> list[Range]:
    """The whole pages inside the storages ``(offset, nbytes)`` below ``stop``, merged."""
    out: list[Range] = []
    for offset, nbytes in sorted(storages):
        first = -(-offset // _PAGE) * _PAGE
        last = min(offset + nbytes, stop) // _PAGE * _PAGE
        if last <= first:
            continue
        if out and out[-1][1] >= first:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def intersect(a: Iterable[Range], b: Iterable[Range]) -> list[Range]:
    """The ranges in both sorted, disjoint lists."""
    out, bs = [], list(b)
    for lo, hi in a:
        for blo, bhi in bs:
            s, e = max(lo, blo), min(hi, bhi)
            if s < e:
                out.append((s, e))
    return sorted(out)


def subtract(a: Iterable[Range], b: Iterable[Range]) -> list[Range]:
    """The ranges of ``a`` outside ``b`` (sorted, disjoint lists)."""
    out = []
    cuts = sorted(b)
    for lo, hi in a:
        at = lo
        for blo, bhi in cuts:
            if bhi <= at or blo >= hi:
                continue
            if blo > at:
                out.append((at, blo))
            at = max(at, bhi)
        if at < hi:
            out.append((at, hi))
    return out


def punch(segment: Segment, ranges: Iterable[Range]) -> None:
    """Give ``ranges`` of the segment's file back to the system (a hole reads as zeros)."""
    for lo, hi in ranges:
        segment.mapping.madvise(mmap.MADV_REMOVE, lo, hi - lo)


class SharedRecords:
    """The runs of each hollow segment, in files of the daemon's own (0700 directory)."""

    def __init__(self, segments_dir: str):
        self.directory = os.path.join(segments_dir, ".shared")
        os.close(ensure_private_dir(self.directory, 0o700, "shared-pages dir"))

    def _path(self, segment: Segment) -> str:
        return os.path.join(self.directory, os.path.basename(segment.name))

    def write(self, segment: Segment, runs: list[Run]) -> None:
        """Record ``runs`` as ``segment``'s (atomically: a crash leaves the old or the new
        list; ``OSError`` where tmpfs is full, nothing changed)."""
        if not runs:
            self.drop(segment)
            return
        body = json.dumps([[r.start, r.end, r.backing.name] for r in runs]).encode()
        tmp = self._path(segment) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self._path(segment))

    def drop(self, segment: Segment) -> None:
        """Forget ``segment``'s runs (it is whole, or gone)."""
        self.drop_name(segment.name)

    def drop_name(self, name: str) -> None:
        """Forget the runs recorded under segment ``name``."""
        try:
            os.unlink(os.path.join(self.directory, os.path.basename(name)))
        except FileNotFoundError:
            pass

    def load(self) -> dict[str, list[tuple[int, int, str]] | None]:
        """Every recorded hollow segment's runs by segment name; ``None`` where the record
        is unreadable (the segment's holes are then unknown: it must not be served)."""
        out: dict[str, list[tuple[int, int, str]] | None] = {}
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):
                os.unlink(path)
                continue
            try:
                with open(path, "rb") as f:
                    runs = json.loads(f.read())
                out[name] = [(int(a), int(b), str(c)) for a, b, c in runs]
            except (OSError, ValueError, TypeError) as e:
                log.error("unreadable record of shared pages %s: %s", name, e)
                out[name] = None
        return out


def ranges_of(runs: Iterable[Run]) -> list[Range]:
    """The ranges the runs cover, sorted."""
    return sorted((r.start, r.end) for r in runs)


def _normal(runs: Iterable[Run]) -> list[Run]:
    """Runs sorted, adjacent ones of one backing merged."""
    out: list[Run] = []
    for run in sorted(runs, key=lambda r: r.start):
        if out and out[-1].backing is run.backing and out[-1].end == run.start:
            out[-1] = Run(out[-1].start, run.end, run.backing)
        else:
            out.append(run)
    return out


class Sharing:
    """The runs of the arena's hollow segments, and what a change of them does to the
    segments backing them (see the module docstring)."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.records = SharedRecords(arena.directory)

    @property
    def shared(self) -> int:
        """Bytes given back to the system because another segment holds them."""
        return sum(s.hollow for s in list(self.arena.segments.values()))  # scraped unlocked

    def share(self, x: Segment, equal: list[Range], y: Segment) -> list[Range]:
        """Back the pages ``equal`` of ``x`` by the same pages of ``y`` (which holds them
        resident), recorded at once; returns the pages of ``x`` still to give back, which
        the caller passes to :meth:`punch` (in steps, each under the lock). The caller found
        them equal, holds the only pin of ``x``'s generation and saw that no load maps
        ``x``."""
        if intersect(equal, ranges_of(y.runs)):
            raise ValueError(f"segment {y.name} cannot back pages it does not hold")
        fresh = subtract(equal, ranges_of(x.runs))
        # The segments x backs: their runs over these pages move to y before x loses them.
        for d in list(x.dependents):
            runs: list[Run] = []
            for r in d.runs:
                if r.backing is not x:
                    runs.append(r)
                    continue
                runs += [Run(s, e, y) for s, e in intersect([(r.start, r.end)], equal)]
                runs += [Run(s, e, x) for s, e in subtract([(r.start, r.end)], equal)]
            self._set_runs(d, runs)
        kept = [
            Run(s, e, r.backing) for r in x.runs for s, e in subtract([(r.start, r.end)], equal)
        ]
        self._set_runs(x, kept + [Run(s, e, y) for s, e in equal])
        # Counted as given back once punched; a record naming every page's backing comes
        # first, so a crash between the two leaves pages a restart can account for.
        x.hollow = sum(r.end - r.start for r in x.runs) - sum(e - s for s, e in fresh)
        return fresh

    @staticmethod
    def punch(x: Segment, ranges: list[Range]) -> None:
        """Give ``ranges`` (backed by :meth:`share`) of ``x`` back to the system."""
        punch(x, ranges)
        x.hollow += sum(e - s for s, e in ranges)

    def whole(self, x: Segment, storages: list[Range], digests: list[int], what: str) -> str:
        """Make ``x`` whole again, all under the lock: :meth:`begin_whole`,
        :meth:`copy_whole`, :meth:`end_whole`."""
        runs = self.begin_whole(x, what)
        changed: str | None = None
        try:
            changed = self.copy_whole(x, runs, storages, digests, what)
        finally:
            self.end_whole(x, runs, changed)
        return changed

    def begin_whole(self, x: Segment, what: str) -> list[Run]:
        """Count ``x``'s runs as memory in use from now (before their pages are allocated,
        so the budget holds meanwhile) and hold their backings; returns the runs.
        :class:`BudgetExceeded` where there is no room (``x`` stays as it was)."""
        arena = self.arena
        arena.shrink_free(x.hollow)  # spares and freed segments go first
        if arena.used + x.hollow > arena.limit:
            raise BudgetExceeded(
                f"no room to make {what} whole again ({format_bytes(x.hollow)} of it lies in "
                f"a newer save's memory): {format_bytes(arena.used)} of "
                f"{format_bytes(arena.limit)} in use"
            )
        runs = list(x.runs)
        self.hold(r.backing for r in runs)
        x.hollow = 0
        x.copying += 1
        return runs

    def copy_whole(
        self, x: Segment, runs: list[Run], storages: list[Range], digests: list[int], what: str
    ) -> str:
        """Copy ``runs``' bytes back from their backings into ``x`` (their pages allocated
        first) and check the storages they lie in against ``digests``; returns "" or what
        changed. Needs no lock (the caller pins ``x``'s generation: the sharer punches none
        of it meanwhile). :class:`BudgetExceeded` where tmpfs has no room (the pages given
        back again by :meth:`end_whole`)."""
        try:
            _copy_back(x, runs)
        except OSError as e:
            raise BudgetExceeded(
                f"no room in {self.arena.directory} to make {what} whole again: {e.strerror}"
            ) from e
        return _changed(x, storages, digests, ranges_of(runs))

    def end_whole(self, x: Segment, runs: list[Run], changed: str | None) -> str:
        """Finish :meth:`copy_whole` (``changed``; ``None``: it failed): the runs dropped
        where the bytes are sound, else kept recorded until the caller retired the
        generation (a crash in between must not leave those bytes committed); where it
        failed, the pages given back again. Returns ``changed``."""
        x.copying -= 1
        self.let_go(r.backing for r in runs)
        if changed:  # whatever another reader did meanwhile: these bytes are in x now
            return changed
        if x.runs != runs:
            return ""  # made whole (or dropped) by another reader meanwhile
        if changed is None:
            if not x.copying:  # (another copy in flight writes these pages: they stay)
                punch(x, ranges_of(runs))
                x.hollow = sum(r.end - r.start for r in runs)
            return ""
        if not changed:
            self._set_runs(x, [])
        return changed

    def needed(self, x: Segment) -> bool:
        """Whether ``x`` must stay although its generation left: it backs others, or the
        sharer reads it now. It becomes an orphan, released when no longer needed."""
        if x.dependents or x.readers:
            x.orphan = True
            return True
        return False

    def release(self, x: Segment) -> None:
        """``x``'s generation left memory (its header says so already): its runs are
        dropped, its holes left to be allocated before it is used again."""
        if x.runs:
            holes = ranges_of(x.runs)
            self._set_runs(x, [])
            x.holes, x.hollow = holes, 0

    def hold(self, segments: Iterable[Segment]) -> None:
        """Keep ``segments`` from being freed while the sharer reads them (under the lock)."""
        for segment in segments:
            segment.readers += 1

    def let_go(self, segments: Iterable[Segment]) -> None:
        """The sharer is done reading ``segments`` (under the lock)."""
        for segment in segments:
            segment.readers -= 1
            self._maybe_release(segment)

    def forget(self, x: Segment) -> None:
        """``x`` is unlinked: its runs go (it backs no one: see :meth:`needed`)."""
        self._set_runs(x, [])
        x.hollow = 0

    def restore(self, x: Segment, runs: list[Run]) -> None:
        """Rebuild ``x``'s runs after a restart (the pages punched again: a crash may have
        come between the record and the punch, or during a fill)."""
        self._set_runs(x, runs, write=False)  # as recorded (rewriting it needs tmpfs room)
        punch(x, ranges_of(x.runs))
        x.hollow = sum(r.end - r.start for r in x.runs)

    def keep_resident(self, x: Segment, ranges: list[Range]) -> None:
        """Pages ``ranges`` of ``x`` that a stopped share left resident are backed no more:
        every run names pages given back (:meth:`share` counts them so). ``OSError`` where
        the record cannot be written (nothing changed)."""
        self._set_runs(
            x, [Run(s, e, r.backing) for r in x.runs for s, e in subtract([r.span], ranges)]
        )

    def _set_runs(self, x: Segment, runs: list[Run], *, write: bool = True) -> None:
        """Record, then adopt, ``x``'s new runs (a failed record write changes nothing)."""
        runs = _normal(runs)
        if write:
            self.records.write(x, runs)
        before = {r.backing for r in x.runs}
        after = {r.backing for r in runs}
        for b in after - before:
            b.dependents.add(x)
        x.runs = runs
        x.holes = ranges_of(runs)
        for b in before - after:
            b.dependents.discard(x)
            self._maybe_release(b)

    def _maybe_release(self, b: Segment) -> None:
        if b.orphan and not b.dependents and not b.readers:
            b.orphan = False
            b.content = 0  # its check as a freed segment came and went: nothing refills it
            self.arena.release(b)


def _copy_back(x: Segment, runs: list[Run]) -> None:
    fd = os.open(x.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for run in runs:
            os.posix_fallocate(fd, run.start, run.end - run.start)
    finally:
        os.close(fd)
    dst = ctypes.c_char.from_buffer(x.mapping)
    sources = {id(r.backing): ctypes.c_char.from_buffer(r.backing.mapping) for r in runs}
    try:
        at = ctypes.addressof(dst)
        copy_runs([
            (at + r.start, ctypes.addressof(sources[id(r.backing)]) + r.start, r.end - r.start)
            for r in runs
        ])  # fmt: skip
    finally:
        del dst, sources


def allocate_holes(segment: Segment) -> None:
    """Allocate the pages of a freed segment's holes again (outside the lock, before the
    daemon copies into it): ``OSError`` where tmpfs is full."""
    fd = os.open(segment.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for lo, hi in segment.holes:
            os.posix_fallocate(fd, lo, hi - lo)
    finally:
        os.close(fd)
    segment.holes = []


def _changed(x: Segment, storages: list[Range], digests: list[int], ranges: list[Range]) -> str:
    view = memoryview(x.mapping)
    try:
        for (offset, nbytes), digest in zip(storages, digests, strict=True):
            if intersect([(offset, offset + nbytes)], ranges) and digest != digest_bytes(
                view[offset : offset + nbytes]
            ):
                return f"the storage at offset {offset} differs from its digest"
    finally:
        del view
    return ""
