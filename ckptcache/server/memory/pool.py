"""The spare pool: pre-faulted free segments kept ready so the first save of a new path runs
at the speed of a repeated one.

A new segment costs a first touch of every page (``fallocate`` zeroing them in tmpfs, then the
page tables of every mapping): several times a memcpy. The pool pays that in the
background, so the next new path (the next iteration's directory, another rank's shard, a
backup copy or a storage read arriving) finds a segment ready. The daemon's own mapping of a
spare is populated when it is made (receives write through it); clients map the spares ahead
of use (see :class:`ckptcache.client.Client`), so their page tables are warm too.

A free segment of a wanted size (a deleted or evicted generation's) becomes a spare instead
of a new allocation (:meth:`SegmentPool.promote_locked`): it is allocated already, and listed
as a spare it is mapped by the clients ahead of their saves; a budget full of freed segments
would otherwise leave no room to grow a spare, and a new client would meet each of them
unmapped inside its first save. A reserve hands out first the segments its client was told
about (see ``Session.mapped``), so the spare a client mapped is not passed over for a freed
segment it never mapped.

When it grows: a reservation that takes a spare (through :meth:`SegmentPool.take` or the
free list, see :meth:`SegmentPool.claim`) or needs a new segment only records the size; the
grower is woken by :meth:`SegmentPool.refill` once that save is committed or aborted, so it
never competes with the client's copy for the CPU.

Sizes come from what is saved: the pool keeps one spare per recent save that wanted a new
segment (at most ``segments`` of them), each of that save's size (checkpoints of one job repeat
their sizes, e.g. a model file and an optimizer file per step), and none before the first such
save: a daemon that nobody saves to holds no spare. A restarted daemon takes the sizes from the
records of the generations it adopted (:meth:`SegmentPool.seed`): the next job's first save
finds its spare made. ``nbytes`` (``--pool-bytes``) only bounds
the total; a save larger than it is never pre-made. A spare that serves none of the recent
sizes (too small, or more than twice too big) is replaced in the background. A spare at most
twice the size a save needs is handed over whole (trimming the tail would cost the save a
page-freeing pass); a larger one is trimmed, so a small save never pins a large spare.

A clean stop (:meth:`SegmentPool.stop`) unlinks the spares, every other free segment and a
spare still being made: the segment directory keeps only committed generations (and saves in
flight), which the next incarnation adopts.

Rules that keep it safe:

* it grows only into budget nobody uses (``used + capacity <= limit``), never by evicting;
* spares are free segments, so a save that needs room unlinks them before any committed
  generation is evicted (:meth:`Arena.shrink_free` runs before eviction);
* files are allocated outside the daemon lock, their bytes counted in ``Arena.pending`` so
  the budget holds while they are being created.

Spares belong to the daemon's own user; saves of other admitted users create their segments
as before (a segment is never handed across users).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from ckptcache.format.layout import SegmentState
from ckptcache.server.lock import Locked
from ckptcache.server.memory.arena import Arena, Segment, empty_header, mapped_by_others
from ckptcache.server.memory.index import Generation
from ckptcache.wire import messages as m

__all__ = ["SegmentPool"]

log = logging.getLogger(__name__)


class SegmentPool:
    """Keeps up to ``segments`` spares, sized like the recent saves, totalling at most
    ``nbytes`` in ``arena``.

    ``take``/``note``/``describe`` run under the state lock; the grower thread takes it
    (``lock``, the state's narrow port) only to book and register a spare, and wakes waiters.
    """

    def __init__(
        self,
        arena: Arena,
        lock: Locked,
        segments: int,
        nbytes: int,
        quiet: Callable[[], object] | None = None,
    ):
        self.arena = arena
        #: Waits until saves pause (``SavesInFlight.wait_quiet``): a checkpoint's next file
        #: is saved right after the commit that woke the grower, and a spare's allocation
        #: (every page zeroed) would take a core and memory bandwidth from its copy.
        self._quiet = quiet
        #: Woken, waiting for saves to pause: reported as growing, so that a client that
        #: asks meanwhile follows the spare about to be made instead of missing it.
        self._waiting = False
        self._lock = lock
        self.segments = segments if nbytes > 0 else 0
        self.nbytes = nbytes
        #: Capacities of the last saves that wanted a new segment, newest last (checkpoints
        #: of one job repeat their sizes): the spares the pool keeps (see :meth:`wanted`).
        self.recent: collections.deque[int] = collections.deque(maxlen=self.segments or 1)
        self.growing = False
        #: Name of the spare being allocated outside the lock (unlinked by :meth:`stop`).
        self._making: str | None = None
        self._making_capacity = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="segment-pool", daemon=True)

    def start(self) -> None:
        """Start the grower; it makes spares once saves have shown their sizes."""
        if self.segments:
            self._thread.start()

    def stop(self) -> None:
        """Stop the grower and unlink every free segment (spares included) and the spare
        being made, if any: they hold no data, and a clean stop leaves nothing in the shm
        directory but committed generations. The grower is not joined (an allocation in
        flight on a busy machine must not hold up shutdown): its file is unlinked here, and
        the grower drops the segment itself if it finishes first (see :meth:`_grow_one`)."""
        self._stop.set()
        self._wake.set()
        arena = self.arena
        with self._lock.held():
            for segment in list(arena.free.values()):
                arena.destroy(segment)  # clients that mapped it keep their pages until unmapped
            if self._making is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(arena.directory, self._making))

    def _live(self) -> list[Segment]:
        """The spares still free (a save, the free-list reuse or a shrink may have taken one);
        never one with holes, whose pages are not allocated yet (``sharing.py``)."""
        return [s for s in self.arena.free.values() if s.spare and not s.holes]

    def note(self, capacity: int) -> None:
        """A save wanted a new segment of ``capacity``: make the next spares that size (grown
        at the next :meth:`refill`, not now: the save's copy is about to run)."""
        if self.segments and capacity <= self.nbytes:
            self.recent.append(capacity)

    def seed(self, generations: Iterable[Generation]) -> None:
        """Size the spares from the records of earlier saves (``generations``: what a restart
        adopted): the newest ones of the daemon's own user, one spare per segment size, as
        if those saves had just wanted a new segment. A job's first save on a restarted
        daemon then finds a spare made while the job starts, not an allocation of its own.
        Grown at the next :meth:`refill` (under the state lock, like :meth:`note`)."""
        own = [g for g in generations if g.segment.owner == self.arena.uid]
        for gen in sorted(own, key=lambda g: g.committed)[-self.segments :]:
            self.note(gen.segment.capacity)

    def claim(self, segment: Segment, nbytes: int) -> None:
        """``segment`` was just taken from the free list for ``nbytes``: if it was a spare, it
        is one no longer and the pool is one short (refilled at the next :meth:`refill`)."""
        if segment.spare:
            segment.spare = False
            self.note(Arena.capacity_for(nbytes))

    def refill(self) -> None:
        """Wake the grower (a reservation ended: nobody is copying into what it took)."""
        if self.segments:
            self._wake.set()

    def take(self, nbytes: int, uid: int) -> Segment | None:
        """The smallest spare that holds ``nbytes``, trimmed to size; ``None`` if none fits."""
        capacity = Arena.capacity_for(nbytes)
        fits = [s for s in self._live() if s.capacity >= capacity and uid == self.arena.uid]
        self.note(capacity)
        if not fits:
            return None
        best = min(fits, key=lambda s: s.capacity)
        best.stop_fill()
        best.spare = False
        del self.arena.free[best.name]
        if best.capacity > 2 * capacity:
            try:
                self.arena.trim(best, capacity)  # give the unneeded tail back to the budget
            except OSError as e:
                log.warning("could not trim spare %s: %s", best.name, e)
        best.write_header(empty_header(SegmentState.WRITING))
        best.last_used = time.monotonic()
        return best

    def describe(self, uid: int) -> m.PoolReply:
        """The spares a client of ``uid`` may map ahead of use (a freed segment of a wanted
        size is made one first, see :meth:`promote_locked`)."""
        if uid == self.arena.uid:
            self.promote_locked()
        live = self._live() if uid == self.arena.uid else []
        return m.PoolReply(
            tuple(s.name for s in live),
            tuple(s.capacity for s in live),
            self.growing or self._waiting,
        )

    # ----------------------------------------------------------------- growing

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._quiet is not None:
                self._waiting = True
                try:
                    self._quiet()
                finally:
                    self._waiting = False
            while not self._stop.is_set() and self._grow_one():
                pass

    def wanted(self) -> list[int]:
        """The capacities of the spares to keep, largest first: one per recent save size
        (none before the first save that wanted a new segment)."""
        return sorted(self.recent, reverse=True)

    @staticmethod
    def _serves(spare: int, capacity: int) -> bool:
        # Within twice the need the spare is handed over whole; beyond, the save would pay a
        # trim of the tail (Arena.take_free leaves such spares alone unless memory is tight).
        return capacity <= spare <= 2 * capacity

    def _plan(self, live: list[Segment]) -> tuple[int | None, list[Segment]]:
        """The next capacity to grow (None: nothing missing) and the live spares that serve
        no wanted size (stale: made for sizes the saves no longer have)."""
        unmatched = sorted(live, key=lambda s: s.capacity)
        missing = None
        for capacity in self.wanted():
            match = next((s for s in unmatched if self._serves(s.capacity, capacity)), None)
            if match is not None:
                unmatched.remove(match)
            elif missing is None:
                missing = capacity
        return missing, unmatched

    def promote_locked(self) -> int:
        """Make free segments of the daemon's user into the spares still missing, where one
        of a wanted size lies in the free list (a deleted or evicted generation's); returns
        how many. Such a segment is allocated already, and as a spare it is listed to the
        clients, which map it ahead of their saves: left as a plain free segment it would
        be mapped by no new client, and would keep the budget from growing a spare."""
        if not self.segments:
            return 0
        # The spare being made counts as made: promoting meanwhile would make one too many.
        live = [s.capacity for s in self._live()] + [self._making_capacity] * self.growing
        wanted = self.wanted()
        for spare in live:  # the wanted sizes the live spares serve already
            match = next((c for c in wanted if self._serves(spare, c)), None)
            if match is not None:
                wanted.remove(match)
        free = sorted(
            (
                s
                for s in self.arena.free.values()
                if not s.spare and s.owner == self.arena.uid and not s.sealable and not s.holes
            ),
            key=lambda s: s.capacity,
        )
        count, total = len(live), sum(live)
        for capacity in wanted:
            for segment in free:
                if (
                    count < self.segments
                    and total + segment.capacity <= self.nbytes
                    and self._serves(segment.capacity, capacity)
                    and not mapped_by_others(segment)
                ):
                    segment.spare = True
                    free.remove(segment)
                    count, total = count + 1, total + segment.capacity
                    break
        return count - len(live)

    def _grow_one(self) -> bool:
        arena = self.arena
        with self._lock.held():
            if self.promote_locked():
                self._lock.notify_all()
                return True
            live = self._live()
            capacity, stale = self._plan(live)
            if capacity is None:
                return False
            # Replace stale spares (oldest first) while the pool's count or bytes are full.
            stale.sort(key=lambda s: s.last_used)
            while stale and (
                len(live) >= self.segments or sum(s.capacity for s in live) + capacity > self.nbytes
            ):
                old = stale.pop(0)
                live.remove(old)
                arena.destroy(old)  # a free spare: clients that mapped it keep their pages
            if (
                len(live) >= self.segments
                or sum(s.capacity for s in live) + capacity > self.nbytes
                or arena.used + capacity > arena.limit
            ):
                return False
            name = arena.next_name(arena.uid)
            arena.pending += capacity
            self.growing = True
            self._making, self._making_capacity = name, capacity
        segment = None
        try:
            segment = arena.allocate(name, capacity, arena.uid, populate=True)
        except OSError as e:
            log.warning("segment pool: cannot allocate a %d-byte spare: %s", capacity, e)
        finally:
            with self._lock.held():
                arena.pending -= capacity
                self.growing = False
                self._making = None
                if segment is not None:
                    arena.segments[name] = segment
                    if self._stop.is_set():  # stopped meanwhile: nothing may stay behind
                        arena.destroy(segment)
                        segment = None
                    else:
                        arena.release(segment)
                        segment.spare = True
                self._lock.notify_all()
        return segment is not None
