"""Replication: backup copies pushed to peers, received from them, and kept up to count.

Call order: :meth:`Replication.start` (the worker) -> :meth:`Replication.on_commit` for each
commit (synchronous :meth:`Replication.replicate` for durability ``backup``) and
:meth:`Replication.protect` for recovered or fetched copies (the worker announces them and
brings them up to ``replicas`` backup copies) -> :meth:`Replication.check_replicas` from the
cluster monitor (re-replicates copies on nodes that left) -> :meth:`Replication.stop`.
A push: :class:`~ckptcache.wire.peer.PushRequest` -> ``Ack`` -> bytes -> (the receiver
commits the copy and announces itself as a holder) -> ``Pushed``: once a push is acknowledged,
every node finds the copy. A large push is split into stripes, each on a connection of its own
(:class:`~ckptcache.wire.peer.PushStripe`, :mod:`~ckptcache.server.cluster.stripes`), up to
the ``data_plane_streams`` of both nodes.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, replace

from ckptcache.errors import CkptCacheError, ReplicationError
from ckptcache.format.manifest import Manifest
from ckptcache.server.cluster.coord import CoordinatorUnavailable, NodeInfo
from ckptcache.server.cluster.dataplane import Channel, recv_msg, send_msg
from ckptcache.server.cluster.delta import find_held
from ckptcache.server.cluster.membership import Membership
from ckptcache.server.cluster.stripes import Sinks, auto_streams
from ckptcache.server.cluster.transfer import (
    receive_copy,
    send_delta,
    send_object,
    send_stripe,
    send_striped,
    serve_stripe,
)
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.index import Generation
from ckptcache.server.ownership import saver_fields
from ckptcache.server.state import CacheState, Incoming, NewerHeld
from ckptcache.wire import peer

__all__ = ["Replication"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replication:
    """Backup copies of this node's saves on other nodes, and copies of theirs here."""

    config: DaemonConfig
    state: CacheState
    membership: Membership
    _: KW_ONLY
    ensure_digests: Callable[[Generation], list[int]]
    receive: Callable[[Incoming], Generation]

    def __post_init__(self) -> None:
        #: (generation, announce only) to protect in the background; None stops the worker.
        self._work: queue.Queue[tuple[Generation, bool] | None] = queue.Queue()
        self._sinks = Sinks()  # striped pushes being received here

    def start(self) -> None:
        """Start the worker that announces and protects generations."""
        threading.Thread(target=self._worker, name="replicate", daemon=True).start()

    def stop(self) -> None:
        """Stop the worker."""
        self._work.put(None)

    def protect(self, gen: Generation, *, announce_only: bool = False) -> None:
        """Announce ``gen`` and (for this node's own saves, unless ``announce_only``) bring it
        up to count, in the background."""
        self._work.put((gen, announce_only))

    def on_commit(self, gen: Generation, durability: str) -> None:
        """A generation was committed here: protect it (synchronously for durability
        ``backup``)."""
        if durability == "backup" and not gen.origin:
            if self.config.backup == "none":
                raise ReplicationError(
                    "durability='backup' needs backup nodes: start the daemons with --backup "
                    "auto (or a list) and a shared --coordinator"
                )
            self.replicate(gen)
        self._work.put((gen, False))

    def replicate(self, gen: Generation) -> None:
        """Bring ``gen`` up to the configured number of backup copies (raises when none can be
        made)."""
        try:
            live = {n.node_id for n in self.membership.live_nodes()}
            with self.state.lock.held():
                gen.replicas &= live
                need = self.config.replicas - len(gen.replicas)
            if need <= 0:
                return
            targets = self.membership.backup_targets(exclude=set(gen.replicas))
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
            with self.state.lock.held():
                gen.replicas.add(target.node_id)
            need -= 1
        if need > 0:
            raise ReplicationError(f"backup copy of {gen.path!r} failed: {'; '.join(errors)}")

    def _push(self, gen: Generation, target: NodeInfo) -> None:
        if not self.state.pin_if_current(gen):
            return  # retired meanwhile: nothing to protect
        try:
            header = gen.segment.read_header()
            offer = peer.PushRequest(
                namespace=gen.namespace, path=gen.path,
                nbytes=header.digest_offset + 8 * header.n_storages,
                manifest_offset=header.manifest_offset, manifest_size=header.manifest_size,
                origin=self.membership.node.node_id, manifest=gen.manifest.to_json().decode(),
                skeleton_digest=header.skeleton_digest, committed=gen.committed,
                committed_ns=gen.committed_ns, token="", **saver_fields(gen.saver),
            )  # fmt: skip
            streams = auto_streams(self.config.data_plane_streams)
            if streams > 1:
                offer = replace(offer, streams=streams, token=secrets.token_hex(16))
            sent = False
            if self.config.incremental_push and self._may_hold(gen, target):
                digests = tuple(self.ensure_digests(gen))
                try:
                    self._offer(gen, target, replace(offer, digests=digests))
                    sent = True
                except (OSError, CkptCacheError) as e:
                    # A held storage found damaged there, a cut link: the whole copy, once.
                    log.warning("push of %s to %s, less what it holds, failed (%s): sending "
                                "all of it", gen.path, target.node_id, e)  # fmt: skip
            if not sent:
                self._offer(gen, target, offer)
            # Routine, one a save: DEBUG (a failed copy raises, or is logged as a warning;
            # status says where the replicas are).
            log.debug("backup copy of %s generation %d on %s", gen.path, gen.number, target.node_id)
        finally:
            self.state.unpin(gen)

    def _offer(self, gen: Generation, target: NodeInfo, offer: peer.PushRequest) -> None:
        """Push ``gen`` to ``target`` as ``offer`` says, until the receiver committed it."""
        t0 = time.perf_counter()
        with self.membership.dial(target) as conn:
            t1 = time.perf_counter()
            send_msg(conn.channel, peer.encode(offer))
            ready = peer.decode_ack(recv_msg(conn.channel))
            if (isinstance(ready, peer.Refused) and ready.error == "ProtocolMismatch"
                    and offer.streams > 1):  # fmt: skip
                # A node that predates striped pushes: the whole body on this connection.
                offer = replace(offer, streams=1, token="")
                send_msg(conn.channel, peer.encode(offer))
                ready = peer.decode_ack(recv_msg(conn.channel))
            if isinstance(ready, peer.Refused):
                raise ReplicationError(f"{target.node_id} refused: {ready.message}")
            t2 = time.perf_counter()
            if ready.have:
                if not offer.digests:
                    raise ReplicationError(f"{target.node_id} named storages it holds of a "
                                           "push that offered no digests")  # fmt: skip
                send_delta(conn.channel, gen, ready.have, offer.digests)
            elif len(ready.stripes) > 1:

                def stripe(index: int, lo: int, hi: int) -> None:
                    self._push_stripe(gen, target, offer.token, index, lo, hi)

                send_striped(conn.channel, gen, lambda: self.ensure_digests(gen),
                             list(ready.stripes), stripe)  # fmt: skip
            else:
                send_object(conn.channel, gen, lambda: self.ensure_digests(gen))
            t3 = time.perf_counter()
            done = peer.decode_pushed(recv_msg(conn.channel))
            t4 = time.perf_counter()
            log.debug("push of %s: connect %.3fs reserve %.3fs send %.3fs commit %.3fs",
                      gen.path, t1 - t0, t2 - t1, t3 - t2, t4 - t3)  # fmt: skip
            if isinstance(done, peer.Refused):
                raise ReplicationError(f"{target.node_id} rejected: {done.message}")
        if ready.have:  # counted once the receiver committed the copy
            held = sum(gen.manifest.storages[i].nbytes for i in ready.have)
            self.state.metrics.push_bytes_held.inc(held)

    def _may_hold(self, gen: Generation, target: NodeInfo) -> bool:
        """Whether ``target`` may hold some of ``gen``'s bytes already: it holds a backup copy
        of another save of this node, or this node holds a copy of one of its saves."""
        with self.state.lock.held():
            return any(
                g is not gen and g.namespace == gen.namespace
                and (target.node_id in g.replicas or g.origin == target.node_id)
                for g in self.state.index
            )  # fmt: skip

    def _push_stripe(
        self, gen: Generation, target: NodeInfo, token: str, index: int, lo: int, hi: int
    ) -> None:
        """Send stripe ``index`` (``[lo, hi)`` of the body) of a striped push on a connection
        of its own, until the receiver acknowledges it in and checked."""
        with self.membership.dial(target) as conn:
            send_stripe(conn.channel, gen, token, index, lo, hi)

    def on_push_stripe(self, conn: Channel, req: peer.PushStripe) -> None:
        """Handler of :class:`~ckptcache.wire.peer.PushStripe`: one stripe of a push this node
        is taking (from the node that offered it, once)."""
        serve_stripe(self._sinks, conn, req)

    def on_push(self, conn: Channel, req: peer.PushRequest) -> None:
        """Handler of :class:`~ckptcache.wire.peer.PushRequest`: take a backup copy, announce
        it, then acknowledge it (see :meth:`_announce_before_ack`)."""
        try:
            saved_at = float(req.committed or time.time())
            try:
                streams = min(req.streams, auto_streams(self.config.data_plane_streams))
                gen = receive_copy(conn, req, self.receive, conn.peer_id,  # the proven sender
                                   ready=True, saved_at=saved_at, content_ns=req.committed_ns,
                                   streams=streams if req.token else 1,
                                   striped=lambda s: self._sinks.open(req.token, s),
                                   held=lambda man, digests, body: find_held(
                                       self.state, req.namespace, req.saver_uid, man, digests,
                                       body))  # fmt: skip
            except NewerHeld as e:
                gen = self._same_content_held(req, e)
            self._announce_before_ack(gen)
        except (CkptCacheError, ValueError) as e:
            send_msg(conn, peer.refusal(e))
            raise ConnectionError(f"push refused: {e}") from e
        send_msg(conn, peer.encode(peer.Pushed(gen.number)))
        self._work.put((gen, False))

    def _announce_before_ack(self, gen: Generation) -> None:
        """Register this node as a holder of ``gen`` before the push is acknowledged.

        The acknowledgement ends a ``durability="backup"`` save on the origin, and from then
        on every node must find a holder (the origin may drop its copy or die at once). A
        coordinator that cannot take the holding fails the push: the origin then reports the
        backup as not made instead of safe. The copy is kept and the worker announces it
        later. A generation already superseded here needs no announcement (the newer one
        is announced by its own push or save).
        """
        if not self.state.is_current(gen):
            return
        try:
            self.membership.announce(gen)
        except CoordinatorUnavailable as e:
            self._work.put((gen, False))
            raise ReplicationError(
                f"copy of {gen.path!r} kept on {self.membership.node.node_id} but not "
                f"announced, so no node could find it: {e}"
            ) from e

    def _same_content_held(self, req: peer.PushRequest, refused: NewerHeld) -> Generation:
        """The newer generation this node saved itself, when it holds the pushed content:
        replicas of a data-parallel group save the same bytes under the same path, and each
        one's own save backs up the others. Otherwise the push stays refused."""
        held = self.state.find(req.namespace, req.path)
        if held is None or refused.digests is None:
            raise refused
        pushed = Manifest.from_json(req.manifest.encode(), segment_size=req.nbytes)
        same_layout = replace(pushed, created=0.0) == replace(held.manifest, created=0.0)
        if not same_layout or self.ensure_digests(held) != refused.digests:
            raise refused
        if held.segment.read_header().skeleton_digest != req.skeleton_digest:
            raise refused  # same tensors, another skeleton (other non-tensor state)
        return held

    def _worker(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            gen, announce_only = work
            if not self.state.is_current(gen):
                continue
            try:
                self.membership.announce(gen)
                if not (gen.origin or announce_only) and self.config.backup != "none":
                    self.replicate(gen)
            except (CkptCacheError, OSError) as e:
                log.warning("could not protect %s generation %d: %s", gen.path, gen.number, e)

    def check_replicas(self) -> None:
        """Re-replicate this node's saves whose backup copies were on nodes that left."""
        if self.config.backup == "none":
            return
        live = set(self.membership.node_ids())
        with self.state.lock.held():
            lost = [g for g in self.state.index if not g.origin and g.replicas - live]
            for gen in lost:
                log.warning("backup of %s on %s lost; re-replicating", gen.path,
                            ",".join(sorted(gen.replicas - live)))  # fmt: skip
                gen.replicas &= live
        for gen in lost:
            self._work.put((gen, False))
