"""The background work that makes generations share memory: which older generation to compare
with which newer one, the comparison, and the punch (the rules are
:mod:`ckptcache.server.memory.sharing`'s).

After a generation's digests are recorded or a persist ends (:meth:`Sharer.nudge`), and once
saves pause, each older generation that nothing needs to read soon (digested, on storage or
never to be, not pinned, no load mapping it) is compared page by page with its *partner*: the
newest generation of its path, or for checkpoints saved under a new path each step, the newest
save committed after it whose storages lie at the same offsets. Pages inside its storages that
are equal are backed by the partner and punched. An older generation is compared with each
partner once.

The comparison reads without the daemon's lock, a MiB at a time (``memcmp``, then page by page
where a MiB differs), paused while a save is in flight. The punch runs under the lock, a step
at a time, and stops as soon as anything else pinned the generation meanwhile (a load: its pin
made the generation whole again).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading

import numpy as np

from ckptcache.server.memory.arena import Segment, mapped_by_others
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.sharing import Range, intersect, storage_pages
from ckptcache.server.persist.persister import lower_thread_priority
from ckptcache.server.state import CacheState

__all__ = ["Sharer"]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
#: Bytes compared between two looks at whether a save began (and one ``memcmp``).
_CHUNK = 1 << 20
#: Bytes punched under the lock in one step (tens of milliseconds).
_STEP = 64 << 20
#: How often the sharer looks without being nudged (a persist finishing elsewhere).
_PERIOD = 5.0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


class Sharer:
    """Compares older generations with newer ones and shares their equal pages."""

    def __init__(self, state: CacheState, enabled: bool = True):
        self.state = state
        self.enabled = enabled
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: Older segment name -> (partner segment, partner generation, bytes it shared) when
        #: last compared: compared again only once one of them changed (a load that made it
        #: whole, a newer partner).
        self._compared: dict[str, tuple[str, int, int]] = {}
        #: (segment name, generation) -> hash of its layout (see :meth:`_layout_key`).
        self._layouts: dict[tuple[str, int], int] = {}
        self._thread = threading.Thread(target=self._loop, name="sharer", daemon=True)

    def start(self) -> None:
        """Start the background loop (when enabled)."""
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop the loop (it finishes the chunk in hand)."""
        self._stopping.set()
        self._wake.set()

    def nudge(self) -> None:
        """Something may have become shareable: a generation digested, a persist ended."""
        self._wake.set()

    def _loop(self) -> None:
        lower_thread_priority()
        while not self._stopping.is_set():
            self._wake.wait(_PERIOD)
            self._wake.clear()
            if self._stopping.is_set():
                return
            self.state.saves_in_flight.wait_quiet()
            try:
                self.run_once()
            except Exception:
                log.exception("sharing pages between generations failed")

    def run_once(self) -> int:
        """Share what can be shared now; returns the bytes given back."""
        total = 0
        for older, partner in self._pairs():
            if self._stopping.is_set():
                break
            total += self._share(older, partner)
        return total

    # ----------------------------------------------------------------- choosing

    def _pairs(self) -> list[tuple[Generation, Generation]]:
        """Each settled older generation and its partner: the newest generation of its path,
        else the newest save of the same layout (and owner) that can back pages. One pass
        over the index under the lock, each layout hashed once per generation (a mixture of
        experts' file lists tens of thousands of storages)."""
        state = self.state
        with state.lock.held():
            names = set(state.arena.segments)
            self._compared = {k: v for k, v in self._compared.items() if k in names}
            self._layouts = {k: v for k, v in self._layouts.items() if k[0] in names}
            newest: dict[tuple[int, int], Generation] = {}
            for gen in state.index:
                if _may_back(gen):
                    key = self._layout_key(gen)
                    best = newest.get(key)
                    if best is None or gen.committed_ns > best.committed_ns:
                        newest[key] = gen
            pairs = []
            for gen in state.index:
                if not _settled(gen):
                    continue
                partner = state.index.newest(gen.key)
                if partner is None or not _can_back(partner, gen):
                    partner = newest.get(self._layout_key(gen))
                    if partner is None or not _can_back(partner, gen):
                        continue
                if self._compared.get(gen.segment.name) != _mark(gen, partner):
                    pairs.append((gen, partner))
            return pairs

    def _layout_key(self, gen: Generation) -> tuple[int, int]:
        """(owner, hash of where its storages lie): equal for saves of one layout. A hash
        that collides only costs a comparison that finds little equal."""
        key = (gen.segment.name, gen.number)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = hash(
                tuple((r.offset, r.nbytes) for r in gen.manifest.storages)
            )
        return gen.segment.owner, layout

    # ----------------------------------------------------------------- comparing

    def _share(self, older: Generation, partner: Generation) -> int:
        state = self.state
        x, y = older.segment, partner.segment
        with state.lock.held():
            if not (_settled(older) and _can_back(partner, older)) or mapped_by_others(x):
                return 0
            older.pins += 1  # not pin_locked: that would make it whole
            partner.pins += 1
            runs = list(x.runs)
            read = [r.backing for r in runs]  # read here too: never freed meanwhile
            state.arena.sharing.hold(read)
            stop = min(x.read_header().manifest_offset, y.read_header().manifest_offset)
            pages = storage_pages(((r.offset, r.nbytes) for r in older.manifest.storages), stop)
        try:
            equal = self._equal(x, runs, y, pages)
            if equal is None:
                return 0
            with state.lock.held():
                if not self._still(older, partner, runs):
                    return 0
                if not equal:
                    self._compared[x.name] = _mark(older, partner)
                    return 0
                fresh = state.arena.sharing.share(x, equal, y)
                runs, hollow = list(x.runs), x.hollow
            done = 0
            for lo, hi in fresh:
                for at in range(lo, hi, _STEP):
                    with state.lock.held():
                        # A reader's copy back that failed between two steps punched every
                        # run and counted them (``end_whole``): nothing is left to punch.
                        if (not self._still(older, partner, runs) or mapped_by_others(x)
                                or x.hollow != hollow):  # fmt: skip
                            left = [(at, hi)] + [r for r in fresh if r[0] >= hi]
                            self._stopped(x, runs, hollow, left)
                            return done
                        step = (at, min(hi, at + _STEP))
                        state.arena.sharing.punch(x, [step])
                        hollow += step[1] - step[0]
                        done += step[1] - step[0]
            with state.lock.held():
                self._compared[x.name] = _mark(older, partner)
            if done:
                log.debug("%s generation %d shares %d MiB with %s generation %d", older.path,
                          older.number, done >> 20, partner.path, partner.number)  # fmt: skip
            return done
        finally:
            with state.lock.held():
                try:
                    state.arena.sharing.let_go(read)
                finally:
                    state.unpin_locked(older)
                    state.unpin_locked(partner)

    def _stopped(self, x: Segment, runs: list, hollow: int, left: list[Range]) -> None:
        """A share stopped before it punched ``left`` (under the lock): where nothing else
        changed ``x`` (a copy back in flight writes every run, a failed one punched them),
        those pages are backed no more, so every run names pages given back."""
        if x.runs != runs or x.hollow != hollow or x.copying or not left:
            return
        try:
            self.state.arena.sharing.keep_resident(x, left)
        except OSError as e:  # tmpfs full: runs stay recorded over resident pages
            log.warning("cannot record what %s keeps resident: %s", x.name, e)

    def _still(self, older: Generation, partner: Generation, runs: list) -> bool:
        """Nothing changed what the comparison found (under the lock): the older generation
        pinned by the sharer alone, its runs as compared, the partner whole and current."""
        return (
            not older.removed and not partner.removed and older.pins == 1
            and older.segment.runs == runs and not partner.segment.runs
            and not older.segment.readers and not older.segment.copying
        )  # fmt: skip

    def _equal(self, x: Segment, runs: list, y: Segment, pages: list[Range]) -> list[Range] | None:
        """The pages of ``pages`` where ``x`` (its runs read from their backings) equals
        ``y``; ``None`` when stopped."""
        pieces: list[tuple[Segment, int, int]] = []
        for lo, hi in pages:
            at = lo
            for run in runs:
                for s, e in intersect([(lo, hi)], [(run.start, run.end)]):
                    if s > at:
                        pieces.append((x, at, s))
                    pieces.append((run.backing, s, e))
                    at = e
            if at < hi:
                pieces.append((x, at, hi))
        out: list[Range] = []
        saves = self.state.saves_in_flight
        for source, lo, hi in pieces:
            if source is y:  # backed by the partner already
                _add(out, lo, hi)
                continue
            a = np.frombuffer(source.mapping, dtype=np.uint8)
            b = np.frombuffer(y.mapping, dtype=np.uint8)
            try:
                for at in range(lo, hi, _CHUNK):
                    # Never beside a save's copy, nor holding pins a save's eviction may need:
                    # given up, compared again once saves pause.
                    if saves.open or self._stopping.is_set():
                        return None
                    end = min(hi, at + _CHUNK)
                    if _memcmp(a[at:].ctypes.data, b[at:].ctypes.data, end - at) == 0:
                        _add(out, at, end)
                        continue
                    same = (a[at:end].reshape(-1, _PAGE) == b[at:end].reshape(-1, _PAGE)).all(1)
                    for i in np.flatnonzero(same):
                        _add(out, at + int(i) * _PAGE, at + (int(i) + 1) * _PAGE)
            finally:
                del a, b
        return out


