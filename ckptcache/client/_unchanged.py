"""A save that copies only what changed: storages whose bytes provably lie in the segment
already are not copied again.

The proof has two halves, and a storage is skipped only where both hold:

1. **The segment still holds what this client wrote.** At each commit the daemon gives the
   client a token naming the bytes the commit left in the segment, and forgets it the moment
   the segment is handed out again or cut (``Segment.content``). A reservation reports the
   token of the segment it hands out; only where it is one this client was given does the
   client trust its record of what the segment holds: which storage (address and size) lies
   at which offset, as of which save. A freed segment may hold a later save's bytes under
   that save's token: the daemon copies a path's newest save into it while it is free, and
   hands the token out only once the copy hashed to that save's digests
   (``ckptcache/server/memory/refill.py``).
2. **The storage's memory was not written since that save.** Every watched storage's pages
   are write-protected through the kernel (:mod:`ckptcache.client._watch`), and every save
   scans them before it copies: a scan that reports a written page (or cannot vouch for one:
   not in memory, a file's, a registration lost) marks every watched range it touches as
   written at this save. A storage whose last mark is no later than the save whose bytes the
   segment holds is unchanged since: its bytes at the same offset are its bytes now.

Only the page-aligned interior of a storage of at least :data:`MIN_BYTES` is watched; its
partial first and last pages (shared with whatever lies beside it) are compared with the
segment's bytes instead, and a storage whose edges differ is copied whole, so a skipped storage
is byte for byte the segment's, and the daemon can check it against the digest it found there
(``CommitRequest.kept``). Storages whose interiors overlap within one save are copied. A
storage found written at :data:`VOLATILE` saves running stops being watched (every write to
it would take a protection fault) and is tried again :data:`REST` saves later.

What no page table sees, and so what turns skipping off:

* **Memory pinned for a device or the kernel** (``VmPin`` in ``/proc/self/status``: io_uring
  fixed buffers, RDMA memory regions): their writes go through the pin, not the process's
  page tables. A pin taken after a scan is itself a write (the kernel faults the pages
  writable to pin them), seen by the next scan; one held at a scan may write after it
  unseen. So a save that finds memory pinned once its scans are done skips nothing, nor
  does the save after it.
  A process in which CUDA is initialized skips nothing either: a device may write pinned
  host memory by DMA, and CUDA's registrations are not counted there.
* **A second watcher in the process.** A scan protects again every written page it reports,
  whichever watch registered it (the kernel checks only that some asynchronous watch does),
  so two watches would each take the other's writes. One client per process watches
  (:func:`_claim`); the others copy every storage.
* **A child** made by ``fork()`` without Python's fork handlers (a C library's): its
  descriptors still name the parent's memory, so it forgets the parent's watch at its first
  save (:meth:`Unchanged.begin` compares the process id).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ckptcache.client._watch import PAGE, WriteWatch, edges_equal, interior

if TYPE_CHECKING:
    import mmap
    from collections.abc import Iterable

__all__ = ["MIN_BYTES", "Pass", "Unchanged"]

log = logging.getLogger(__name__)

#: The smallest storage interior watched: below it the copy costs about what the scan does.
MIN_BYTES = 1 << 20
#: At most this many ranges are watched (each registration may split a mapping of the
#: process, whose count the kernel bounds).
MAX_WATCHED = 4096
#: Saves running a storage may be found written before it stops being watched.
VOLATILE = 3
#: Saves after which a storage no longer watched is tried again.
REST = 16

_Key = tuple[int, int]  # a storage's address and size


@dataclass
class _Watched:
    """One watched storage: its page-aligned interior and what the scans said of it."""

    start: int
    end: int
    #: The save whose scan last found it written (or began watching it).
    written: int
    #: Saves running it was found written.
    streak: int = 0
    #: The last save it was part of.
    seen: int = 0


@dataclass
class _Held:
    """What one segment holds as of a commit of this client: its token, the save, and the
    offset of each watched storage (address and size) in it."""

    token: int
    save: int
    offsets: dict[_Key, int] = field(default_factory=dict)


class Unchanged:
    """One client's record of its saves' storages and segments (see the module docstring).

    Saves of one client run one at a time (under its connection's lock); the lock here only
    guards :meth:`close` and a fork against a save."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._watch: WriteWatch | None = None
        self._opened = False
        self._watched: dict[_Key, _Watched] = {}
        self._starts: list[tuple[int, int, _Key]] = []  # (start, end, key), sorted
        self._longest = 0
        self._resting: dict[_Key, int] = {}
        self._held: dict[str, _Held] = {}
        self._save = 0
        #: The save whose pass is scanning (0: none): one left set was cut short.
        self._scanning = 0
        self._lock = threading.Lock()
        #: The process the watch was opened in (0: none opened).
        self._pid = 0
        #: Memory was pinned at the last pass's scans: writes through the pin may have
        #: followed them unseen, so the next pass trusts nothing either.
        self._pinned = False
        #: Bytes the committed saves of this client did not copy.
        self.skipped = 0

    def begin(self, segment: str, handed: int, mapping: mmap.mmap) -> Pass | None:
        """The pass of a save into ``segment`` (mapped writable as ``mapping``), whose
        reservation reported the token ``handed``; ``None`` where nothing can be skipped or
        watched (then nothing about the segment is known after the save either)."""
        if self._pid not in (0, os.getpid()):
            self.after_fork()  # forked where no fork handler ran: the watch is the parent's
        with self._lock:
            held = self._held.pop(segment, None)  # its bytes change from now on
            if not self.enabled or _cuda_initialized():
                return None
            watch = self._open()
            if watch is None:
                return None
            self._save += 1
            if held is None or held.token != handed:
                # The daemon may have copied a later save of ours into the segment while it
                # was free (``server/memory/refill.py``): that save's token, that record.
                held = next((h for h in self._held.values() if h.token == handed), None)
            return Pass(self, watch, segment, self._save, held, mapping)

    def _open(self) -> WriteWatch | None:
        if not self._opened:
            if not _claim(self):  # asked again at the next save: the other may have closed
                log.debug("another client of this process watches: every save copies")
                return None
            self._opened = True
            self._watch = WriteWatch.open()
            self._pid = os.getpid()
            if self._watch is None:
                _release(self)
                log.debug("no write protection here: every save copies every storage")
        return self._watch

    # ------------------------------------------------------------- for a pass

    def _mark(self, start: int, end: int, save: int) -> None:
        """Every watched range that meets ``[start, end)`` was (or may have been) written."""
        lo = bisect.bisect_left(self._starts, (start - self._longest,))
        for s, e, key in self._starts[lo:]:
            if s >= end:
                break
            if e > start:
                self._watched[key].written = save

    def _note(self, span: tuple[int, int] | None, start: int, end: int, save: int) -> None:
        """Mark what a scan of ``[start, end)`` found written: ``span``, the lowest start and
        highest end of its written pages (``(0, 0)``: none), ``None`` where it failed (all of
        it)."""
        if span is None:
            self._mark(start, end, save)
        elif span[1]:
            self._mark(span[0], span[1], save)

    def _index(self) -> None:
        self._starts = sorted((w.start, w.end, k) for k, w in self._watched.items())
        self._longest = max((w.end - w.start for w in self._watched.values()), default=0)

    def _scan(self, watch: WriteWatch, keys: list[_Key], save: int) -> None:
        """Scan the watched storages ``keys`` (one call), and note what each scan found."""
        ranges = [(self._watched[k].start, self._watched[k].end) for k in keys]
        for (start, end), span in zip(ranges, watch.written_many(ranges), strict=True):
            self._note(span, start, end, save)
        for key in keys:
            w = self._watched[key]
            w.streak = w.streak + 1 if w.written == save else 0
            w.seen = save

    def _watch_new(self, watch: WriteWatch, keys: list[_Key], save: int) -> set[_Key]:
        """Watch the storages ``keys`` from now on (those it may: room, not resting, private
        anonymous memory); returns the keys watched."""
        keys = [k for k in keys if self._resting.get(k, 0) <= save]
        keys = keys[: max(0, MAX_WATCHED - len(self._watched))]
        ranges = [interior(*k) for k in keys]
        watched = {k for k, ok in zip(keys, watch.watch(ranges), strict=True) if ok}
        for key, (start, end) in zip(keys, ranges, strict=True):
            if key in watched:
                self._watched[key] = _Watched(start, end, save, seen=save)
        self._index()
        # Protects every page; each was made written at this save (arming counts as a write).
        armed = [(self._watched[k].start, self._watched[k].end) for k in watched]
        for (start, end), span in zip(armed, watch.written_many(armed), strict=True):
            self._note(span, start, end, save)
        return watched

    def _retire(self, watch: WriteWatch, keys: Iterable[_Key], save: int) -> None:
        for key in keys:
            w = self._watched.pop(key)
            watch.unwatch(w.start, w.end)
            self._resting[key] = save + REST
        self._index()

    def runs(
        self, p: Pass, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`Pass.runs` of ``p``."""
        watch, save, held = p.watch, p.save, p.held
        # A pass was cut short (a signal's exception) where a scan may have protected pages
        # again before their writes were noted, or memory was pinned at the last pass's
        # scans, whose writes since no scan sees: nothing watched is trusted.
        doubt = self._scanning or self._pinned
        self._scanning = save  # until every scan of this pass is noted
        candidates = _candidates(addresses, sizes)
        # Scan first: every write since the last scan is seen.
        self._scan(watch, [k for k in candidates if k in self._watched], save)
        if doubt:
            # After the scan, so a doubt is not counted as a write found: storages doubted
            # a few saves running are not retired as often written.
            for doubted in self._watched.values():
                doubted.written = save
        unwritten = [] if held is None else [
            (key, index) for key, index in candidates.items()
            if key in self._watched and self._watched[key].written <= held.save
            and held.offsets.get(key) == int(offsets[index])
        ]  # fmt: skip
        equal = p.edges_equal([(*key, int(offsets[index])) for key, index in unwritten])
        skip = [index for (_, index), ok in zip(unwritten, equal, strict=True) if ok]
        volatile = [k for k in candidates if k in self._watched
                    and self._watched[k].streak >= VOLATILE]  # fmt: skip
        if volatile:
            self._retire(watch, volatile, save)
        if len(self._watched) >= MAX_WATCHED:  # storages long gone make room
            self._retire(watch, [k for k, w in self._watched.items() if w.seen < save - REST], 0)
        if len(self._resting) > MAX_WATCHED:
            self._resting = {k: until for k, until in self._resting.items() if until > save}
        new = [k for k in candidates if k not in self._watched]
        if new:
            self._watch_new(watch, new, save)
        for key, index in candidates.items():
            if key in self._watched:
                p.offsets[key] = int(offsets[index])
        # Once the scans have protected the pages: a pin held now may write after them
        # unseen (one taken before them was seen by them as a write).
        self._pinned = _pinned()
        if self._pinned:
            skip = []
        self._scanning = 0
        return p.without(offsets, addresses, sizes, skip)

    def record(self, p: Pass, token: int) -> None:
        """:meth:`Pass.committed` of ``p``."""
        with self._lock:
            self._held[p.segment] = _Held(token, p.save, p.offsets)
            self.skipped += p.skipped

    def close(self) -> None:
        """Stop watching (the record of what segments hold goes with it)."""
        with self._lock:
            if self._watch is not None:
                self._watch.close()
            _release(self)
            self._watch, self._opened, self._pid = None, False, 0
            self._watched.clear()
            self._held.clear()
            self._resting.clear()
            self._index()

    def after_fork(self) -> None:
        """In a forked child: nothing watched (the registrations stayed with the parent; the
        descriptors closed here are the child's copies)."""
        self._lock = threading.Lock()
        self.close()


class Pass:
    """One save's use of :class:`Unchanged`: which runs it copies, and what its commit
    leaves known."""

    def __init__(self, owner: Unchanged, watch: WriteWatch, segment: str, save: int,
                 held: _Held | None, mapping: mmap.mmap):  # fmt: skip
        self.owner, self.watch, self.segment, self.save, self.held = (
            owner, watch, segment, save, held
        )  # fmt: skip
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) if held else 0
        self.size = len(mapping)
        #: Where each watched storage of the save lies in the segment.
        self.offsets: dict[_Key, int] = {}
        #: Bytes this save did not copy, and the offsets of the storages they belong to.
        self.skipped = 0
        self.kept: list[int] = []

    def runs(
        self, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The copy's runs (``int64`` offsets in the segment, ``uint64`` addresses, ``int64``
        sizes, one per CPU storage) less the storages the segment holds already; watches the
        storages it may skip at later saves."""
        return self.owner.runs(self, offsets, addresses, sizes)

    def edges_equal(self, storages: list[tuple[int, int, int]]) -> list[bool]:
        """For each ``(address, nbytes, offset)``: whether the storage's partial first and last
        pages (never watched) hold what the segment holds there at ``offset``; then the whole
        storage is the segment's bytes, and the digest the daemon checked the segment with is
        its digest."""
        inside = [offset >= 0 and offset + nbytes <= self.size for _, nbytes, offset in storages]
        rows = [
            (self.base + offset, address, nbytes)
            for (address, nbytes, offset), ok in zip(storages, inside, strict=True)
            if ok
        ]
        equal = iter(edges_equal(rows))
        return [ok and next(equal) for ok in inside]

    def without(
        self, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray, skip: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs less those at the indices ``skip`` (counted as skipped)."""
        if not skip:
            return offsets, addresses, sizes
        keep = np.ones(len(sizes), dtype=bool)
        keep[skip] = False
        self.skipped += int(sizes[skip].sum())
        self.kept.extend(int(offsets[i]) for i in skip)
        return offsets[keep], addresses[keep], sizes[keep]

    @property
    def watched(self) -> bool:
        """Whether the segment will hold storages this client watches."""
        return bool(self.offsets)

    def committed(self, token: int) -> None:
        """The save is committed, and the daemon named its bytes ``token``: what the segment
        now holds is known (nothing where the daemon gave no token: it was not asked to)."""
        if token:
            self.owner.record(self, token)


def _candidates(addresses: np.ndarray, sizes: np.ndarray) -> dict[_Key, int]:
    """The storages worth watching, by key, with their index; none whose interior overlaps
    another's."""
    found: dict[_Key, int] = {}
    spans: list[tuple[int, int, _Key]] = []
    for index in np.flatnonzero(sizes >= MIN_BYTES + 2 * PAGE).tolist():
        key = (int(addresses[index]), int(sizes[index]))
        start, end = interior(*key)
        if key in found:  # one storage twice: its second copy goes whole
            found.pop(key)
            continue
        found[key] = index
        spans.append((start, end, key))
    spans.sort()
    for (_, end, key), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            found.pop(key, None)
            found.pop(other, None)
    return found


class _Watcher:
    """The one :class:`Unchanged` of this process that watches (see the module docstring)."""

    lock = threading.Lock()
    owner: weakref.ref[Unchanged] | None = None
    pid = 0


def _claim(unchanged: Unchanged) -> bool:
    """Make ``unchanged`` the process's watcher, unless another live one is."""
    with _Watcher.lock:
        owner = _Watcher.owner() if _Watcher.owner is not None else None
        if _Watcher.pid != os.getpid():
            owner = None  # the parent's, in a forked child
        if owner is not None and owner is not unchanged:
            return False
        _Watcher.owner, _Watcher.pid = weakref.ref(unchanged), os.getpid()
        return True


def _release(unchanged: Unchanged) -> None:
    """``unchanged`` no longer watches: another client may."""
    with _Watcher.lock:
        if _Watcher.owner is not None and _Watcher.owner() is unchanged:
            _Watcher.owner = None


def _pinned() -> bool:
    """Whether memory of this process is pinned for a device or the kernel to write past its
    page tables (``VmPin``); unknown counts as pinned."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmPin:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError, IndexError):
        pass
    return True


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())
