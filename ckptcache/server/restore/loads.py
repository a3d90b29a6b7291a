"""Loads: pin a generation for a client, from this node's memory or a remote tier.

Call order (per load, see :mod:`ckptcache.wire.messages`)::

    loads.open(session, OpenRequest)        -> generation pinned (local, else peer/storage)
    loads.release(session, ReleaseRequest)  -> pin dropped
    loads.prefetch(session, PrefetchRequest) = open + release (warms this node's memory)

A miss goes to the :class:`RemoteTier` (the cluster's remote load), when there is one. A daemon
outside a cluster has none: a load it misses is read by the client itself, and a prefetch it
misses is read from storage by this daemon (:class:`StorageTier`, checked as it lands), so that
``prefetch`` warms this node's memory from storage as it does on a cluster.

On a cluster, a load of the newest generation first reads the cluster's newest save of the
path (:mod:`ckptcache.server.cluster.truth`, one coordinator read): a copy here that is older
(another
node saved the path since) is not served; the newest is brought in from a peer or storage, or,
where no reachable tier holds it, :class:`~ckptcache.errors.NewestUnavailable` says so.

During a coordinator outage such a load raises :class:`~ckptcache.errors.CoordinatorUnavailable`
(a ``ConnectionError``): whether this node's copy is the newest cannot be known, and other
nodes' memory cannot be searched, so serving the copy or "not found" could both be wrong. A
client that opted in to possibly-stale bytes (``allow_stale``) is served this node's copy, or
reads storage itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from ckptcache.errors import CheckpointNotFound, CoordinatorUnavailable
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.staging import drop_lease_locked
from ckptcache.server.persist.digester import Digester
from ckptcache.server.state import CacheState, NewerHeld, Session, bounded
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

__all__ = ["Loads", "RemoteTier", "StorageTier"]

log = logging.getLogger(__name__)


class RemoteTier(Protocol):
    """Where a miss is loaded from: a peer's memory or the group's storage read."""

    def newest(self, namespace: str, path: str) -> int:
        """The stamp of the cluster's newest save of ``path`` (0: none recorded)."""

    def same_content(self, gen: Generation, stamp: int) -> bool:
        """Whether the save stamped ``stamp`` has ``gen``'s content (digests known)."""

    def load_remote(
        self, namespace: str, path: str, timeout: float, newer_than: int = 0
    ) -> Generation:
        """Bring ``path`` into this node's memory (raises :class:`CheckpointNotFound`); with
        ``newer_than``, a copy of a save stamped at least that."""


class StorageTier(Protocol):
    """This node's own read of storage
    (:class:`~ckptcache.server.restore.storage_read.StorageReader`)."""

    def in_storage(self, path: str, newer_than: int = 0) -> bool:
        """Whether storage holds ``path`` (under this daemon's roots), stamped at least
        ``newer_than``."""

    def load(self, namespace: str, path: str, started: Callable[[], None]) -> Generation:
        """Read ``path`` into this node's memory, checked as it lands."""


#: Storage reads of one path by prefetches on a daemon without a cluster run one at a time
#: (the second finds the first's copy); paths share these locks by hash.
_READ_LOCKS = 16


