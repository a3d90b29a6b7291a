"""Many nodes: the cluster facade that composes membership, replication, peer fetches, the
group's storage read, remote load and the persist election.

Lifecycle of a committed generation on a cluster node::

    committed -> digested -> holding announced (holders/<path>/<digest>/<node>)
              -> pushed to backup nodes (sync for durability="backup", else in background);
                 a backup node announces its holding before it acknowledges the push
              -> persister claims: persisted record exists  -> done, nothing written
                                   won the group election   -> representative: persist, record
                                   lost                      -> standby: watch the group
    standby   -> record appears     -> persisted (nothing written)
              -> representative gone (lease expired / failed) -> claim again (takeover)

A redundancy group is (path, object digest): the nodes holding identical content of a path.
Representatives are preferred by rendezvous hash (so groups spread over nodes) and made
unique by etcd's create-if-absent under the node lease. A node cut off from etcd stops
claiming (its lease is unhealthy); its old group may be taken over, and since every member of
a group holds identical bytes, a late write by the old representative cannot conflict.
Different contents of one path saved on different nodes at the same time (neither save had
seen the other when it began) are a digest disagreement: reported loudly on both; the newer
takes the path and every other content is persisted beside it as ``<path>.conflict-<digest>``
so nothing is silently dropped. The newest save of a path, whichever node made it, is one
answer for the whole cluster (:mod:`ckptcache.server.cluster.truth`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptcache.errors import ProtocolMismatch
from ckptcache.server.cluster import clock
from ckptcache.server.cluster.coord import CoordinatorUnavailable
from ckptcache.server.cluster.dataplane import Channel, ConnectionLimits, DataPlaneServer, send_msg
from ckptcache.server.cluster.election import Election
from ckptcache.server.cluster.membership import Membership, path_hash
from ckptcache.server.cluster.replication import Replication
from ckptcache.server.cluster.stripes import auto_streams
from ckptcache.server.cluster.truth import Truth
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.persist.states import PersistState
from ckptcache.server.restore import remote_load
from ckptcache.server.restore.fetching import Fetching
from ckptcache.server.restore.storage_read import StorageReader
from ckptcache.server.state import CacheState, Incoming
from ckptcache.storage import StorageOptions
from ckptcache.wire import peer

if TYPE_CHECKING:
    from ckptcache.server.config import DaemonConfig
    from ckptcache.server.memory.index import Generation

__all__ = ["Cluster", "ClusterPorts", "path_hash"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterPorts:
    """What the cluster needs from the rest of the daemon, and nothing more.

    ``receive`` is :meth:`ckptcache.server.ingest.Ingest.receive`; ``ensure_digests``
    :meth:`ckptcache.server.persist.digester.Digester.ensure`; ``drop_corrupt``
    :meth:`ckptcache.server.memory.retention.Retention.drop_corrupt`; ``mark_persisted`` and
    ``resubmit`` are the persister's (a standby's group was persisted / its representative
    is gone).
    """

    receive: Callable[[Incoming], Generation]
    ensure_digests: Callable[[Generation], list[int]]
    drop_corrupt: Callable[[str, str, int, str], None]
    mark_persisted: Callable[[Generation], None]
    resubmit: Callable[[Generation], None]
    roots: PersistRoots
    options: StorageOptions


def _typed(
    cls: type[Any], handler: Callable[[Channel, Any], None]
) -> Callable[[Channel, dict[str, Any]], None]:
    """A data-plane handler taking the raw request, decoding it into ``cls`` first; a
    malformed request is refused with ProtocolMismatch naming the bad field."""

    def handle(conn: Channel, raw: dict[str, Any]) -> None:
        try:
            request = peer.decode_request(raw)
            if not isinstance(request, cls):
                raise ProtocolMismatch(f"expected a {cls.OP!r} request")
        except ProtocolMismatch as e:
            send_msg(conn, peer.refusal(e))
            return
        handler(conn, request)

    return handle


class Cluster:
    """This node's part in the cluster (see the module docstring for the lifecycle).

    Built by the daemon after the local parts; call order: :meth:`start` (join, announce
    what recovery found), then the hooks :meth:`on_commit` / :meth:`on_retire`,
    :meth:`load_remote` for loads, and the persister's calls to :attr:`election` (a
    :class:`~ckptcache.server.persist.persister.PersistElection`); :meth:`stop`.
    """

    def __init__(self, config: DaemonConfig, state: CacheState, ports: ClusterPorts):
        cfg = config
        self.config = cfg
        self.state = state
        self.metrics = state.metrics
        self._stop = threading.Event()
        self.membership = Membership(cfg, state.metrics, ports.ensure_digests)
        #: The cluster's newest save of each path (read at save and load, put at commit).
        self.truth = Truth(self.membership, self._stop)
        self.replication = Replication(
            cfg, state, self.membership, ensure_digests=ports.ensure_digests,
            receive=ports.receive,
        )  # fmt: skip
        self.fetching = Fetching(
            state, self.membership, ensure_digests=ports.ensure_digests, receive=ports.receive,
            drop_corrupt=ports.drop_corrupt, streams=auto_streams(cfg.data_plane_streams),
            incremental=cfg.incremental_push,
        )  # fmt: skip
        self.storage = StorageReader(
            cfg, state.metrics, roots=ports.roots, options=ports.options, receive=ports.receive
        )
        self.election = Election(
            cfg, state, self.membership, self.fetching, metrics=state.metrics,
            protect=self.replication.protect, mark_persisted=ports.mark_persisted,
            truth=self.truth,
            resubmit=ports.resubmit, stop=self._stop,
        )  # fmt: skip
        self.sources = remote_load.Sources(
            state, self.membership, self.fetching, self.storage, state.metrics,
            remote_load.Settling(self.membership),
        )  # fmt: skip
        self.clocks = clock.ClockWatch(
            self.membership, state.metrics, bound=cfg.clock_offset_bound,
            interval=cfg.clock_check_interval, stop=self._stop,
        )  # fmt: skip
        self.server: DataPlaneServer | None = None
        if cfg.listen:
            secret = self.membership.secret
            assert secret is not None
            self.server = DataPlaneServer(
                cfg.listen, secret, {  # one handler per message kind
                    peer.PushRequest.OP: _typed(peer.PushRequest, self.replication.on_push),
                    peer.PushStripe.OP: _typed(peer.PushStripe, self.replication.on_push_stripe),
                    peer.FetchRequest.OP: _typed(peer.FetchRequest, self.fetching.on_fetch),
                    peer.FetchStripe.OP: _typed(peer.FetchStripe, self.fetching.on_fetch_stripe),
                    peer.RelayStripe.OP: _typed(peer.RelayStripe, self.fetching.on_relay_stripe),
                    peer.CorruptReport.OP: _typed(peer.CorruptReport, self.fetching.on_corrupt),
                    clock.OP: clock.on_probe,
                },
                tls=self.membership.tls, node_id=cfg.node_id,
                limits=ConnectionLimits(cfg.handshake_timeout, cfg.max_peer_connections,
                                        cfg.max_unauthenticated_peers, cfg.dead_peer_timeout),
            )  # fmt: skip
        self.membership.publish(self.server.address if self.server else "")

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Join the cluster and start the background workers."""
        if self.server is not None:
            self.server.start()
        self.membership.join()
        self.replication.start()
        threading.Thread(target=self._monitor, name="cluster-monitor", daemon=True).start()
        threading.Thread(target=self.storage.warm, name="storage-warm", daemon=True).start()
        if self.server is not None:  # peers are dialled over the data plane: none without
            self.clocks.start()
        # Recovered after a restart: announce them, and re-protect those not on storage yet.
        # A persisted one is safe already; pushing it again (its origin, if it was a backup
        # copy, is not recorded) would send what the peers hold and read every page of it.
        for gen in self.state.generations():
            self.replication.protect(gen, announce_only=gen.persist_state == PersistState.PERSISTED)
        node = self.membership.node
        log.info("joined cluster %s as %s (data plane %s)", self.config.cluster,
                 node.node_id, node.data_addr or "off")  # fmt: skip

    def stop(self) -> None:
        """Leave the cluster (announcements end with the lease)."""
        self._stop.set()
        self.replication.stop()
        if self.server is not None:
            self.server.close()
        self.membership.close()

    def _monitor(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.election.check_standbys()
                self.replication.check_replicas()
            except CoordinatorUnavailable as e:
                log.debug("coordinator unavailable: %s", e)
            except Exception:
                log.exception("cluster monitor")

    # ----------------------------------------------------------------- the daemon's calls

    def node_ids(self) -> tuple[str, ...]:
        """Live node ids (empty when the coordinator is unreachable)."""
        return self.membership.node_ids()

    def on_commit(self, gen: Generation, durability: str) -> None:
        """A generation was committed here: a save of this node becomes the cluster's newest
        save of its path before the save returns (:meth:`Truth.publish`), then its backup
        copies (:meth:`Replication.on_commit`)."""
        if not gen.origin:
            # A save that asked for a backup or storage waits a lease's time for its record
            # (its durability needs the cluster anyway); others return through an outage.
            patience = self.config.lease_ttl if durability in ("backup", "persisted") else 0.0
            self.truth.publish(gen, patience)
        self.replication.on_commit(gen, durability)

    def on_retire(self, gen: Generation) -> None:
        """A generation left this node's index: withdraw its holding (in the background)."""
        self.membership.withdraw_holding(gen)

    def newest(self, namespace: str, path: str) -> int:
        """The stamp of the cluster's newest save of ``path`` (0: none recorded); raises
        :class:`CoordinatorUnavailable`."""
        newest = self.truth.newest(namespace, path)
        return newest.committed_ns if newest is not None else 0

    def newest_if_known(self, namespace: str, path: str) -> int | None:
        """:meth:`newest`, ``None`` while the coordinator is unreachable."""
        try:
            return self.newest(namespace, path)
        except CoordinatorUnavailable:
            return None

    def same_content(self, gen: Generation, stamp: int) -> bool:
        """Whether a holder announces the save stamped ``stamp`` with ``gen``'s content (one
        scan of the path's holders; called with ``gen``'s digests known)."""
        return self.truth.holds(gen, stamp)

    def load_remote(
        self, namespace: str, path: str, timeout: float = 120.0, newer_than: int = 0
    ) -> Generation:
        """Bring ``path`` into this node's memory from the cheapest remote tier.

        Peers first (any live holder, newest commit first; a corrupt copy is reported to its
        holder and the next one is tried). Else storage, read once per group: concurrent
        loaders elect one reader (``loads/<path>``), the others fetch from the first holder
        that appears; if the reader dies its lease ends and another member takes over.
        Planned, then executed: :mod:`ckptcache.server.restore.remote_load`. ``newer_than``: only a
        copy of a save stamped at least that (ns), the cluster's newest, will do.
        """
        return remote_load.load_remote(self.sources, namespace, path, timeout, newer_than)
