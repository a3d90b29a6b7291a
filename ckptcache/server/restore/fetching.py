"""Copies between peers on request: serving fetches, fetching, and corruption reports.

Serving (:meth:`Fetching.on_fetch`): a copy still arriving here is relayed as it lands
(:class:`~ckptcache.wire.peer.RelayHead`), else the newest sound generation is sent, pinned
(:class:`~ckptcache.wire.peer.ObjectHead`). A node sends one object to at most
:data:`FANOUT` peers at a time and refuses more with :class:`PeerBusy`: the refused peer
chains behind one that is receiving it (it relays as the bytes land), so N nodes restoring
together form a chain in which every uplink carries the object once, instead of a star in
which the first holder's uplink carries it N - 1 times.

Fetching (:meth:`Fetching.fetch_from`) receives either and commits it here. A committed copy
is split across up to ``data_plane_streams`` connections of both nodes: the holder names the
stripes in its :class:`~ckptcache.wire.peer.ObjectHead` and sends the first with the digest
table, the fetching node asks for each other one on a connection of its own
(:class:`~ckptcache.wire.peer.FetchStripe`, :meth:`Fetching.on_fetch_stripe`). A copy still
arriving at the holder is relayed in stripes too, to a node that asks for them
(:mod:`ckptcache.server.cluster.relay`: :class:`~ckptcache.wire.peer.RelayStripe`,
:meth:`Fetching.on_relay_stripe`), each stripe from the ranges that have landed. A fetched copy
found corrupt is reported to its holder (:meth:`Fetching.report_corrupt` ->
:meth:`Fetching.on_corrupt` there), which drops the generation it served.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ckptcache.errors import (
    CheckpointNotFound,
    CkptCacheError,
    CorruptCheckpoint,
    ReplicationError,
)
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest
from ckptcache.server.cluster import relay, stripes
from ckptcache.server.cluster.coord import NodeInfo
from ckptcache.server.cluster.dataplane import Channel, recv_msg, send_msg
from ckptcache.server.cluster.delta import Held, HeldCorrupt, find_held
from ckptcache.server.cluster.membership import Membership
from ckptcache.server.cluster.transfer import (
    receive_copy,
    receive_relayed,
    relay_in_flight,
    send_delta,
    send_object,
    send_range,
    send_striped,
)
from ckptcache.server.memory.index import Generation
from ckptcache.server.ownership import saver_fields
from ckptcache.server.state import CacheState, Incoming, Inflight
from ckptcache.wire import peer

__all__ = ["FANOUT", "Fetching", "PeerBusy"]

log = logging.getLogger(__name__)

#: Peers one object is sent to at once from this node. One: a chain moves each object over
#: each uplink once, and relaying as the bytes land keeps its depth to one record per hop.
FANOUT = 1


class PeerBusy(ReplicationError):
    """The peer is already sending this object to :data:`FANOUT` others: ask one of them."""


class _Sends:
    """Sends in progress per object (``key``), bounded by :data:`FANOUT`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def slot(self, key: tuple[str, str]) -> Iterator[None]:
        with self._lock:
            if self._count.get(key, 0) >= FANOUT:
                raise PeerBusy(f"already sending {key[1]!r} to {FANOUT} peer(s)")
            self._count[key] = self._count.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._count[key] -= 1
                if not self._count[key]:
                    del self._count[key]


