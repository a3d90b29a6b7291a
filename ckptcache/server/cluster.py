"""Many nodes: backup copies over the data plane, redundancy groups, representative election.

Lifecycle of a committed generation on a cluster node::

    committed -> digested -> holding announced (holders/<path>/<digest>/<node>)
              -> pushed to backup nodes (sync for durability="backup", else in background)
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
Different contents of one path saved within ``conflict_window`` are a digest disagreement:
reported loudly; the first persisted content takes the path and every other content is
persisted beside it as ``<path>.conflict-<digest>`` so nothing is silently dropped.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ckptcache.errors import (
    CheckpointNotFound,
    CkptCacheError,
    ConfigError,
    CorruptCheckpoint,
    ReplicationError,
)
from ckptcache.format.archive import count_records, parse_archive
from ckptcache.format.digest import digest_bytes, digest_hex
from ckptcache.format.layout import HEADER_SIZE, plan_segment
from ckptcache.format.manifest import Manifest, manifest_from_archive, object_digest, pack_digests
from ckptcache.server import remote_load
from ckptcache.server.coord import (
    CoordinatorUnavailable,
    NodeInfo,
    make_coordinator,
    sign_node,
    verify_node,
)
from ckptcache.server.coord.counting import CountingCoordinator
from ckptcache.server.dataplane import (
    Channel,
    ConnectionLimits,
    DataPlaneClient,
    DataPlaneServer,
    TLSConfig,
    recv_msg,
    send_msg,
)
from ckptcache.server.storage_read import read_archive
from ckptcache.server.transfer import (
    receive_object,
    receive_relayed,
    relay_in_flight,
    send_object,
)
from ckptcache.storage import backend_for
from ckptcache.wire.states import ClaimRole, Tier

if TYPE_CHECKING:
    from ckptcache.server.core import CacheCore
    from ckptcache.server.index import Generation

__all__ = ["Cluster"]

log = logging.getLogger(__name__)


def path_hash(namespace: str, path: str) -> str:
    """Key-safe name of a path in the coordinator."""
    return digest_hex(digest_bytes(f"{namespace}\0{path}".encode()))


def _check_skeleton(view: memoryview, manifest: Manifest, expected: int) -> None:
    """The skeleton that arrived (``view`` starts at the payload) against the sender's digest."""
    start = manifest.pickle_offset - HEADER_SIZE
    got = digest_bytes(view[start : start + manifest.pickle_size])
    if expected and got != expected:
        raise CorruptCheckpoint(
            f"skeleton (pickle) of {manifest.path!r} arrived with digest {digest_hex(got)}, "
            f"expected {digest_hex(expected)}",
            tensor="<skeleton>",
            tier=Tier.PEER,
        )


