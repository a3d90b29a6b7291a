"""Room for a save within the daemon's memory budget and its user's share.

A reservation (:meth:`ckptcache.server.saves.Saves.reserve`) asks :meth:`Budget.room` for a
segment, under the state's lock. The ways to room, in order: the user's share (evicting the
user's own generations that are safe to drop, never another user's), a free segment (first
one the client maps already), a spare from the pool, eviction of generations safe to drop,
a new segment; then a wait, as long as waiting can help, up to the reservation's deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from ckptcache._units import format_bytes
from ckptcache.errors import BudgetExceeded, ObjectTooLarge
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.arena import Arena, Segment
from ckptcache.server.memory.eviction import EvictionPolicy
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.shares import Verdict
from ckptcache.server.ownership import Saver
from ckptcache.server.state import CacheState, Session

__all__ = ["Budget"]

log = logging.getLogger(__name__)


class Budget:
    """The reserve path's search for room: share, free list, pool, eviction, a new segment,
    a wait."""

    def __init__(
        self,
        config: DaemonConfig,
        state: CacheState,
        *,
        pool: SegmentPool,
        retention: Retention,
        eviction: EvictionPolicy,
    ):
        self.config, self.state, self.metrics = config, state, state.metrics
        self.pool, self.retention = pool, retention
        #: What may be evicted for room, in which order (server/memory/eviction.py), and each
        #: admitted user's share of the budget (server/memory/shares.py).
        self.eviction, self.shares = eviction, eviction.shares

    def check_whole(self, path: str, nbytes: int) -> None:
        """Refuse an object larger than the whole budget: no wait can make room for it."""
        limit = self.config.memory_limit
        if Arena.capacity_for(nbytes) > limit:
            raise ObjectTooLarge(
                f"{path!r} needs {format_bytes(nbytes)}, more than the daemon's whole "
                f"memory budget of {format_bytes(limit)}; raise --memory-limit or save this "
                "object without the cache"
            )

    def room_locked(
        self, path: str, nbytes: int, saver: Saver, session: Session, deadline: float
    ) -> Segment:
        """A segment for ``nbytes`` of ``path`` saved by ``saver`` through ``session`` (whose
        client's segments come first), waiting for room until ``deadline``
        (``time.monotonic``) while waiting can help; raises :class:`BudgetExceeded`
        otherwise."""
        state = self.state
        capacity = Arena.capacity_for(nbytes)
        what = f"{format_bytes(nbytes)} of {path!r}"
        while True:
            share = self.fit_share_locked(saver.uid, capacity, what)
            if not share.fits:
                if deadline <= time.monotonic() or not self.own_pending_locked(saver.uid):
                    self.metrics.budget_failures.inc()
                    raise BudgetExceeded(share.message)
                state.lock.wait(min(deadline - time.monotonic(), 0.5))
                continue
            segment = self.allocate_locked(nbytes, saver, session.mapped, session.tokens)
            if segment is not None:
                return segment
            remaining = deadline - time.monotonic()
            held, stuck = self.held_locked(capacity)
            if remaining <= 0 or stuck:
                self.metrics.budget_failures.inc()
                waited = "" if stuck else f" within {self.config.reserve_timeout:g}s"
                raise BudgetExceeded(
                    f"no room for {what}{waited}: {format_bytes(state.arena.used)} of "
                    f"{format_bytes(self.config.memory_limit)} in use; {held}"
                )
            state.lock.wait(min(remaining, 0.5))

    def fit_share_locked(self, uid: int, capacity: int, what: str) -> Verdict:
        """Whether ``uid`` may take ``capacity`` more bytes; evicts its own generations that
        are safe to drop (never another user's) until it may, if it can."""
        shares = self.shares
        while True:
            verdict = shares.check(uid, capacity, what)
            if verdict.fits:
                return verdict
            own = self.eviction.own_victims(self.state.index, uid)
            if not own:
                return verdict
            # Routine under a full budget (one a save): DEBUG; ckptcache_evictions counts them.
            log.debug("evicting %s generation %d (its user's share is full)", own[0].path,
                      own[0].number)  # fmt: skip
            self.metrics.evictions.inc()
            self.state.retire_locked(own[0])

    def own_pending_locked(self, uid: int) -> bool:
        """Whether waiting can bring ``uid`` under its share: some of its generations are
        pinned by loads or on their way to storage (then evictable)."""
        user = self.shares.user_of(uid)
        for gen in self.state.index:
            if self.shares.owner(gen) != user:
                continue
            if gen.pins or self.eviction.on_its_way(gen):
                return True
        return False

    def held_locked(self, capacity: int) -> tuple[str, bool]:
        """What holds the budget and what to do, and whether waiting can help (nothing is
        pinned or on its way to storage, and saves in flight cannot explain the shortfall):
        a budget full of checkpoints that can never be persisted fails at once."""
        kinds: dict[str, list[Generation]] = {}
        for gen in self.state.index:
            if gen.staged_by:  # pinned too, but by its stager: say whose, and until when
                uid = gen.saver.uid if gen.saver is not None else self.state.arena.uid
                kind = f"staging copies of uid {uid} (held until their stager releases them)"
            elif gen.pins:
                kind = "pinned by loads"
            elif gen.persisted or not gen.needs_persist:
                kind = "persisted" if gen.persisted else "memory-only (never persisted)"
            elif not self.eviction.on_its_way(gen):  # failed or conflict
                kind = f"{gen.persist_state} persists"
            else:
                kind = "waiting for their persist"
            kinds.setdefault(kind, []).append(gen)
        parts = [
            f"{format_bytes(sum(_held(g) for g in gens))} in {len(gens)} "
            f"{kind} (e.g. {gens[0].path!r})"
            for kind, gens in sorted(kinds.items())
        ]
        held = sum(_held(g) for g in self.state.index) + self.state.arena.orphaned
        stuck = (
            not any(gen.pins for gen in self.state.index)
            and not kinds.get("waiting for their persist")
            and held + capacity > self.state.arena.limit
        )
        advice = (
            "Delete what is not needed (ckptcache rm PATH), save under a --persist-root, or "
            "raise --memory-limit"
            if stuck
            else "Raise --memory-limit, keep fewer generations, or wait for persistence"
        )
        return f"held: {'; '.join(parts) or 'nothing committed'}. {advice}", bool(stuck)

    def allocate_locked(
        self,
        nbytes: int,
        saver: Saver | None = None,
        mapped: Collection[str] = (),
        known: Collection[int] = (),
    ) -> Segment | None:
        """A segment for ``nbytes``: free list (first what the client maps already,
        ``mapped``, and holds bytes it knows, ``known`` tokens), spare pool, eviction of
        generations safe to drop, a new segment; None while everything is pinned."""
        state = self.state
        arena = state.arena
        capacity = Arena.capacity_for(nbytes)
        owner = saver.uid if saver is not None else None
        tight = arena.used + capacity > arena.limit
        segment = arena.take_free(nbytes, tight=tight, owner=owner, mapped=mapped, known=known)
        if segment is not None:
            self.pool.claim(segment, nbytes)
        else:
            segment = self.pool.take(nbytes, arena.uid if owner is None else owner)
        if segment is not None:
            return segment
        arena.shrink_free(capacity)
        uid = arena.uid if owner is None else owner
        while arena.used + capacity > arena.limit:
            victims = self.victims_locked(uid)
            if not victims and self.retention.mark_orphans_locked():
                victims = self.victims_locked(uid)
            if not victims:
                return None
            log.debug("evicting %s generation %d", victims[0].path, victims[0].number)
            self.metrics.evictions.inc()
            state.retire_locked(victims[0])
            segment = arena.take_free(nbytes, tight=True, owner=owner, mapped=mapped, known=known)
            if segment is not None:
                self.pool.claim(segment, nbytes)
                return segment
            arena.shrink_free(capacity)
        try:
            return arena.create(nbytes, None if saver is None else (saver.uid, saver.gid))
        except OSError as e:
            raise BudgetExceeded(
                f"cannot allocate {format_bytes(capacity)} in {arena.directory}: {e.strerror}. "
                "The shared-memory file system is fuller than the budget assumes; lower "
                "--memory-limit or enlarge /dev/shm"
            ) from e

    def victims_locked(self, uid: int) -> list[Generation]:
        """What a save of ``uid`` may evict: never another user's unpersisted generation."""
        return self.eviction.victims(self.state.index, uid)


def _held(gen: Generation) -> int:
    """The memory ``gen``'s segment holds (pages a newer save holds for it not counted)."""
    return gen.segment.capacity - gen.segment.hollow