class Fetching:
    """Peer-to-peer copies on request."""

    def __init__(
        self,
        state: CacheState,
        membership: Membership,
        *,
        ensure_digests: Callable[[Generation], list[int]],
        receive: Callable[[Incoming], Generation],
        drop_corrupt: Callable[[str, str, int, str], None],
        streams: int = 1,
        incremental: bool = True,
    ):
        #: Connections a committed copy may come on, to or from this node (its
        #: ``data_plane_streams``, resolved).
        self.streams = streams
        #: Ask for a copy less the storages this node holds (``incremental_push``).
        self.incremental = incremental
        self.state = state
        self.membership = membership
        self.ensure_digests = ensure_digests
        self.receive = receive
        self.drop_corrupt = drop_corrupt
        #: How long a send waits for its peer to read what it queued (``until_read``).
        self.read_limit = state.config.dead_peer_timeout
        self._sends = _Sends()
        self._relays = relay.Relays()

    def on_fetch(self, conn: Channel, req: peer.FetchRequest) -> None:
        """Handler of :class:`~ckptcache.wire.peer.FetchRequest`."""
        key = (req.namespace, req.path)
        with contextlib.ExitStack() as held:  # the generation sent, unpinned last
            try:
                with self._sends.slot(key):
                    sent = self._serve(conn, key, held, min(req.streams, self.streams),
                                       req.relays, req.delta, req.delta_stripes)  # fmt: skip
            except PeerBusy as e:
                send_msg(conn, peer.refusal(e))
                return
            if sent:  # the slot is free once the bytes are sent; the pin lasts until the
                # peer has read them (sendfile queued the segment's pages, not copies)
                conn.until_read(self.read_limit)

    def on_fetch_stripe(self, conn: Channel, req: peer.FetchStripe) -> None:
        """Handler of :class:`~ckptcache.wire.peer.FetchStripe`: one stripe of a copy this
        node is serving (its newest generation, still the one named), else refused."""
        gen = self.state.find(req.namespace, req.path)
        try:
            pinned = gen is not None and gen.number == req.generation and (
                self.state.pin_if_current(gen)
            )  # fmt: skip
        except CkptCacheError as e:  # its pages could not be read back (sharing.py)
            send_msg(conn, peer.refusal(e))
            return
        if gen is None or not pinned:
            gone = CheckpointNotFound(
                f"generation {req.generation} of {req.path!r} is no longer served here"
            )
            send_msg(conn, peer.refusal(gone))
            return
        try:
            body = gen.segment.read_header().digest_offset - HEADER_SIZE
            if req.hi > body:
                send_msg(conn, peer.refusal(ReplicationError(
                    f"stripe [{req.lo}, {req.hi}) past the body ({body} bytes)")))  # fmt: skip
                return
            send_msg(conn, peer.encode(peer.Ack()))
            send_range(conn, gen, req.lo, req.hi)
            conn.until_read(self.read_limit)  # sendfile queued the pages, not copies of them
        finally:
            self.state.unpin(gen)

    def on_relay_stripe(self, conn: Channel, req: peer.RelayStripe) -> None:
        """Handler of :class:`~ckptcache.wire.peer.RelayStripe`: one stripe of a striped
        relay this node serves to the same node, its blocks sent as they land here."""
        joined = self._relays.join(req.token, req.index, conn.peer_id)
        if joined is None:
            send_msg(conn, peer.refusal(ReplicationError(
                f"no striped relay {req.token!r} to {conn.peer_id} with a free stripe "
                f"{req.index} here")))  # fmt: skip
            return
        flight, blocks = joined
        send_msg(conn, peer.encode(peer.Ack()))
        relay.send_blocks(conn, self.state, flight, blocks)

    def _serve(
        self,
        conn: Channel,
        key: tuple[str, str],
        held: contextlib.ExitStack,
        streams: int = 1,
        relays: bool = False,
        delta: bool = False,
        delta_stripes: bool = False,
    ) -> bool:
        """Send ``key``'s newest copy here; whether a generation was sent (it stays pinned
        until ``held`` closes): a refusal, or a relay (which waits for its reader itself),
        sends none."""
        try:
            served = self.state.flight_or_pinned(key)
        except CkptCacheError as e:
            send_msg(conn, peer.refusal(e))
            return False
        if isinstance(served, Inflight):  # still arriving here: relay it as it lands
            self._relay(conn, key, served, relay.streams_for(served.body, streams) if relays else 1)
            return False
        gen = served
        held.callback(self.state.unpin, gen)
        header = gen.segment.read_header()
        starts = stripes.plan(gen.manifest, header.digest_offset - HEADER_SIZE, streams)
        digests = tuple(self.ensure_digests(gen)) if delta else ()
        # A copy without storages has an empty table, which the head leaves out (its
        # default): the fetching node would wait for no answer, and this node for its answer.
        delta = delta and bool(digests)
        head = peer.ObjectHead(
            namespace=gen.namespace, path=gen.path,
            nbytes=header.digest_offset + 8 * header.n_storages,
            manifest_offset=header.manifest_offset, manifest_size=header.manifest_size,
            generation=gen.number, manifest=gen.manifest.to_json().decode(),
            skeleton_digest=header.skeleton_digest, persisted=gen.persisted,
            committed=gen.committed, committed_ns=gen.committed_ns,
            stripes=tuple(starts) if len(starts) > 1 and (delta_stripes or not delta) else (),
            digests=digests, **saver_fields(gen.saver),
        )  # fmt: skip
        send_msg(conn, peer.encode(head))
        if delta:  # the body follows the fetching node's answer: what it holds
            self._serve_less_held(conn, gen, digests, starts if delta_stripes else [0])
        elif len(starts) > 1:  # the fetching node asks for the other stripes (FetchStripe)
            send_striped(conn, gen, lambda: self.ensure_digests(gen), starts,
                         lambda _i, _lo, _hi: None)  # fmt: skip
        else:
            send_object(conn, gen, lambda: self.ensure_digests(gen))
        return True

    def _serve_less_held(
        self, conn: Channel, gen: Generation, digests: tuple[int, ...], starts: list[int]
    ) -> None:
        """Send ``gen``'s body less the storages the fetching node answers it holds; where it
        holds none, whole, in the stripes ``starts`` the head named if it asks for them."""
        ready = peer.decode_ack(recv_msg(conn))
        if isinstance(ready, peer.Refused):
            raise ReplicationError(f"{conn.peer_id} gave up the fetch: {ready.message}")
        if ready.have:
            send_delta(conn, gen, ready.have, digests)
        elif ready.stripes:
            if list(ready.stripes) != starts:
                raise ReplicationError(f"{conn.peer_id} asked for stripes the head did not name")
            send_striped(conn, gen, lambda: list(digests), starts, lambda _i, _lo, _hi: None)
        else:
            send_object(conn, gen, lambda: list(digests))

    def _relay(self, conn: Channel, key: tuple[str, str], flight: Inflight, streams: int) -> None:
        """Relay ``flight`` to the peer on ``conn``: on ``streams`` stripes (the peer asks
        for each but the first), else in order on this connection."""
        head = peer.RelayHead(
            namespace=key[0], path=key[1], nbytes=flight.nbytes,
            manifest_offset=flight.manifest_offset, manifest_size=flight.manifest_size,
            persisted=flight.persisted, committed=flight.saved_at, committed_ns=flight.saved_ns,
        )  # fmt: skip
        if streams <= 1:
            log.info("relaying %s to a peer while it arrives", key[1])
            send_msg(conn, peer.encode(head))
            relay_in_flight(conn, self.state, flight)
            return
        lanes = flight.lanes  # a snapshot: lanes set later still report where bytes landed
        blocks = relay.plan(flight.body, lanes, streams, relay.BLOCK)
        log.info("relaying %s to a peer while it arrives (on %d relay stripes)", key[1],
                 len(blocks))  # fmt: skip
        with self._relays.open(flight, conn.peer_id, blocks) as token:
            send_msg(conn, peer.encode(replace(head, lanes=lanes, block=relay.BLOCK,
                                               streams=len(blocks), token=token)))  # fmt: skip
            relay.send_blocks(conn, self.state, flight, blocks[0])
            # Open until the peer has every stripe (or hangs up): it joins the others meanwhile.
            done = peer.decode_ack(recv_msg(conn))
            if isinstance(done, peer.Refused):
                raise ReplicationError(f"{conn.peer_id} gave up the relay: {done.message}")

    def fetch_from(
        self, node: NodeInfo, namespace: str, path: str, started: Callable[[], None]
    ) -> Generation:
        """Copy ``node``'s newest copy of ``path`` here (``started()`` once bytes land)."""
        delta = self.incremental and self._may_hold(namespace)
        try:
            return self._fetch(node, namespace, path, started, delta)
        except HeldCorrupt as e:
            # A storage taken from this node's own memory failed its check (that generation
            # is dropped here): the peer's copy is not at fault. Take all of it.
            log.warning("fetch of %s from %s less what this node holds failed (%s): fetching "
                        "all of it", path, node.node_id, e)  # fmt: skip
            return self._fetch(node, namespace, path, started, False)

    def _fetch(
        self, node: NodeInfo, namespace: str, path: str, started: Callable[[], None], delta: bool
    ) -> Generation:
        with self.membership.dial(node) as conn:
            ask = peer.FetchRequest(namespace, path, streams=self.streams,
                                    relays=self.streams > 1, delta=delta,
                                    delta_stripes=delta and self.streams > 1)  # fmt: skip
            send_msg(conn.channel, peer.encode(ask))
            head = peer.decode_fetch_reply(recv_msg(conn.channel))
            plain = replace(ask, delta=False, delta_stripes=False)
            for older in (replace(ask, delta_stripes=False), plain, replace(plain, relays=False),
                          replace(plain, streams=1, relays=False)):  # fmt: skip
                if not (isinstance(head, peer.Refused) and head.error == "ProtocolMismatch"):
                    break
                if older == ask:
                    continue  # drops nothing this request asks for: the next one drops more
                # A node that predates a field (digests, striped relays, then striped
                # fetches): ask as it reads.
                ask = older
                send_msg(conn.channel, peer.encode(ask))
                head = peer.decode_fetch_reply(recv_msg(conn.channel))
            if isinstance(head, peer.Refused):
                if head.error == "CheckpointNotFound":
                    raise CheckpointNotFound(f"{node.node_id}: {head.message}")
                if head.error == "PeerBusy":
                    raise PeerBusy(f"{node.node_id}: {head.message}")
                raise ReplicationError(f"{node.node_id}: {head.message}")
            if (head.namespace, head.path) != (namespace, path):
                raise ReplicationError(f"{node.node_id} answered for another path")
            if isinstance(head, peer.RelayHead):
                relayed = head

                @contextlib.contextmanager
                def pull_relay(index: int) -> Iterator[Channel]:
                    with self.membership.dial(node) as stripe:
                        send_msg(
                            stripe.channel, peer.encode(peer.RelayStripe(relayed.token, index))
                        )
                        ready = peer.decode_ack(recv_msg(stripe.channel))
                        if isinstance(ready, peer.Refused):
                            raise relay.refused(index, node.node_id, ready.message)
                        yield stripe.channel

                def fill(view: memoryview, advance: Callable[[int], None]) -> None:
                    started()
                    if relayed.streams > 1:
                        log.debug("receiving relayed %s from %s on %d relay stripes", path,
                                  node.node_id, relayed.streams)  # fmt: skip
                        relay.receive(conn.channel, view, relayed, ask.streams, advance, pull_relay)
                    else:
                        receive_relayed(conn.channel, view, advance)

                return self.receive(Incoming(
                    namespace, path, head.nbytes, head.manifest_offset, head.manifest_size,
                    fill, origin=node.node_id, persisted=head.persisted,  # not written back
                    content_time=head.committed, content_ns=head.committed_ns,
                ))  # fmt: skip
            generation = head.generation

            @contextlib.contextmanager
            def pull(index: int, lo: int, hi: int) -> Iterator[Channel]:
                with self.membership.dial(node) as stripe:
                    ask = peer.FetchStripe(namespace, path, generation=generation, lo=lo, hi=hi)
                    send_msg(stripe.channel, peer.encode(ask))
                    ready = peer.decode_ack(recv_msg(stripe.channel))
                    if isinstance(ready, peer.Refused):
                        raise ReplicationError(
                            f"{node.node_id} refused stripe {index}: {ready.message}")  # fmt: skip
                    yield stripe.channel

            taken: list[int] = []
            saver_uid = head.saver_uid

            def held(manifest: Manifest, digests: Sequence[int], body: int) -> Held | None:
                found = find_held(self.state, namespace, saver_uid, manifest, digests, body)
                if found is not None:
                    taken.append(sum(manifest.storages[i].nbytes for i in found.have))
                return found

            try:
                gen = receive_copy(conn.channel, head, self.receive, node.node_id,
                                   ready=False, started=started, persisted=head.persisted,
                                   content_time=head.committed,
                                   content_ns=head.committed_ns, pull=pull, held=held)  # fmt: skip
                self.state.metrics.fetch_bytes_held.inc(sum(taken))
                return gen
            except HeldCorrupt:
                raise  # this node's memory, not the peer's copy
            except CorruptCheckpoint as e:
                self.report_corrupt(node, namespace, path, str(e), head.generation)
                raise

    def _may_hold(self, namespace: str) -> bool:
        """Whether this node holds a digested generation of ``namespace`` (whose storages a
        fetched copy may share)."""
        with self.state.lock.held():
            return any(g.namespace == namespace and g.digests is not None for g in self.state.index)

    def report_corrupt(
        self, node: NodeInfo, namespace: str, path: str, detail: str, generation: int
    ) -> None:
        """Tell ``node`` its ``generation`` of ``path`` was corrupt (best effort)."""
        report = peer.CorruptReport(namespace, path, detail, generation)
        try:
            with self.membership.dial(node, timeout=10) as conn:
                send_msg(conn.channel, peer.encode(report))
                recv_msg(conn.channel)
        except (OSError, CkptCacheError):
            pass

    def on_corrupt(self, conn: Channel, req: peer.CorruptReport) -> None:
        """Handler of :class:`~ckptcache.wire.peer.CorruptReport`: drop the copy served."""
        # Only the generation that was served: a newer one saved since is another content
        # (dropping it would lose the newest save); a relay's bytes were checked where they
        # landed here.
        if req.generation:
            self.drop_corrupt(req.namespace, req.path, req.generation, f"peer found: {req.detail}")
        send_msg(conn, peer.encode(peer.Ack()))
