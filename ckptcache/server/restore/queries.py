"""Read-only questions about the cache: stat, list, status, wait, pool.

Every call takes the state lock for a consistent snapshot; :meth:`Queries.wait` waits on the
state owner until the persist states it watches settle.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable

from ckptcache._version import __version__
from ckptcache.hugepages import huge_policy
from ckptcache.server import ownership
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.persist.persister import Persister
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.state import CacheState, Session
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState, WaitState

__all__ = ["Queries"]


class Queries:
    """Answers about objects and the daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        state: CacheState,
        *,
        persister: Persister,
        roots: PersistRoots,
        pool: SegmentPool,
        node_ids: Callable[[], tuple[str, ...]],
        clock_offsets: Callable[[], tuple[m.PeerClock, ...]] = tuple,
        digest_queue: Callable[[], int] = int,
    ):
        self.config = config
        self.state = state
        self.persister = persister
        self.roots = roots
        self.pool = pool
        #: Live cluster node ids (empty for a node alone).
        self.node_ids = node_ids
        #: The peers' clock offsets as last measured (empty for a node alone).
        self.clock_offsets = clock_offsets
        #: The digester's backlog (``Digester.backlog``).
        self.digest_queue = digest_queue

    def info(self, gen: Generation) -> m.ObjectInfo:
        """Describe one generation (call under the state lock)."""
        stages = ["local"]
        if gen.persisted:
            stages.append("persisted")
        return m.ObjectInfo(
            namespace=gen.namespace, path=gen.path, generation=gen.number, size=gen.size,
            stages=tuple(stages), committed=gen.committed, segment=gen.segment.name,
            pins=gen.pins, digests_valid=gen.digests is not None,
            generations=len(self.state.index.generations(gen.key)),
            persist_state=gen.persist_state, persist_error=gen.persist_error,
            persist_seconds=gen.persist_seconds, replicas=tuple(sorted(gen.replicas)),
            origin=gen.origin, conflict=gen.conflict, last_load_tier=gen.last_load_tier,
        )  # fmt: skip

    def stat(self, session: Session, req: m.StatRequest) -> m.ObjectInfo:
        """Status of a path's newest generation; of its last save, ``superseded``, when
        storage superseded it and no newer save came since (server/memory/superseded.py)."""
        with self.state.lock.held():
            superseded = self._superseded_locked(session, (req.namespace, req.path))
            if superseded is not None:
                return superseded
            gen = self.state.lookup_visible_locked(req.namespace, req.path, None, session)
            return self.info(gen)

    def _superseded_locked(self, session: Session, key: tuple[str, str]) -> m.ObjectInfo | None:
        """The record of ``key``'s last save if storage superseded it and ``session`` may
        see it, else None (under the lock)."""
        record = self.state.superseded.get(key)
        if record is None or not ownership.may_see(self.state, session, record):
            return None
        return record.info

    def list(self, session: Session, req: m.ListRequest) -> m.ListReply:
        """Newest generation of every path under a prefix."""
        state = self.state
        with state.lock.held():
            out = []
            for ns, path in state.index.paths():
                if (req.namespace is None or ns == req.namespace) and path.startswith(req.prefix):
                    gen = state.index.newest((ns, path))
                    assert gen is not None
                    if state.visible(session, gen, False):
                        out.append(self.info(gen))
        return m.ListReply(tuple(out))

    def pool_info(self, session: Session, req: m.PoolRequest) -> m.PoolReply:
        """The spare segments this session's user may map ahead of a save."""
        with self.state.lock.held():
            reply = self.pool.describe(session.uid)
            # The client maps what it is told about: its next reserve prefers these.
            session.note_mapped(reply.segments, self.state.arena.segments)
            return reply

    def status(self, session: Session, req: m.StatusRequest) -> m.DaemonStatus:
        """Daemon-wide counters."""
        state, arena = self.state, self.state.arena
        with state.lock.held():
            gens = list(state.index)
            return m.DaemonStatus(
                node_id=self.config.node_id, pid=os.getpid(), version=__version__,
                uptime=time.time() - state.started, memory_limit=self.config.memory_limit,
                memory_used=arena.used, memory_free_pool=arena.free_bytes,
                segments=len(arena.segments), free_segments=len(arena.free),
                objects=len(state.index.paths()), generations=len(gens),
                pinned=sum(1 for g in gens if g.pins), reservations=state.saves_in_flight.open,
                shm_dir=self.config.shm_dir, socket=self.config.socket,
                persist_queue=len(self.persister.queue), digest_queue=self.digest_queue(),
                persist_roots=self._roots(),
                cluster_nodes=self.node_ids(), coordinator=self.config.coordinator,
                memory_stored=sum(g.size for g in gens),
                spare_segments=len(self.pool.describe(arena.uid).segments),
                shm_huge_pages=huge_policy(self.config.shm_dir),
                clock_offsets=self.clock_offsets(),
                clock_offset_bound=self.config.clock_offset_bound,
            )  # fmt: skip

    def _roots(self) -> tuple[str, ...]:
        """The roots as reported: ``/`` for the implicit root of a daemon run as a user
        (every local path persists), never an empty list that would read as "none"."""
        return tuple(self.roots) or (("/",) if self.roots.implicit else ())

    def wait(self, session: Session, req: m.WaitRequest) -> m.WaitReply:
        """Block until ``path`` (or everything under a prefix) is persisted, failed, or timed out.

        The reply's state is ``persisted``, ``memory-only``, ``failed`` (with the error),
        ``dropped`` (its directory was removed: deleted by the user), ``conflict`` (another
        writer's object could not be ordered against it), ``superseded`` (storage holds a
        write made after it) or ``timeout``; a prefix wait ignores memory-only objects.
        """
        state = self.state
        deadline = time.monotonic() + max(0.0, req.timeout)
        with state.lock.held():
            while True:
                reply = self._settled(session, req)
                if reply is not None:
                    return reply
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pending = self._pending(session, req)
                    return m.WaitReply(pending[0].number, WaitState.TIMEOUT)
                state.lock.wait(min(remaining, 1.0))

    def _pending(self, session: Session, req: m.WaitRequest) -> builtins.list[Generation]:
        state = self.state
        if not req.prefix:
            return [state.lookup_visible_locked(req.namespace, req.path, None, session)]
        gens = [state.index.newest(k) for k in state.index.paths()
                if k[0] == req.namespace and k[1].startswith(req.path)]  # fmt: skip
        return [g for g in gens if g is not None and g.needs_persist
                and state.visible(session, g, False)]  # fmt: skip

    def _settled(self, session: Session, req: m.WaitRequest) -> m.WaitReply | None:
        """The answer if the watched objects have settled, else None (under the lock)."""
        if not req.prefix:
            superseded = self._superseded_locked(session, (req.namespace, req.path))
            if superseded is not None:  # out of memory, never persisted: the newer write won
                return m.WaitReply(
                    superseded.generation, WaitState.SUPERSEDED, superseded.persist_error
                )
        pending = self._pending(session, req)
        if not req.prefix and pending[0].persist_state == PersistState.DROPPED:
            return m.WaitReply(pending[0].number, WaitState.DROPPED, pending[0].persist_error)
        failed = [g for g in pending if g.persist_state == PersistState.FAILED]
        if failed:
            return m.WaitReply(failed[0].number, WaitState.FAILED, failed[0].persist_error)
        clash = [g for g in pending if g.persist_state == PersistState.CONFLICT]
        if clash:
            return m.WaitReply(clash[0].number, WaitState.CONFLICT, clash[0].persist_error)
        if not req.prefix and pending[0].persist_state == PersistState.SUPERSEDED:
            # Storage holds a write made after this save: never reported as persisted.
            return m.WaitReply(pending[0].number, WaitState.SUPERSEDED, pending[0].persist_error)
        if all(g.persisted or not g.needs_persist for g in pending):
            if len(pending) == 1 and not pending[0].needs_persist:
                return m.WaitReply(pending[0].number, WaitState.MEMORY_ONLY)
            return m.WaitReply(max((g.number for g in pending), default=0), WaitState.PERSISTED)
        return None
