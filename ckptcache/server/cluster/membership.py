"""Cluster membership: the coordinator, this node's signed record, live nodes, dialling peers,
and what this node announces (holdings, copies in flight).

Call order: :meth:`Membership.publish` (once the data plane's address is known) ->
:meth:`Membership.join` -> everything else -> :meth:`Membership.close`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ckptcache.errors import CkptCacheError, ConfigError
from ckptcache.format.digest import digest_bytes, digest_hex
from ckptcache.format.manifest import object_digest
from ckptcache.server.cluster.coord import (
    CoordinatorUnavailable,
    NodeInfo,
    keys,
    make_coordinator,
    sign_node,
    verify_node,
)
from ckptcache.server.cluster.coord.counting import CountingCoordinator
from ckptcache.server.cluster.coord.records import HolderRecord, InFlightRecord, parse_all
from ckptcache.server.cluster.dataplane import DataPlaneClient, TLSConfig
from ckptcache.server.cluster.holdings import Holdings
from ckptcache.server.metrics import Metrics

if TYPE_CHECKING:
    from ckptcache.server.config import DaemonConfig
    from ckptcache.server.memory.index import Generation

__all__ = ["Membership", "path_hash"]

log = logging.getLogger(__name__)


def path_hash(namespace: str, path: str) -> str:
    """Key-safe name of a path in the coordinator."""
    return digest_hex(digest_bytes(f"{namespace}\0{path}".encode()))


class Membership:
    """Who is in the cluster, how to reach them, and what this node tells them."""

    def __init__(
        self,
        config: DaemonConfig,
        metrics: Metrics,
        ensure_digests: Callable[[Generation], list[int]],
    ):
        cfg = config
        self.config = cfg
        self.ensure_digests = ensure_digests
        self.holdings = Holdings()
        self.secret = cfg.cluster_secret()
        if cfg.listen and not self.secret:
            raise ConfigError(
                "a data plane (--listen) needs a shared secret: set secret, secret_file or "
                "CKPTCACHE_CLUSTER_SECRET on every node"
            )
        self.coord = CountingCoordinator(
            make_coordinator(cfg.coordinator, cluster=cfg.cluster, job=cfg.job, ttl=cfg.lease_ttl),
            lambda op: metrics.coordinator_requests.labels(op=op).inc(),
        )
        self.tls: TLSConfig | None = None
        tls_files = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        if any(tls_files):
            if not all(tls_files):
                raise ConfigError("TLS needs all of tls_cert, tls_key and tls_ca")
            self.tls = TLSConfig(*tls_files)  # type: ignore[arg-type]
        self.node = NodeInfo(cfg.node_id, cfg.host, "")
        self._ignored: set[tuple[str, str]] = set()
        self._live: list[NodeInfo] = []
        self._live_at = float("-inf")

    def publish(self, data_addr: str) -> None:
        """Set this node's data-plane address (signed with the cluster secret)."""
        cfg = self.config
        self.node = NodeInfo(cfg.node_id, cfg.host, data_addr)
        if self.secret:
            self.node = sign_node(self.node, self.secret, self.coord.prefix, time.time())

    def join(self) -> None:
        """Register this node's record under its lease."""
        self.coord.join(self.node)

    def close(self) -> None:
        """Leave (announcements end with the lease)."""
        try:
            self.coord.close()
        except CkptCacheError:
            pass

    # ----------------------------------------------------------------- nodes

    def live_nodes(self, max_age: float = 0.5) -> list[NodeInfo]:
        """Live nodes, from a view refreshed at most every ``max_age`` seconds.

        Saves consult membership on their path (backup placement); one etcd round trip per
        half second instead of several per save keeps the coordinator off the stall.
        """
        now = time.monotonic()
        if now - self._live_at > max_age:
            self._live = [n for n in self.coord.live_nodes() if self._trusted(n)]
            self._live_at = now
        return self._live

    def _trusted(self, node: NodeInfo) -> bool:
        """Whether a node record was signed with the cluster secret (logged once if not):
        whoever can write to the coordinator without the secret must not be dialled."""
        if self.secret is None or verify_node(node, self.secret, self.coord.prefix):
            return True
        if (node.node_id, node.sig) not in self._ignored:
            self._ignored.add((node.node_id, node.sig))
            why = "forged signature" if node.sig else "unsigned"
            log.error("ignored node record %r (data plane %s): %s", node.node_id,
                      node.data_addr or "-", why)  # fmt: skip
        return False

    def node_ids(self) -> tuple[str, ...]:
        """Live node ids (empty when the coordinator is unreachable)."""
        try:
            return tuple(n.node_id for n in self.live_nodes())
        except CoordinatorUnavailable:
            return ()

    def dial(self, node: NodeInfo, timeout: float = 300.0) -> DataPlaneClient:
        """An authenticated connection to ``node``, which must prove it is that node."""
        assert self.secret is not None
        return DataPlaneClient(node.data_addr, self.secret, timeout, self.tls,
                               node_id=self.node.node_id, expect=node.node_id,
                               dead_peer=self.config.dead_peer_timeout)  # fmt: skip

    def backup_targets(self, exclude: set[str]) -> list[NodeInfo]:
        """Where backup copies go: the ring of live nodes after this one, never this host."""
        mode = self.config.backup
        if mode == "none":
            return []
        live = self.live_nodes()
        me = self.node.node_id
        if mode == "auto":
            ids = sorted({n.node_id for n in live} | {me})
            after = ids[ids.index(me) + 1 :] + ids[: ids.index(me)]
            by_id = {n.node_id: n for n in live}
            ordered = [by_id[i] for i in after if i in by_id]
            candidates = [n for n in ordered if n.host != self.node.host]
        else:
            wanted = [x.strip() for x in mode.split(",") if x.strip()]
            by_id = {n.node_id: n for n in live}
            candidates = [by_id[i] for i in wanted if i in by_id and i != me]
        return [n for n in candidates if n.data_addr and n.node_id not in exclude]

    # ----------------------------------------------------------------- announcements

    def holders(self, namespace: str, path: str, newer_than: int = 0) -> list[NodeInfo]:
        """Live nodes announcing a copy of ``path`` (newest commit first); with
        ``newer_than``, only holdings of a save stamped at least that (ns), never a copy
        in flight (its record names no stamp)."""
        ph = path_hash(namespace, path)
        scanned = self.coord.scan(keys.holders_prefix(ph))
        if newer_than:
            held = parse_all(HolderRecord, {k: v for k, v in scanned.items()
                                            if keys.digest_of(k) != keys.INFLIGHT})  # fmt: skip
            scanned = {k: scanned[k] for k, h in held.items() if h.committed_ns >= newer_than}
        # Holdings and copies in flight alike: both name a node and a time, ranked together.
        entries = parse_all(InFlightRecord, scanned)
        live = {n.node_id: n for n in self.live_nodes()}
        if any(v.node not in live for v in entries.values()):
            # A holder that joined after this node's cached view was read (up to max_age
            # ago) would be skipped although its copy is acknowledged: read the view anew.
            live = {n.node_id: n for n in self.live_nodes(max_age=0.0)}
        ranked = sorted(entries.values(), key=lambda v: -v.committed)
        seen: list[NodeInfo] = []
        for v in ranked:
            node = live.get(v.node)
            if node is not None and node not in seen and node.data_addr:
                seen.append(node)
        return seen

    def announce(self, gen: Generation) -> tuple[str, str]:
        """Announce that this node holds ``gen``; returns its (path hash, object digest)."""
        digest = object_digest(self.ensure_digests(gen))
        ph = path_hash(gen.namespace, gen.path)
        me = self.node.node_id
        # origin: for a backup copy, whose save it is.
        record = HolderRecord(me, gen.path, gen.number, gen.committed, gen.origin,
                              gen.committed_ns, gen.seen_ns)  # fmt: skip
        key = keys.holder_key(ph, digest, me)
        self.holdings.announce(key, gen, lambda: self.coord.announce(key, record.to_dict()))
        return ph, digest

    def withdraw(self, key: str) -> None:
        """Withdraw one of this node's keys (an unreachable coordinator ends it with the lease)."""
        try:
            self.coord.withdraw(key)
        except CoordinatorUnavailable:
            pass

    def release(self, *keys: str) -> None:
        """Give up the roles ``keys`` if this node holds them (never another node's; an
        unreachable coordinator ends them with the lease)."""
        for key in keys:
            try:
                self.coord.release(key)
            except CoordinatorUnavailable:
                pass

    def withdraw_holding(self, gen: Generation) -> None:
        """``gen`` left this node: withdraw its holding in the background."""
        threading.Thread(target=self.withdraw_held, args=(gen,), daemon=True).start()

    def withdraw_held(self, gen: Generation) -> None:
        """Withdraw the holding of ``gen`` (which left this node), unless its key speaks for
        a newer generation of the same content by now (:mod:`.holdings`)."""
        digests = gen.digests
        if digests is None:
            return
        key = keys.holder_key(
            path_hash(gen.namespace, gen.path), object_digest(digests), self.node.node_id
        )
        self.holdings.withdraw(key, gen, lambda: self.withdraw(key))

    @contextlib.contextmanager
    def in_flight(self, ph: str) -> Iterator[Callable[[], None]]:
        """Yield ``announce()``: called once bytes start landing here, it tells later joiners
        to chain behind this node (holders are tried newest first) and take the bytes as
        they land. The announcement is withdrawn when the transfer ends either way."""
        key = keys.inflight_key(ph, self.node.node_id)

        def announce() -> None:
            self.coord.announce(key, InFlightRecord(self.node.node_id, time.time()).to_dict())

        try:
            yield announce
        finally:
            self.withdraw(key)