class Cluster:
    """This node's view of the cluster: coordinator, data plane, replication, elections."""

    def __init__(self, core: CacheCore):
        cfg = core.config
        self.core = core
        self.config = cfg
        self.secret = cfg.cluster_secret()
        if cfg.listen and not self.secret:
            raise ConfigError(
                "a data plane (--listen) needs a shared secret: set secret, secret_file or "
                "CKPTCACHE_CLUSTER_SECRET on every node"
            )
        self.coord = CountingCoordinator(
            make_coordinator(cfg.coordinator, cluster=cfg.cluster, job=cfg.job, ttl=cfg.lease_ttl),
            lambda op: core.metrics.coordinator_requests.labels(op=op).inc(),
        )
        self.tls: TLSConfig | None = None
        tls_files = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        if any(tls_files):
            if not all(tls_files):
                raise ConfigError("TLS needs all of tls_cert, tls_key and tls_ca")
            self.tls = TLSConfig(*tls_files)  # type: ignore[arg-type]
        self.server: DataPlaneServer | None = None
        if cfg.listen:
            assert self.secret is not None
            self.server = DataPlaneServer(
                cfg.listen, self.secret,
                {"push": self._on_push, "fetch": self._on_fetch, "corrupt": self._on_corrupt},
                tls=self.tls, node_id=cfg.node_id,
                limits=ConnectionLimits(cfg.handshake_timeout, cfg.max_peer_connections,
                                        cfg.max_unauthenticated_peers),
            )  # fmt: skip
        self.node = NodeInfo(cfg.node_id, cfg.host, self.server.address if self.server else "")
        if self.secret:
            self.node = sign_node(self.node, self.secret, self.coord.prefix, time.time())
        self._ignored: set[tuple[str, str]] = set()
        self._work: queue.Queue[Generation | None] = queue.Queue()
        self._standby: dict[Generation, tuple[str, str]] = {}
        self._live: list[NodeInfo] = []
        self._live_at = float("-inf")
        self._stop = threading.Event()
        core.cluster = self
        core.on_commit.append(self._on_commit)
        core.on_retire.append(self._on_retire)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Join the cluster and start the background workers."""
        if self.server is not None:
            self.server.start()
        self.coord.join(self.node)
        for target, name in ((self._worker, "replicate"), (self._monitor, "cluster-monitor")):
            threading.Thread(target=target, name=name, daemon=True).start()
        with self.core.cond:
            gens = [g for g in self.core.index]
        for gen in gens:  # recovered after a restart: announce and re-protect them
            self._work.put(gen)
        log.info("joined cluster %s as %s (data plane %s)", self.config.cluster,
                 self.node.node_id, self.node.data_addr or "off")  # fmt: skip

    def stop(self) -> None:
        """Leave the cluster (announcements end with the lease)."""
        self._stop.set()
        self._work.put(None)
        if self.server is not None:
            self.server.close()
        try:
            self.coord.close()
        except CkptCacheError:
            pass

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

    def _dial(self, node: NodeInfo, timeout: float = 300.0) -> DataPlaneClient:
        """An authenticated connection to ``node``, which must prove it is that node."""
        assert self.secret is not None
        return DataPlaneClient(node.data_addr, self.secret, timeout, self.tls,
                               node_id=self.node.node_id, expect=node.node_id)  # fmt: skip

    def node_ids(self) -> tuple[str, ...]:
        """Live node ids (empty when the coordinator is unreachable)."""
        try:
            return tuple(n.node_id for n in self.live_nodes())
        except CoordinatorUnavailable:
            return ()

    # ----------------------------------------------------------------- placement

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

    # ----------------------------------------------------------------- replication

    def _on_commit(self, gen: Generation, durability: str) -> None:
        if durability == "backup" and not gen.origin:
            if self.config.backup == "none":
                raise ReplicationError(
                    "durability='backup' needs backup nodes: start the daemons with --backup "
                    "auto (or a list) and a shared --coordinator"
                )
            self.replicate(gen)
        self._work.put(gen)

    def _on_retire(self, gen: Generation) -> None:
        digests = gen.digests
        if digests is None:
            return
        key = f"holders/{path_hash(gen.namespace, gen.path)}/{object_digest(digests)}/"
        threading.Thread(
            target=self._withdraw, args=(key + self.node.node_id,), daemon=True
        ).start()

    def _withdraw(self, key: str) -> None:
        try:
            self.coord.withdraw(key)
        except CoordinatorUnavailable:
            pass

    def replicate(self, gen: Generation) -> None:
        """Bring ``gen`` up to the configured number of backup copies (raises when none can be
        made)."""
        try:
            live = {n.node_id for n in self.live_nodes()}
            with self.core.cond:
                gen.replicas &= live
                need = self.config.replicas - len(gen.replicas)
            if need <= 0:
                return
            targets = self.backup_targets(exclude=set(gen.replicas))
        except CoordinatorUnavailable as e:
            raise ReplicationError(
                f"no backup copy of {gen.path!r}: the coordinator is unreachable, so no "
                f"backup node can be chosen ({e}); the local copy is kept"
            ) from e
        if not targets:
            raise ReplicationError(
                f"no live backup node for {gen.path!r} (live: {sorted(live)}); the local copy "
                "is kept"
            )
        errors = []
        for target in targets:
            if need <= 0:
                break
            try:
                self._push(gen, target)
            except (OSError, CkptCacheError) as e:
                errors.append(f"{target.node_id}: {e}")
                continue
            with self.core.cond:
                gen.replicas.add(target.node_id)
            need -= 1
        if need > 0:
            raise ReplicationError(f"backup copy of {gen.path!r} failed: {'; '.join(errors)}")

    def _push(self, gen: Generation, target: NodeInfo) -> None:
        with self.core.cond:
            if self.core.index.get(gen.key, gen.number) is not gen:
                return  # retired meanwhile: nothing to protect
            self.core.pin(gen)
        try:
            t0 = time.perf_counter()
            header = gen.segment.read_header()
            nbytes = header.digest_offset + 8 * header.n_storages
            with self._dial(target) as peer:
                t1 = time.perf_counter()
                send_msg(peer.channel, {
                    "op": "push", "namespace": gen.namespace, "path": gen.path,
                    "nbytes": nbytes, "manifest_offset": header.manifest_offset,
                    "manifest_size": header.manifest_size, "origin": self.node.node_id,
                    "manifest": gen.manifest.to_json().decode(),
                    "skeleton_digest": header.skeleton_digest, "committed": gen.committed,
                })  # fmt: skip
                ready = recv_msg(peer.channel)
                if not ready.get("ok"):
                    raise ReplicationError(f"{target.node_id} refused: {ready.get('message')}")
                t2 = time.perf_counter()
                send_object(peer.channel, gen, lambda: self.core.ensure_digests(gen))
                t3 = time.perf_counter()
                done = recv_msg(peer.channel)
                t4 = time.perf_counter()
                log.debug("push of %s: connect %.3fs reserve %.3fs send %.3fs commit %.3fs",
                          gen.path, t1 - t0, t2 - t1, t3 - t2, t4 - t3)  # fmt: skip
                if not done.get("ok"):
                    raise ReplicationError(f"{target.node_id} rejected: {done.get('message')}")
            log.info("backup copy of %s generation %d on %s", gen.path, gen.number, target.node_id)
        finally:
            self.core.unpin(gen)

    def _on_push(self, conn: Channel, req: dict[str, Any]) -> None:
        try:
            saved_at = float(req.get("committed") or time.time())
            gen = self._receive(conn, req, conn.peer_id, ready=True,  # the proven sender
                                saved_at=saved_at)  # fmt: skip
        except (CkptCacheError, KeyError, ValueError) as e:
            send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
            raise ConnectionError(f"push refused: {e}") from e
        send_msg(conn, {"ok": True, "generation": gen.number})
        self._work.put(gen)

    def _receive(
        self,
        conn: Channel,
        head: dict[str, Any],
        origin: str,
        *,
        ready: bool,
        started: Callable[[], None] | None = None,
        saved_at: float | None = None,
        persisted: bool = False,
    ) -> Generation:
        """Receive one streamed object (see :mod:`ckptcache.server.transfer`) and commit it;
        ``persisted``: the sender's copy is the one stored at the path (nothing to write)."""
        namespace, path = str(head["namespace"]), str(head["path"])
        nbytes, mo, ms = (
            int(head["nbytes"]),
            int(head["manifest_offset"]),
            int(head["manifest_size"]),
        )
        manifest = Manifest.from_json(str(head["manifest"]).encode(), segment_size=nbytes)
        digest_offset = nbytes - 8 * len(manifest.storages)
        verified: list[int] = []

        def fill(view: memoryview, advance: Callable[[int], None]) -> None:
            if started is not None:
                started()
            if ready:
                send_msg(conn, {"ok": True})  # reserved: the sender may stream the bytes
            verified.extend(receive_object(conn, view, manifest, digest_offset, advance))
            _check_skeleton(view, manifest, int(head.get("skeleton_digest") or 0))

        return self.core.receive(namespace, path, nbytes, mo, ms, fill, origin=origin,
                                 digests=lambda: verified, saved_at=saved_at,
                                 persisted=persisted)  # fmt: skip

    def _on_fetch(self, conn: Channel, req: dict[str, Any]) -> None:
        try:
            key = (str(req["namespace"]), str(req["path"]))
            with self.core.cond:
                flight = self.core.inflight.get(key)
                if flight is None:
                    gen = self.core._lookup(*key)
                    self.core.check_not_corrupt(gen)
                    self.core.pin(gen)
        except (CkptCacheError, KeyError) as e:
            send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
            return
        if flight is not None:  # still arriving here: relay it chunk by chunk (pipelined)
            log.info("relaying %s to a peer while it arrives", key[1])
            send_msg(conn, {
                "ok": True, "relay": True, "nbytes": flight.nbytes, "namespace": key[0],
                "path": key[1], "manifest_offset": flight.manifest_offset,
                "manifest_size": flight.manifest_size, "persisted": flight.persisted,
            })  # fmt: skip
            relay_in_flight(conn, self.core, flight)
            return
        try:
            header = gen.segment.read_header()
            nbytes = header.digest_offset + 8 * header.n_storages
            send_msg(conn, {
                "ok": True, "nbytes": nbytes, "manifest_offset": header.manifest_offset,
                "manifest_size": header.manifest_size, "generation": gen.number,
                "namespace": gen.namespace, "path": gen.path,
                "manifest": gen.manifest.to_json().decode(),
                "skeleton_digest": header.skeleton_digest, "persisted": gen.persisted,
            })  # fmt: skip
            send_object(conn, gen, lambda: self.core.ensure_digests(gen))
        finally:
            self.core.unpin(gen)

    def _fetch_from(
        self, node: NodeInfo, namespace: str, path: str, started: Callable[[], None]
    ) -> Generation:
        with self._dial(node) as peer:
            send_msg(peer.channel, {"op": "fetch", "namespace": namespace, "path": path})
            head = recv_msg(peer.channel)
            if not head.get("ok"):
                if head.get("error") == "CheckpointNotFound":
                    raise CheckpointNotFound(f"{node.node_id}: {head.get('message')}")
                raise ReplicationError(f"{node.node_id}: {head.get('message')}")
            if (head.get("namespace"), head.get("path")) != (namespace, path):
                raise ReplicationError(f"{node.node_id} answered for another path")
            if head.get("relay"):

                def fill(view: memoryview, advance: Callable[[int], None]) -> None:
                    started()
                    receive_relayed(peer.channel, view, advance)

                return self.core.receive(
                    namespace, path, int(head["nbytes"]), int(head["manifest_offset"]),
                    int(head["manifest_size"]), fill, origin=node.node_id,
                    persisted=head.get("persisted") is True,  # stored bytes: not written back
                )  # fmt: skip
            return self._receive(peer.channel, head, node.node_id, ready=False, started=started,
                                 persisted=head.get("persisted") is True)  # fmt: skip

    # ----------------------------------------------------------------- tiered load

    def load_remote(self, namespace: str, path: str, timeout: float = 120.0) -> Generation:
        """Bring ``path`` into this node's memory from the cheapest remote tier.

        Peers first (any live holder, newest commit first; a corrupt copy is reported to its
        holder and the next one is tried). Else storage, read once per group: concurrent
        loaders elect one reader (``loads/<path>``), the others fetch from the first holder
        that appears; if the reader dies its lease ends and another member takes over.
        Planned, then executed: :mod:`ckptcache.server.remote_load`.
        """
        return remote_load.load_remote(self, namespace, path, timeout)

    @contextlib.contextmanager
    def _in_flight(self, ph: str) -> Iterator[Callable[[], None]]:
        """Yield ``announce()``: called once bytes start landing here, it tells later joiners
        to chain behind this node (holders are tried newest first) and take the bytes as
        they land. The announcement is withdrawn when the transfer ends either way."""
        key = f"holders/{ph}/inflight/{self.node.node_id}"

        def announce() -> None:
            self.coord.announce(key, {"node": self.node.node_id, "committed": time.time()})

        try:
            yield announce
        finally:
            self._withdraw(key)

    def _in_storage(self, path: str) -> bool:
        from ckptcache.errors import PathNotAllowed

        try:
            if self.core.roots.root_for(path) is None:
                return False  # the daemon reads storage only under its roots
        except PathNotAllowed:
            return False
        try:
            return backend_for(path, self.core.persister.options).exists(path)
        except (OSError, ValueError, ImportError):
            return False

    def _load_from_storage(
        self, namespace: str, path: str, started: Callable[[], None]
    ) -> Generation:
        """Read a persisted archive into the arena with parallel ranged reads."""
        try:
            return self._read_storage(namespace, path, started)
        except ValueError as e:  # the end records or the archive are unreadable
            if not isinstance(e, CorruptCheckpoint) or path not in str(e):  # name the file
                e = CorruptCheckpoint(
                    f"checkpoint file {path!r} is corrupt: {e}", tier=Tier.STORAGE
                )
            self.core.metrics.corrupt.labels(tier=Tier.STORAGE).inc()
            log.error("not serving %s from storage: %s", path, e)
            raise e from None

    def _read_storage(self, namespace: str, path: str, started: Callable[[], None]) -> Generation:
        backend = backend_for(path, self.core.persister.options)
        size = backend.size(path)

        def read(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            backend.read_into(path, offset, memoryview(buf))
            return bytes(buf)

        log.info("reading %s from storage for the group", path)
        entries = count_records(size, read)
        capacity = 256 * entries + 4096  # manifest JSON, padded to this exact size
        layout = plan_segment(size, capacity, entries)
        t0 = time.perf_counter()

        table: list[int] = []

        def fill(view: memoryview, advance: Callable[[int], None]) -> None:
            started()  # registered as in flight here: joiners may chain behind us now
            # Ranges are read in parallel, each record's digest (or CRC-32) computed as its
            # bytes land; relays follow the contiguous prefix that is done. A damaged file
            # is not served.
            chunk = max(8 << 20, -(-size // (4 * self.config.s3_max_concurrency)))
            computed = read_archive(backend, path, view[:size], advance=advance, chunk=chunk,
                                    concurrency=self.config.s3_max_concurrency)  # fmt: skip
            parsed = parse_archive(view[:size])
            manifest = manifest_from_archive(parsed, path, namespace, size)
            encoded = manifest.to_json()
            if len(encoded) > capacity:
                raise CorruptCheckpoint(
                    f"{path!r}: manifest larger than planned", tier=Tier.STORAGE
                )
            start = layout.manifest_offset - HEADER_SIZE
            view[start : start + capacity] = encoded.ljust(capacity)
            # Digests of what storage holds (its own integrity is the storage's business).
            table.extend(computed[r.offset - HEADER_SIZE] for r in manifest.storages)
            dstart = layout.digest_offset - HEADER_SIZE
            view[dstart : dstart + 8 * len(table)] = pack_digests(table)
            advance(layout.nbytes - HEADER_SIZE)

        gen = self.core.receive(
            namespace, path, layout.nbytes, layout.manifest_offset, capacity, fill,
            origin="storage", persisted=True, digests=lambda: table,
        )  # fmt: skip
        self.core.metrics.storage_reads.inc()
        log.info("read %s from storage for the group (%.0f MB/s)", path,
                 size / max(time.perf_counter() - t0, 1e-9) / 1e6)  # fmt: skip
        return gen

    def _report_corrupt(self, node: NodeInfo, namespace: str, path: str, detail: str) -> None:
        try:
            with self._dial(node, timeout=10) as peer:
                send_msg(peer.channel, {"op": "corrupt", "namespace": namespace, "path": path,
                                     "detail": detail})  # fmt: skip
                recv_msg(peer.channel)
        except (OSError, CkptCacheError):
            pass

    def _on_corrupt(self, conn: Channel, req: dict[str, Any]) -> None:
        from ckptcache.wire import messages as m

        with self.core.cond:
            gen = self.core.index.newest((str(req["namespace"]), str(req["path"])))
        if gen is not None:
            self.core.report_corrupt(self.core.internal, m.ReportCorruptRequest(
                gen.namespace, gen.path, gen.number, f"peer found: {req.get('detail', '')}"
            ))  # fmt: skip
        send_msg(conn, {"ok": True})

    def holders(self, namespace: str, path: str) -> list[NodeInfo]:
        """Live nodes announcing a copy of ``path`` (newest commit first)."""
        ph = path_hash(namespace, path)
        entries = self.coord.scan(f"holders/{ph}/")
        live = {n.node_id: n for n in self.live_nodes()}
        ranked = sorted(entries.values(), key=lambda v: -float(v.get("committed", 0)))
        seen: list[NodeInfo] = []
        for v in ranked:
            node = live.get(str(v.get("node")))
            if node is not None and node not in seen and node.data_addr:
                seen.append(node)
        return seen

    # ----------------------------------------------------------------- background

    def _announce(self, gen: Generation) -> tuple[str, str]:
        digest = object_digest(self.core.ensure_digests(gen))
        ph = path_hash(gen.namespace, gen.path)
        self.coord.announce(f"holders/{ph}/{digest}/{self.node.node_id}", {
            "node": self.node.node_id, "path": gen.path, "generation": gen.number,
            "committed": gen.committed,
        })  # fmt: skip
        return ph, digest

    def _worker(self) -> None:
        while True:
            gen = self._work.get()
            if gen is None:
                return
            with self.core.cond:
                if self.core.index.get(gen.key, gen.number) is not gen:
                    continue
            try:
                self._announce(gen)
                if not gen.origin and self.config.backup != "none":
                    self.replicate(gen)
            except (CkptCacheError, OSError) as e:
                log.warning("could not protect %s generation %d: %s", gen.path, gen.number, e)

    def _monitor(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._check_standbys()
                self._check_replicas()
            except CoordinatorUnavailable as e:
                log.debug("coordinator unavailable: %s", e)
            except Exception:
                log.exception("cluster monitor")

    def _check_replicas(self) -> None:
        if self.config.backup == "none":
            return
        live = set(self.node_ids())
        with self.core.cond:
            lost = [g for g in self.core.index if not g.origin and g.replicas - live]
            for gen in lost:
                log.warning("backup of %s on %s lost; re-replicating", gen.path,
                            ",".join(sorted(gen.replicas - live)))  # fmt: skip
                gen.replicas &= live
        for gen in lost:
            self._work.put(gen)

    # ----------------------------------------------------------------- elections

    def claim(self, gen: Generation) -> tuple[ClaimRole, str]:
        """Decide this node's role for persisting ``gen``: ``("done", path)``,
        ``("lead", target_path)``, ``("standby", "")`` or ``("retry", "")``."""
        ph, digest = self._announce(gen)
        if self.coord.get(f"persisted/{ph}/{digest}") is not None:
            return ClaimRole.DONE, gen.path
        target = self._conflict_target(gen, ph, digest)
        group = self.coord.scan(f"holders/{ph}/{digest}/")
        live = set(self.node_ids())
        members = sorted((str(v["node"]) for v in group.values() if v.get("node") in live),
                         key=lambda n: digest_bytes(f"{ph}{digest}{n}".encode()))  # fmt: skip
        me = self.node.node_id
        rank = members.index(me) if me in members else len(members)
        if rank:
            time.sleep(min(0.2 * rank, 1.0))  # the preferred node gets a head start
        if not self.coord.elect(f"reps/{ph}/{digest}", {"node": me, "since": time.time()}):
            return ClaimRole.STANDBY, ""
        if self.coord.get(f"persisted/{ph}/{digest}") is not None:
            # A previous representative finished (and stepped down) while we waited.
            self._withdraw(f"reps/{ph}/{digest}")
            return ClaimRole.DONE, gen.path
        if not self.coord.elect(f"writer/{ph}", {"node": me, "digest": digest}):
            self.coord.withdraw(f"reps/{ph}/{digest}")
            return ClaimRole.RETRY, ""
        return ClaimRole.LEAD, self._conflict_target(gen, ph, digest) or target

    def _conflict_target(self, gen: Generation, ph: str, digest: str) -> str:
        """Where this content goes: the path, or a sidecar when another content of the same
        save already owns it."""
        window = self.config.conflict_window
        others: dict[str, float] = {}
        for key, v in self.coord.scan(f"holders/{ph}/").items():
            d = key.split("/")[2]
            if d == "inflight":
                continue  # a copy still arriving, not a content
            if d != digest and abs(float(v.get("committed", 0)) - gen.committed) < window:
                others[d] = float(v.get("committed", 0))
        if not others:
            return gen.path
        if not gen.conflict:
            gen.conflict = f"{len(others)} other content(s) saved within {window:g}s: " + ", ".join(
                sorted(others)
            )
            self.core.metrics.corrupt.labels(tier=Tier.GROUP).inc()
            log.error("digest disagreement on %s: this node holds %s, others hold %s",
                      gen.path, digest, sorted(others))  # fmt: skip
        persisted = self.coord.scan(f"persisted/{ph}/")
        if any(k.split("/")[2] != digest for k in persisted):
            return f"{gen.path}.conflict-{digest}"
        return gen.path

    def persisted(self, gen: Generation, target: str) -> None:
        """Record the group's persist and step down. If the coordinator is unreachable, the
        record is retried in the background (with backoff) until it answers: the object is
        already complete on storage, so nothing waits for it but the standbys."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        record = {"node": self.node.node_id, "path": target, "time": time.time()}
        try:
            self._record_persisted(ph, digest, record)
        except CoordinatorUnavailable as e:
            log.warning("cannot record the persist of %s yet (%s); retrying", gen.path, e)
            threading.Thread(
                target=self._retry_record, args=(gen.path, ph, digest, record),
                name="persisted-record", daemon=True,
            ).start()  # fmt: skip

    def _record_persisted(self, ph: str, digest: str, record: dict[str, Any]) -> None:
        self.coord.record(f"persisted/{ph}/{digest}", record)
        for key in (f"writer/{ph}", f"reps/{ph}/{digest}"):
            self.coord.withdraw(key)

    def _retry_record(self, path: str, ph: str, digest: str, record: dict[str, Any]) -> None:
        delay = 0.2
        while not self._stop.wait(delay):
            try:
                self._record_persisted(ph, digest, record)
            except CoordinatorUnavailable:
                delay = min(delay * 2, 5.0)
                continue
            log.info("recorded the persist of %s after a coordinator outage", path)
            return

    def failed(self, gen: Generation) -> None:
        """Step down after giving up, so a standby can take over; keep watching the group."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        for key in (f"writer/{ph}", f"reps/{ph}/{digest}"):
            self._withdraw(key)
        self.watch(gen, resubmit=False)

    def replace_corrupt(self, gen: Generation) -> bool:
        """This node's copy of ``gen`` is corrupt: leave its redundancy group (so a standby
        takes over the persist) and fetch a good copy from another member; returns whether
        one was found. The fetched copy is committed as a newer generation and persisted (or
        marked persisted) through the normal election."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        me = self.node.node_id
        for key in (f"holders/{ph}/{digest}/{me}", f"writer/{ph}", f"reps/{ph}/{digest}"):
            self._withdraw(key)
        try:
            members = self.coord.scan(f"holders/{ph}/{digest}/")
            live = {n.node_id: n for n in self.live_nodes()}
        except CoordinatorUnavailable as e:
            log.error("cannot look for a good copy of %s: %s", gen.path, e)
            return False
        for entry in members.values():
            node = live.get(str(entry.get("node")))
            if node is None or node.node_id == me or not node.data_addr:
                continue
            try:
                with self._in_flight(ph) as announce:
                    good = self._fetch_from(node, gen.namespace, gen.path, announce)
            except (OSError, CkptCacheError) as e:
                log.warning("good copy of %s from %s failed: %s", gen.path, node.node_id, e)
                continue
            log.warning("replaced the corrupt copy of %s with the one of %s (generation %d)",
                        gen.path, node.node_id, good.number)  # fmt: skip
            self._work.put(good)
            return True
        log.error("no other node holds a good copy of %s: it cannot be persisted", gen.path)
        return False

    def watch(self, gen: Generation, *, resubmit: bool = True) -> None:
        """Watch the group of ``gen`` as a standby (call with the core lock held or not)."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        self._standby[gen] = (ph, digest if resubmit else f"!{digest}")

    def _check_standbys(self) -> None:
        for gen, (ph, tag) in list(self._standby.items()):
            digest = tag.lstrip("!")
            with self.core.cond:
                alive = self.core.index.get(gen.key, gen.number) is gen
            if not alive:
                self._standby.pop(gen, None)
                continue
            if self.coord.get(f"persisted/{ph}/{digest}") is not None:
                self._standby.pop(gen, None)
                self.core.persister.mark_persisted(gen)
            elif not tag.startswith("!") and self.coord.get(f"reps/{ph}/{digest}") is None:
                self._standby.pop(gen, None)
                log.warning("representative of %s is gone: taking over", gen.path)
                with self.core.cond:
                    self.core.persister.submit(gen)