def _mark(older: Generation, partner: Generation) -> tuple[str, int, int]:
    return (partner.segment.name, partner.number, older.segment.hollow)


def _add(out: list[Range], lo: int, hi: int) -> None:
    if out and out[-1][1] == lo:
        out[-1] = (out[-1][0], hi)
    else:
        out.append((lo, hi))


def _settled(gen: Generation) -> bool:
    """Whether ``gen`` may give pages back: its digests recorded (bringing it whole again
    is checked against them), nothing about to read it (its persist ended or none is due),
    not pinned, sound, the daemon's own file (an admitted user's file is sealed)."""
    segment = gen.segment
    return (
        gen.digests is not None and not gen.removed and not gen.pins and not gen.corrupt
        and not gen.staged_by and not (gen.needs_persist and not gen.persisted)
        and not segment.sealable and segment.fill is None
        and not segment.readers and not segment.copying  # read or written without the lock
    )  # fmt: skip


def _may_back(partner: Generation) -> bool:
    """Whether ``partner`` may hold pages of older generations: sound, digested, whole."""
    segment = partner.segment
    return (
        partner.digests is not None and not partner.removed and not partner.corrupt
        and not partner.staged_by and not segment.runs and not segment.sealable
    )  # fmt: skip


def _can_back(partner: Generation, gen: Generation) -> bool:
    """Whether ``partner`` may hold pages of ``gen``: :func:`_may_back`, newer, of the same
    owner."""
    return (
        _may_back(partner) and partner is not gen
        and partner.committed_ns > gen.committed_ns
        and partner.segment.owner == gen.segment.owner
    )  # fmt: skip