@dataclass(eq=False)
class Loads:
    """Serves loads: pins, leases and the tier each load came from."""

    config: DaemonConfig
    state: CacheState
    _: KW_ONLY
    digester: Digester
    retention: Retention
    remote: RemoteTier | None
    #: Without a remote tier: where a prefetch this node misses is read from.
    storage: StorageTier | None = None

    def __post_init__(self) -> None:
        self.metrics = self.state.metrics
        self._read_locks = [threading.Lock() for _ in range(_READ_LOCKS)]

    def open(self, session: Session, req: m.OpenRequest, *, warm: bool = False) -> m.OpenReply:
        """Pin a generation for a load and say where it lies (``warm``: for a prefetch)."""
        state = self.state
        t0 = time.perf_counter()
        tier = Tier.LOCAL
        floor = 0
        if req.generation is None:
            self.retention.forget_replaced((req.namespace, req.path), objects=self.remote is None)
            floor = self._newest(req)
        try:
            gen = self._pin_here(session, req, floor)
        except CheckpointNotFound as e:
            # A client's reading ahead takes only what is here: it never pulls a copy in.
            if req.generation is not None or req.ahead or (self.remote is None and not warm):
                raise
            if self.remote is None and self.storage is None:
                raise
            with state.lock.held():
                held = state.index.generations((req.namespace, req.path))
            if held and not isinstance(e, _Older):
                raise  # held by another user: never replaced by a remote copy for this one
            gen = self._load_remote(req.namespace, req.path, bounded(120.0, req.timeout), floor)
            tier = _tier_of(gen)
            with state.lock.held():
                if gen.removed:  # evicted or replaced since it arrived: serve what is here now
                    gen = state.lookup_visible_locked(req.namespace, req.path, None, session,
                                                      load=True)  # fmt: skip
                    state.check_not_corrupt(gen)
                    tier = Tier.LOCAL
                if not state.visible(session, gen, True):
                    raise state.not_found(req.namespace, req.path, None) from None
                state.pin_locked(gen)
        try:
            # A file cut behind the daemon would be a SIGBUS in the client's read of it.
            gen.segment.check_whole()
            if req.need_digests and gen.digests is None:
                self.digester.compute(gen)
        except BaseException:
            state.unpin(gen)
            raise
        with state.lock.held():
            lease = state.next_id()
            session.leases[lease] = gen
            header = gen.segment.read_header()
            if not req.ahead:  # a client's reading ahead is not its user's load
                gen.last_load_tier = tier
                self.metrics.loads.labels(tier=tier).inc()
                self.metrics.bytes_loaded.labels(tier=tier).inc(gen.size)
        if not req.ahead:
            self.metrics.load_latency.observe(time.perf_counter() - t0)
        log.debug("load of %s served from the %s tier", gen.path, tier)
        return m.OpenReply(
            lease, gen.segment.name, gen.segment.capacity, gen.number, header.manifest_offset,
            header.manifest_size, header.digest_offset, header.n_storages, gen.digests is not None,
            tier,
        )  # fmt: skip

    def _pin_here(self, session: Session, req: m.OpenRequest, floor: int) -> Generation:
        """Pin this node's copy for ``req``, unless it is older than the cluster's newest
        save (stamped ``floor``) with other content (raises :class:`_Older`)."""
        state = self.state
        with state.lock.held():
            held = state.index.get((req.namespace, req.path), req.generation) if (
                req.generation is not None
            ) else state.index.newest((req.namespace, req.path))  # fmt: skip
        # Pages shared with a newer save, copied back without the lock: only for a copy that
        # will be served (not one older than the cluster's newest save).
        if (
            held is not None
            and state.visible(session, held, True)
            and (req.generation is not None or held.committed_ns >= floor)
        ):
            state.make_whole(held)
        known: Generation | None = None  # found to hold the newest save's content
        for _ in range(2):
            with state.lock.held():
                gen = state.lookup_visible_locked(
                    req.namespace, req.path, req.generation, session, load=True
                )
                if gen.committed_ns >= floor or gen is known:
                    state.check_not_corrupt(gen)
                    state.pin_locked(gen)
                    return gen
            # Outside the lock: a coordinator request. Checked again under it (a save here
            # may have committed meanwhile).
            if not self._same_content(gen, floor):
                break
            known = gen
        raise _Older(f"{req.path!r}: this node's copy is older than the newest save")

    def _same_content(self, gen: Generation, newest: int) -> bool:
        """Whether ``gen``, saved before the cluster's newest save (stamped ``newest``), holds
        the same bytes (data-parallel replicas saving one shard): served then, no copy made.
        Known only once both digests are (no hashing here; unknown is "no")."""
        assert self.remote is not None
        return gen.digests is not None and self.remote.same_content(gen, newest)

    def _newest(self, req: m.OpenRequest) -> int:
        """The stamp of the cluster's newest save of the path (0: none, or no cluster): no
        older copy is served. Unknowable while the coordinator is unreachable: raises
        CoordinatorUnavailable, unless the client accepts possibly-stale bytes."""
        from ckptcache.server.cluster.coord import CoordinatorUnavailable as Unreachable

        if self.remote is None:
            return 0
        try:
            return self.remote.newest(req.namespace, req.path)
        except Unreachable as e:
            if req.allow_stale:
                log.warning(
                    "load of %s: the coordinator is unreachable (%s); serving what "
                    "this node holds, which may be older (allow_stale)",
                    req.path,
                    e,
                )
                return 0
            raise CoordinatorUnavailable(
                f"cannot tell whether node {self.config.node_id!r} holds the newest save of "
                f"{req.path!r}: the coordinator is unreachable ({e}), and another node may have "
                "saved it since. Retry once the coordinator is back, or accept a possibly older "
                "copy with allow_stale=True (CKPTCACHE_ALLOW_STALE=1)"
            ) from e

    def _load_remote(
        self, namespace: str, path: str, timeout: float, newer_than: int = 0
    ) -> Generation:
        """A peer's copy or the group's storage read; without a cluster, this node's own
        storage read. Without a coordinator no holder can be found: CoordinatorUnavailable
        says so. ``newer_than``: the cluster's newest save's stamp, below which no copy
        will do (:class:`NewestUnavailable` when no reachable tier holds one)."""
        from ckptcache.server.cluster.coord import CoordinatorUnavailable as Unreachable

        if self.remote is None:
            return self._read_storage(namespace, path)
        try:
            return self.remote.load_remote(namespace, path, timeout=timeout,
                                           newer_than=newer_than)  # fmt: skip
        except Unreachable as e:
            raise CoordinatorUnavailable(
                f"{path!r} is not in the memory of node {self.config.node_id!r}, and the "
                f"coordinator is unreachable ({e}), so other nodes' memory cannot be searched "
                "for it; retry once the coordinator is back (a load reads it from storage if it "
                "was persisted)"
            ) from e

    def _read_storage(self, namespace: str, path: str) -> Generation:
        """Read ``path`` from storage into this node's memory (a daemon without a cluster),
        verified as it lands; one read per path at a time."""
        assert self.storage is not None
        with self._read_locks[hash((namespace, path)) % _READ_LOCKS]:
            held = self.state.find(namespace, path)
            if held is not None:
                return held  # a read (or a save) that finished while this one waited
            if not self.storage.in_storage(path):
                raise CheckpointNotFound(
                    f"{path!r} is neither in the memory of node {self.config.node_id!r} nor in "
                    "storage under its persist roots; check the path"
                )
            try:
                return self.storage.load(namespace, path, lambda: None)
            except NewerHeld:  # a save committed here while the copy arrived: it wins
                newer = self.state.find(namespace, path)
                if newer is None:
                    raise
                return newer

    def prefetch(self, session: Session, req: m.PrefetchRequest) -> m.PrefetchReply:
        """Warm this node's memory with ``path`` (peer or storage) without pinning it."""
        request = m.OpenRequest(req.namespace, req.path, timeout=req.timeout)
        reply = self.open(session, request, warm=True)
        self.release(session, m.ReleaseRequest((reply.lease,)))
        with self.state.lock.held():
            gen = self.state.lookup_visible_locked(req.namespace, req.path, None, session)
            return m.PrefetchReply(reply.tier, gen.size, gen.number)

    def release(self, session: Session, req: m.ReleaseRequest) -> None:
        """Drop leases (unknown ones are ignored: a release may race a reconnect); a staging
        copy goes with its lease."""
        with self.state.lock.held():
            for lease in req.leases:
                gen = session.leases.pop(lease, None)
                if gen is not None:
                    drop_lease_locked(self.state, lease, gen)

    def report_corrupt(self, session: Session, req: m.ReportCorruptRequest) -> None:
        """A client found bad bytes: drop that generation so nobody loads it again. Only a
        generation the client may load counts: another user's cannot be dropped this way."""
        with self.state.lock.held():
            self.state.lookup_visible_locked(
                req.namespace, req.path, req.generation, session, load=True
            )  # raises CheckpointNotFound
        self.retention.drop_corrupt(req.namespace, req.path, req.generation, req.detail)


class _Older(CheckpointNotFound):
    """This node's copy is older than the cluster's newest save: it is not served."""


def _tier_of(gen: Generation) -> Tier:
    """The tier a generation brought in by a remote load came from (one saved here while
    the load waited counts as local)."""
    if gen.origin == "storage":
        return Tier.STORAGE
    return Tier.PEER if gen.origin else Tier.LOCAL
