"""Which generations leave memory, and when: supersede, keep-N retention, orphans, corruption.

Call order: :meth:`Retention.supersede_older_locked` and :meth:`Retention.apply_locked` run
after every commit and persist (under the state lock); :meth:`Retention.retire_older_than_locked`
after a restart or when storage holds a newer object; :meth:`Retention.mark_orphans_locked` when
eviction finds nothing to evict; :meth:`Retention.sweep_orphans` every ``orphan_sweep`` seconds
from :meth:`Retention.start`; :meth:`Retention.supersede` and :meth:`Retention.drop_corrupt` on
a client's (or a peer's) request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptcache.server import ownership
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.eviction import EvictionPolicy
from ckptcache.server.memory.index import Generation, Key
from ckptcache.server.persist.lineage import is_orphaned, removed_reason
from ckptcache.server.persist.provenance import Provenance, write_provenance
from ckptcache.server.state import CacheState, Session, check_key
from ckptcache.storage import backend_for
from ckptcache.storage.fs import file_version
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState, Tier

__all__ = ["Retention"]

log = logging.getLogger(__name__)

#: Unpersisted states a newer commit supersedes at once (not one being written or watched).
_SUPERSEDABLE = (PersistState.QUEUED, PersistState.FAILED, PersistState.CONFLICT)


class Retention:
    """The rules that retire generations; never an unpersisted newest one."""

    def __init__(self, config: DaemonConfig, state: CacheState, eviction: EvictionPolicy):
        self.config = config
        self.state = state
        #: How storage is reached (the S3 endpoint), as the persister reaches it.
        self.options = config.storage_options()
        #: Decides what keep-N may retire (never a generation storage has not received).
        self.eviction = eviction
        #: The stamp of the cluster's newest save of a path (0: none recorded; ``None``:
        #: cannot be told now); unset for a node alone.
        self.newest: Callable[[str, str], int | None] | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Start the orphan sweep (when configured)."""
        if self.config.orphan_sweep > 0:
            threading.Thread(target=self._sweep_loop, name="orphan-sweep", daemon=True).start()

    def stop(self) -> None:
        """Stop the orphan sweep."""
        self._stopping.set()

    def supersede_older_locked(self, key: Key) -> None:
        """Older unpersisted generations need not reach storage: the newest will."""
        gens = self.state.index.generations(key)
        for old in gens[:-1]:
            if old.needs_persist and not old.persisted:
                old.needs_persist = False
                # One being written or watched finds out itself (its worker or its group).
                if old.persist_state in _SUPERSEDABLE:
                    self.state.persist_states.advance(old, PersistState.SUPERSEDED)

    def apply_locked(self, key: Key) -> None:
        """Retire generations beyond the configured ``keep`` (never an unpersisted one)."""
        for old in self.state.index.superseded(key, self.config.keep_for(key[1])):
            if not self.eviction.may_retire_beyond_keep(old):
                continue
            self.state.retire_locked(old)

    def retire_older_than_locked(self, key: Key, stored_ns: int, *, remember: bool) -> None:
        """Retire the generations of ``key`` committed before the object on storage: neither
        served nor persisted, storage holds a newer save. With ``remember`` (a write made
        outside the cache, not a newer save of another node), ``status`` goes on saying the
        newest of them was superseded (server/memory/superseded.py)."""
        superseded = []
        for gen in self.state.index.generations(key):
            if gen.committed_ns < stored_ns:
                log.warning(
                    "dropping %s generation %d: storage holds a newer object (written "
                    "through or persisted after it)", gen.path, gen.number,
                )  # fmt: skip
                if not gen.persisted:
                    self.state.persist_states.advance(
                        gen, PersistState.SUPERSEDED, needs_persist=False
                    )
                    superseded.append(gen)
                self.state.retire_locked(gen)
        if remember:
            self.state.remember_superseded_locked(key, superseded)

    def forget_replaced(self, key: Key, *, objects: bool = True) -> None:
        """Retire the persisted copies of ``key`` once the object they wrote was replaced on
        storage (a newer save by another daemon sharing the storage, a plain ``torch.save``):
        a load then reads the newer object, never the older cached copy. One ``stat`` for a
        file; one HEAD for an object-store path (``objects``: a daemon in a cluster leaves
        them to the cluster's newest-save record, which costs one coordinator read instead).
        An object removed by the user leaves the copies served."""
        path = key[1]
        state = self.state
        with state.lock.held():
            newest = state.index.newest(key)
            if newest is None or not newest.persisted or not newest.stored:
                return
        if "://" not in path:
            version = file_version(path, inspect=False)
        elif not objects:
            return
        else:
            try:
                version = backend_for(path, self.options).version(path)
            except (OSError, ValueError, ImportError) as e:
                log.debug("cannot compare %s with storage: %s", path, e)
                return
        if version is None or version.identity == newest.stored:
            return
        with state.lock.held():
            if state.index.newest(key) is not newest:
                return  # a save came meanwhile: it is newer than either
            for gen in [g for g in state.index.generations(key) if g.persisted]:
                log.info("%s was replaced on storage: cached generation %d retired",
                         path, gen.number)  # fmt: skip
                state.retire_locked(gen)
            state.update_gauges()

    def supersede(self, session: Session, req: m.SupersedeRequest) -> m.DeleteReply:
        """A client wrote ``path`` through to storage: every generation in memory is older.

        They are retired (freed once unpinned) and never persisted, so neither a load nor a
        later persist can bring the older bytes back. Only generations the caller may see
        are touched: the daemon cannot tell that the write really happened, and another
        user's copies stay (their persist still never replaces a newer object on storage).
        """
        check_key(req.namespace, req.path)
        state = self.state
        with state.lock.held():
            gens = [
                g
                for g in state.index.generations((req.namespace, req.path))
                if state.visible(session, g, False)
            ]
            for gen in gens:
                if not gen.persisted:
                    self.state.persist_states.advance(
                        gen, PersistState.SUPERSEDED, needs_persist=False
                    )
                state.retire_locked(gen)
            if self._may_see_superseded(session, (req.namespace, req.path)):
                state.superseded.forget((req.namespace, req.path))  # the write is newer
            state.update_gauges()
        if gens:
            log.info("%s written through: %d older generation(s) retired", req.path, len(gens))
        return m.DeleteReply(len(gens))

    def delete(self, session: Session, req: m.DeleteRequest) -> m.DeleteReply:
        """Drop every generation of a path from memory, own and backup copies (storage is
        untouched); backup copies of earlier saves still in transit are refused."""
        newest: int | None = 0 if self.newest is None else None  # a node alone: no record
        while True:
            reply = self._delete(session, req, newest)
            if reply is not None:
                return reply
            # It marks the path: the record is read first, outside the lock (an etcd read).
            newest = self._newest((req.namespace, req.path))

    def _newest(self, key: Key) -> int:
        """The cluster's newest stamp of ``key``; this node's clock while the record cannot
        be read."""
        assert self.newest is not None
        newest = self.newest(*key)
        return time.time_ns() if newest is None else newest

    def _delete(
        self, session: Session, req: m.DeleteRequest, newest: int | None
    ) -> m.DeleteReply | None:
        """:meth:`delete` with the cluster's newest stamp ``newest`` (0: none recorded, or a
        node alone), or ``None`` where it was not read: then a delete that would mark the
        path does nothing and returns ``None``."""
        state = self.state
        key = (req.namespace, req.path)
        with state.lock.held():
            held = state.index.generations(key)
            gens = [g for g in held if state.visible(session, g, False)]
            if len(gens) == len(held):
                if newest is None:
                    return None
                # The mark refuses backup copies still in transit; never set by a user over
                # another user's copies (that would refuse the owner's backups here). It is a
                # save's stamp, not this node's clock: the newest save known here or in the
                # cluster's record. A copy of any save made before the delete is stamped at
                # most that; a save made after it reads the record first and is stamped
                # later, whichever node's clock runs ahead. A mark never moves back.
                known = max((g.committed_ns for g in held), default=0)
                state.deleted[key] = max(state.deleted.get(key, 0), known, newest)
            forgotten = self._may_see_superseded(session, key)
            if forgotten:  # the user is done with the path: storage speaks for it again
                state.superseded.forget(key)
            if not gens and not forgotten:
                state.lookup_visible_locked(req.namespace, req.path, None, session)  # raises
            for gen in gens:
                state.retire_locked(gen)
            state.update_gauges()
        return m.DeleteReply(len(gens))

    def _may_see_superseded(self, session: Session, key: Key) -> bool:
        """Whether ``session`` may see (and so clear) the record of a superseded save of
        ``key`` (under the lock)."""
        record = self.state.superseded.get(key)
        return record is not None and ownership.may_see(self.state, session, record)

    def drop_corrupt(self, namespace: str, path: str, number: int, detail: str) -> None:
        """Bad bytes were found in a generation: drop it so nobody loads it again."""
        self.state.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
        log.error("corrupt copy of %s generation %d: %s", path, number, detail)
        state = self.state
        with state.lock.held():
            gen = state.index.get((namespace, path), number)
            if gen is not None:
                state.retire_locked(gen)
                state.update_gauges()

    def release_persisted_at_stop(self) -> tuple[int, int]:
        """At a clean stop, unlink the segments of persisted generations: storage holds
        them, and a stopped daemon's memory should go back to the machine. Every other
        generation (queued, failing, memory-only, a conflict) stays for the next start.
        Returns (generations released, bytes of segment given back).

        Call after the workers stopped (nothing is persisting, digesting or replicating):
        the generations leave without the retire hooks, the process is ending. A client
        still mapping one keeps its mapping (unlinking never disturbs it).
        """
        state = self.state
        count = released = 0
        with state.lock.held():
            for gen in [g for g in state.index if g.persisted and not g.staged_by]:
                state.index.remove(gen)
                gen.removed = True
                count, released = count + 1, released + gen.segment.capacity
                state.arena.destroy(gen.segment)
        return count, released

    def mark_orphans_locked(self) -> int:
        """Flag generations whose save directory was removed.

        They become evictable and are never persisted (see :mod:`ckptcache.server.persist.lineage`);
        returns how many were newly flagged.
        """
        found = 0
        gone: dict[str, bool] = {}
        for gen in list(self.state.index):
            if gen.orphaned or not gen.anchor:
                continue
            if gen.anchor not in gone:
                gone[gen.anchor] = is_orphaned(gen.anchor)
            if gone[gen.anchor]:
                gen.orphaned, found = True, found + 1
                if gen.needs_persist and not gen.persisted:
                    # Durable before it is acted on: a crash must not bring it back.
                    write_provenance(gen.segment, Provenance(gen.base, gen.anchor, dropped=True))
                    self.state.persist_states.advance(
                        gen, PersistState.DROPPED, needs_persist=False,
                        error=removed_reason(gen.anchor),
                    )  # fmt: skip
        return found

    def sweep_orphans(self) -> int:
        """Drop unpinned generations whose directory was removed; returns how many."""
        state = self.state
        with state.lock.held():
            self.mark_orphans_locked()
            victims: list[Generation] = [g for g in state.index if g.orphaned and g.pins == 0]
            for gen in victims:
                log.info("dropping %s generation %d: %s", gen.path, gen.number,
                         "its directory was removed")  # fmt: skip
                state.retire_locked(gen)
            if victims:
                state.update_gauges()
        return len(victims)

    def _sweep_loop(self) -> None:
        interval = self.config.orphan_sweep
        while not self._stopping.wait(interval):
            try:
                self.sweep_orphans()
            except Exception:
                log.exception("orphan sweep failed")
