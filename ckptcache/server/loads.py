"""Loads: pin a generation for a client, from this node's memory or a remote tier.

Call order (per load, see :mod:`ckptcache.wire.messages`)::

    loads.open(session, OpenRequest)        -> generation pinned (local, else peer/storage)
    loads.release(session, ReleaseRequest)  -> pin dropped
    loads.prefetch(session, PrefetchRequest) = open + release (warms this node's memory)

A miss goes to the :class:`RemoteTier` (the cluster's remote load), when there is one.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from ckptcache.errors import CheckpointNotFound
from ckptcache.server.config import DaemonConfig
from ckptcache.server.digester import Digester
from ckptcache.server.index import Generation
from ckptcache.server.retention import Retention
from ckptcache.server.state import CacheState, Session, bounded
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

__all__ = ["Loads", "RemoteTier"]

log = logging.getLogger(__name__)


class RemoteTier(Protocol):
    """Where a miss is loaded from: a peer's memory or the group's storage read."""

    def load_remote(self, namespace: str, path: str, timeout: float) -> Generation:
        """Bring ``path`` into this node's memory (raises :class:`CheckpointNotFound`)."""


class Loads:
    """Serves loads: pins, leases and the tier each load came from."""

    def __init__(
        self,
        config: DaemonConfig,
        state: CacheState,
        *,
        digester: Digester,
        retention: Retention,
        remote: RemoteTier | None,
    ):
        self.config = config
        self.state = state
        self.metrics = state.metrics
        self.digester = digester
        self.retention = retention
        self.remote = remote

    def open(self, session: Session, req: m.OpenRequest) -> m.OpenReply:
        """Pin a generation for a load and say where it lies."""
        state = self.state
        t0 = time.perf_counter()
        tier = Tier.LOCAL
        try:
            with state.locked():
                gen = state.lookup_visible_locked(
                    req.namespace, req.path, req.generation, session, load=True
                )
                state.check_not_corrupt(gen)
                state.pin_locked(gen)
        except CheckpointNotFound:
            if self.remote is None or req.generation is not None:
                raise
            with state.locked():
                held = state.index.generations((req.namespace, req.path))
            if held:
                raise  # held by another user: never replaced by a remote copy for this one
            gen = self._load_remote(req.namespace, req.path, bounded(120.0, req.timeout))
            tier = Tier.STORAGE if gen.origin == "storage" else Tier.PEER
            with state.locked():
                if gen.removed:  # evicted or replaced since it arrived: serve what is here now
                    gen = state.lookup_visible_locked(req.namespace, req.path, None, session,
                                                      load=True)  # fmt: skip
                    state.check_not_corrupt(gen)
                    tier = Tier.LOCAL
                if not state.visible(session, gen, True):
                    raise state.not_found(req.namespace, req.path, None) from None
                state.pin_locked(gen)
        try:
            if req.need_digests and gen.digests is None:
                self.digester.compute(gen)
        except BaseException:
            state.unpin(gen)
            raise
        with state.locked():
            lease = state.next_id()
            session.leases[lease] = gen
            header = gen.segment.read_header()
            gen.last_load_tier = tier
            self.metrics.loads.labels(tier=tier).inc()
            self.metrics.bytes_loaded.labels(tier=tier).inc(gen.size)
        self.metrics.load_latency.observe(time.perf_counter() - t0)
        log.debug("load of %s served from the %s tier", gen.path, tier)
        return m.OpenReply(
            lease, gen.segment.name, gen.segment.capacity, gen.number, header.manifest_offset,
            header.manifest_size, header.digest_offset, header.n_storages, gen.digests is not None,
            tier,
        )  # fmt: skip

    def _load_remote(self, namespace: str, path: str, timeout: float) -> Generation:
        """A peer's copy or the group's storage read; without a coordinator neither can be
        found, and the client reads storage itself (CheckpointNotFound says so)."""
        from ckptcache.server.coord import CoordinatorUnavailable

        assert self.remote is not None
        try:
            return self.remote.load_remote(namespace, path, timeout=timeout)
        except CoordinatorUnavailable as e:
            raise CheckpointNotFound(
                f"{path!r} is not in the memory of node {self.config.node_id!r} and the "
                f"coordinator is unreachable ({e}): read it from storage"
            ) from e

    def prefetch(self, session: Session, req: m.PrefetchRequest) -> m.PrefetchReply:
        """Warm this node's memory with ``path`` (peer or storage) without pinning it."""
        reply = self.open(session, m.OpenRequest(req.namespace, req.path, timeout=req.timeout))
        self.release(session, m.ReleaseRequest((reply.lease,)))
        with self.state.locked():
            gen = self.state.lookup_visible_locked(req.namespace, req.path, None, session)
            return m.PrefetchReply(reply.tier, gen.size, gen.number)

    def release(self, session: Session, req: m.ReleaseRequest) -> None:
        """Drop leases (unknown ones are ignored: a release may race a reconnect)."""
        with self.state.locked():
            for lease in req.leases:
                gen = session.leases.pop(lease, None)
                if gen is not None:
                    self.state.unpin_locked(gen)

    def report_corrupt(self, session: Session, req: m.ReportCorruptRequest) -> None:
        """A client found bad bytes: drop that generation so nobody loads it again. Only a
        generation the client may load counts: another user's cannot be dropped this way."""
        with self.state.locked():
            self.state.lookup_visible_locked(
                req.namespace, req.path, req.generation, session, load=True
            )  # raises CheckpointNotFound
        self.retention.drop_corrupt(req.namespace, req.path, req.generation, req.detail)
