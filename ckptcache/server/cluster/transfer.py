"""Moving one committed object between daemons with hashing overlapped with the transfer.

Stream layout after the request/reply headers (whose JSON carries the manifest), in
authenticated records of the connection's :class:`~ckptcache.server.cluster.dataplane.Channel`::

    segment bytes [HEADER_SIZE, digest_offset)   payload + manifest, by sendfile
    digest table (8 bytes per storage)            computed by the sender while it sent

The receiver hashes every storage record by record as the records are authenticated (in the
thread that checks each record's tag, in the same pass over the record as the check: see
:meth:`~ckptcache.server.cluster.dataplane.Channel.recv_into`), so by the time the table
arrives only the comparison is left: every hop verifies every tensor without another pass over
memory or another thread per transfer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from ckptcache.errors import CkptCacheError, CorruptCheckpoint, ReplicationError
from ckptcache.format.digest import digest_bytes, digest_hex
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest, pack_digests, unpack_digests
from ckptcache.server.cluster import delta, stripes
from ckptcache.server.cluster.dataplane import Channel, recv_msg, send_msg
from ckptcache.server.cluster.landing import LandingDigests
from ckptcache.server.ownership import sent_saver
from ckptcache.server.state import Incoming, Landing
from ckptcache.wire import peer
from ckptcache.wire.states import Tier

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation
    from ckptcache.server.state import CacheState, Inflight

__all__ = [
    "RELAY_RECORD",
    "check_skeleton",
    "receive_copy",
    "receive_delta",
    "receive_object",
    "receive_pulled",
    "receive_relayed",
    "relay_in_flight",
    "send_delta",
    "send_object",
    "send_range",
    "send_stripe",
    "send_striped",
    "serve_stripe",
]

log = logging.getLogger(__name__)

#: Record size of a relay: the next hop forwards a record once it is in and checked, so each
#: hop of a restore chain adds about one record's time on the link.
RELAY_RECORD = 1 << 20


def send_object(channel: Channel, gen: Generation, digests: Callable[[], list[int]]) -> None:
    """Send ``gen``'s body while ``digests()`` runs alongside, then its digest table."""
    header = gen.segment.read_header()
    with ThreadPoolExecutor(1) as pool, gen.segment.opened() as fd:
        table = pool.submit(digests)
        channel.send_file(fd, HEADER_SIZE, header.digest_offset - HEADER_SIZE,
                          gen.segment.mapping)  # fmt: skip
        channel.send_bytes(pack_digests(table.result()))


def send_delta(
    channel: Channel, gen: Generation, have: Sequence[int], digests: Sequence[int]
) -> None:
    """Send ``gen``'s body but the storages ``have`` (which the receiver holds), in order,
    then its digest table."""
    header = gen.segment.read_header()
    spans = delta.gaps(gen.manifest, header.digest_offset - HEADER_SIZE, have)
    mapping = gen.segment.mapping
    with gen.segment.opened() as fd:
        for batch in delta.batches(spans):
            if len(batch) == 1 and batch[0][1] - batch[0][0] >= delta.GATHER:
                lo, hi = batch[0]
                channel.send_file(fd, HEADER_SIZE + lo, hi - lo, mapping)
            else:
                channel.send_bytes(b"".join(mapping[HEADER_SIZE + lo : HEADER_SIZE + hi]
                                            for lo, hi in batch))  # fmt: skip
    channel.send_bytes(pack_digests(digests))


def send_range(channel: Channel, gen: Generation, lo: int, hi: int) -> None:
    """Send bytes ``[lo, hi)`` of ``gen``'s body (offsets from the end of its header)."""
    with gen.segment.opened() as fd:
        channel.send_file(fd, HEADER_SIZE + lo, hi - lo, gen.segment.mapping)


def send_striped(
    channel: Channel,
    gen: Generation,
    digests: Callable[[], list[int]],
    starts: list[int],
    stripe: Callable[[int, int, int], None],
) -> None:
    """:func:`send_object` split into the stripes that start at ``starts``: the first on
    ``channel``, each other one by ``stripe(index, lo, hi)`` (its own connection) at the same
    time, and the digest table once every stripe was acknowledged (the receiver's sign that
    the transfer is whole)."""
    header = gen.segment.read_header()
    spans = stripes.ranges(starts, header.digest_offset - HEADER_SIZE)
    with ThreadPoolExecutor(len(spans), thread_name_prefix="stripe") as pool:
        table = pool.submit(digests)
        others = [pool.submit(stripe, i, lo, hi) for i, (lo, hi) in enumerate(spans) if i]
        send_range(channel, gen, *spans[0])
        for other in others:
            other.result()  # the first failure; the caller's hang-up stops the receiver
        channel.send_bytes(pack_digests(table.result()))


def send_stripe(
    channel: Channel, gen: Generation, token: str, index: int, lo: int, hi: int
) -> None:
    """Send stripe ``index`` (``[lo, hi)`` of ``gen``'s body) of the striped push ``token`` on
    ``channel``, a connection of its own, until the receiver acknowledges it in and checked."""
    send_msg(channel, peer.encode(peer.PushStripe(token=token, index=index)))
    ready = peer.decode_ack(recv_msg(channel))
    if isinstance(ready, peer.Refused):
        raise ReplicationError(f"{channel.peer_id} refused stripe {index}: {ready.message}")
    send_range(channel, gen, lo, hi)
    done = peer.decode_ack(recv_msg(channel))
    if isinstance(done, peer.Refused):
        raise ReplicationError(f"{channel.peer_id} rejected stripe {index}: {done.message}")


def serve_stripe(sinks: stripes.Sinks, channel: Channel, req: peer.PushStripe) -> None:
    """The receiving end of :func:`send_stripe`: the stripe lands in the view of the push it
    names (offered by the same node, the stripe not taken yet), else it is refused."""
    sink = sinks.join(req.token, req.index, channel)
    if sink is None:
        send_msg(channel, peer.refusal(ReplicationError(
            f"no striped push {req.token!r} from {channel.peer_id} with a free stripe "
            f"{req.index} here")))  # fmt: skip
        return
    try:
        send_msg(channel, peer.encode(peer.Ack()))
        sink.receive(req.index, channel)
    except CorruptCheckpoint as e:
        send_msg(channel, peer.refusal(e))
        raise ConnectionError(f"stripe {req.index} refused: {e}") from e
    finally:
        sink.release(channel)
    send_msg(channel, peer.encode(peer.Ack()))


def receive_object(
    channel: Channel,
    view: memoryview,
    manifest: Manifest,
    digest_offset: int,
    advance: Callable[[int], None],
) -> list[int]:
    """Fill ``view`` (the segment from ``HEADER_SIZE`` on) from ``channel``, verifying every tensor
    against the table that closes the stream; returns the verified digests. ``advance(n)``
    reports each time the first ``n`` bytes of ``view`` are in place and authenticated (relays
    follow it)."""
    body = digest_offset - HEADER_SIZE
    n = len(manifest.storages)
    hasher = LandingDigests(manifest)
    channel.recv_into(view[:body], advance, hasher)
    channel.recv_into(view[body : body + 8 * n])
    if not hasher.complete:  # every byte up to the table was reported; never expected
        raise CorruptCheckpoint(f"copy of {manifest.path!r} from a peer ended before its "
                                "last tensor", tier=Tier.PEER)  # fmt: skip
    expected = _compare(manifest, hasher.digests, view[body : body + 8 * n])
    advance(body + 8 * n)
    return expected


def receive_delta(
    channel: Channel,
    view: memoryview,
    manifest: Manifest,
    digest_offset: int,
    held: delta.Held,
    offered: Sequence[int],
    advance: Callable[[int], None],
) -> list[int]:
    """:func:`receive_object` for a copy whose receiver holds the storages ``held``: those
    are copied here first (each checked where it landed against the ``offered`` digests),
    then the rest of the body arrives in order and the table closes the stream; every
    digest is compared with that table. ``advance`` follows the final prefix."""
    body = digest_offset - HEADER_SIZE
    n = len(manifest.storages)
    empty = digest_bytes(b"")
    digests = [empty if s.nbytes == 0 else 0 for s in manifest.storages]
    delta.place(view, held, manifest, offered)
    for i in held.have:
        digests[i] = offered[i]
    within = delta.Within(manifest)
    for batch in delta.batches(delta.gaps(manifest, body, held.have)):
        lo, hi = batch[0]
        advance(lo)  # everything before this range is in place: held, or received
        if len(batch) == 1 and hi - lo >= delta.GATHER:
            hasher = LandingDigests(manifest, lo, hi, out=digests)
            channel.recv_into(view[lo:hi], _shifted(advance, lo), hasher)
            if not hasher.complete:  # every byte of the range was reported; never expected
                raise CorruptCheckpoint(f"copy of {manifest.path!r} from a peer ended before "
                                        "its last tensor", tier=Tier.PEER)  # fmt: skip
            continue
        gathered = bytearray(sum(b - a for a, b in batch))
        channel.recv_into(memoryview(gathered))
        pos = 0
        for a, b in batch:  # scattered to their places, then their storages hashed there
            view[a:b] = gathered[pos : pos + b - a]
            pos += b - a
            for i, start, end in within(a, b):
                digests[i] = digest_bytes(view[start:end])
    advance(body)
    channel.recv_into(view[body : body + 8 * n])
    expected = _compare(manifest, digests, view[body : body + 8 * n])
    advance(body + 8 * n)
    return expected


def _shifted(advance: Callable[[int], None], by: int) -> Callable[[int], None]:
    """``advance`` for a range that starts ``by`` bytes into the body."""
    return lambda n: advance(by + n)


def receive_striped(
    channel: Channel, sink: stripes.StripeSink, manifest: Manifest, digest_offset: int
) -> list[int]:
    """:func:`receive_object` for a body split into ``sink``'s stripes: the first one and the
    table on ``channel``, the others on connections of their own (which join ``sink``)."""
    view, body, n = sink.view, digest_offset - HEADER_SIZE, len(manifest.storages)
    try:
        if not sink.claim(0, channel):
            raise ConnectionError("striped transfer cancelled")
        sink.receive(0, channel)
        channel.recv_into(view[body : body + 8 * n])  # sent once every stripe is in
        sink.wait()
    except (OSError, CkptCacheError) as e:
        if sink.error is not None and sink.error is not e:
            raise sink.error from e  # the stripe that failed first says why
        raise
    expected = _compare(manifest, sink.finish(), view[body : body + 8 * n])
    sink.report(body + 8 * n)
    return expected


def receive_pulled(
    channel: Channel,
    sink: stripes.StripeSink,
    manifest: Manifest,
    digest_offset: int,
    pull: Callable[[int, int, int], AbstractContextManager[Channel]],
) -> list[int]:
    """:func:`receive_striped` for a fetch: this node asks for each stripe but the first on a
    connection of its own, ``pull(index, lo, hi)`` (a channel whose sender answered and is
    about to send those bytes), all at once; no stripe outlives the call."""

    def one(index: int) -> None:
        lo, hi = sink.ranges[index]
        try:
            with pull(index, lo, hi) as stripe:
                if sink.claim(index, stripe):
                    sink.receive(index, stripe)
        except BaseException as e:  # kept for the first connection's thread to raise
            sink.fail(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"stripe-{i}", daemon=True)
               for i in range(1, len(sink.ranges))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        return receive_striped(channel, sink, manifest, digest_offset)
    finally:
        sink.cancel()
        for t in threads:
            t.join()


def _compare(manifest: Manifest, digests: list[int], table: memoryview) -> list[int]:
    """The sender's digest ``table``, once every digest computed here matches it."""
    n = len(manifest.storages)
    expected = unpack_digests(table, n)
    for record, got, want in zip(manifest.storages, digests, expected, strict=True):
        if got != want:
            raise CorruptCheckpoint(
                f"copy of {manifest.path!r} from a peer is corrupt: tensor {record.name!r} has "
                f"digest {digest_hex(got)}, expected {digest_hex(want)}",
                tensor=record.name, tier=Tier.PEER,
            )  # fmt: skip
    return expected


def relay_in_flight(channel: Channel, state: CacheState, flight: Inflight) -> None:
    """Send an object that is still arriving here, chunk by chunk as it lands.

    The bytes go out in order; if the copy being received fails, the connection is cut and
    the downstream node tries another holder (it verifies every digest at the end anyway).
    """
    sent = HEADER_SIZE
    with state.relaying(flight, channel), flight.segment.opened() as fd:
        while sent < flight.nbytes:
            ready = state.wait_ready(flight, sent)
            channel.send_file(fd, sent, ready - sent, flight.segment.mapping,
                              record=RELAY_RECORD)  # fmt: skip
            sent = ready
        channel.until_read(state.config.dead_peer_timeout)  # sendfile queued the pages


def receive_relayed(channel: Channel, view: memoryview, advance: Callable[[int], None]) -> None:
    """Receive a relayed stream (the whole segment body, table last) in order."""
    channel.recv_into(view, advance)


def check_skeleton(view: memoryview, manifest: Manifest, expected: int) -> None:
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


def receive_copy(
    channel: Channel,
    head: peer.PushRequest | peer.ObjectHead,
    receive: Callable[[Incoming], Generation],
    origin: str,
    *,
    ready: bool,
    started: Callable[[], None] | None = None,
    saved_at: float | None = None,
    persisted: bool = False,
    content_time: float = 0.0,
    content_ns: int = 0,
    streams: int = 1,
    striped: Callable[[stripes.StripeSink], AbstractContextManager[object]] | None = None,
    pull: Callable[[int, int, int], AbstractContextManager[Channel]] | None = None,
    held: Callable[[Manifest, Sequence[int], int], delta.Held | None] | None = None,
) -> Generation:
    """Receive one committed object announced by ``head`` and commit it here through
    ``receive`` (:meth:`ckptcache.server.ingest.Ingest.receive`). ``ready``: tell the sender
    (a push) to stream once room is reserved; ``started()`` runs when the bytes start;
    ``persisted``: the sender's copy is the one stored at the path (nothing to write);
    ``content_time``: when the sender says the content was saved (0: unknown), and
    ``content_ns`` the save's exact stamp (0: unknown). With ``streams`` over 1 (a push),
    the body may come in up to that many stripes, whose other connections find the transfer
    while ``striped(sink)`` holds it open. A fetched copy whose ``head`` names stripes takes
    each but the first from ``pull(index, lo, hi)``. A copy that comes with its digests (a
    push's offer, a fetched head) is taken less the storages ``held(manifest, digests,
    body)`` finds here (:mod:`~ckptcache.server.cluster.delta`)."""
    manifest = Manifest.from_json(head.manifest.encode(), segment_size=head.nbytes)
    digest_offset = head.nbytes - 8 * len(manifest.storages)
    verified: list[int] = []

    def fill(view: memoryview, advance: Callable[[int], None]) -> None:
        if started is not None:
            started()
        body = digest_offset - HEADER_SIZE
        starts = stripes.plan(manifest, body, streams) if ready and striped else [0]
        served = head.stripes if isinstance(head, peer.ObjectHead) else ()
        landing = advance if isinstance(advance, Landing) else None
        offered = head.digests  # a push's offer, or a fetched head that waits for an answer
        found = held(manifest, offered, body) if offered and held is not None else None
        if found is not None:
            with found.pinned_until_done():
                log.debug("receiving %s from %s: %d storages held here", head.path,
                          channel.peer_id, len(found.picks))  # fmt: skip
                send_msg(channel, peer.encode(peer.Ack(have=found.have)))
                verified.extend(receive_delta(channel, view, manifest, digest_offset, found,
                                              offered, advance))  # fmt: skip
        elif offered and isinstance(head, peer.ObjectHead) and not (len(served) > 1 and pull):
            send_msg(channel, peer.encode(peer.Ack()))  # nothing held: all of it, here
            verified.extend(receive_object(channel, view, manifest, digest_offset, advance))
        elif len(served) > 1 and pull is not None:
            if offered:  # a fetch that named its digests, nothing held: all of it, striped
                send_msg(channel, peer.encode(peer.Ack(stripes=served)))
            if landing is not None:  # relays of this copy follow each stripe
                landing.lanes(served)
            sink = stripes.StripeSink(view, manifest, list(served), body, channel.peer_id,
                                      advance, landing.lane if landing else None)  # fmt: skip
            log.debug("receiving %s from %s in %d stripes", head.path, channel.peer_id,
                      len(served))  # fmt: skip
            verified.extend(receive_pulled(channel, sink, manifest, digest_offset, pull))
        elif len(starts) > 1 and striped is not None:
            if landing is not None:
                landing.lanes(starts)
            sink = stripes.StripeSink(view, manifest, starts, body, channel.peer_id, advance,
                                      landing.lane if landing else None)  # fmt: skip
            log.debug("receiving %s from %s in %d stripes", head.path, channel.peer_id,
                      len(starts))  # fmt: skip
            with striped(sink):  # no stripe writes into the view once this ends
                send_msg(channel, peer.encode(peer.Ack(stripes=tuple(starts))))
                verified.extend(receive_striped(channel, sink, manifest, digest_offset))
        else:
            if ready:  # reserved: the sender may stream the bytes
                send_msg(channel, peer.encode(peer.Ack()))
            verified.extend(receive_object(channel, view, manifest, digest_offset, advance))
        check_skeleton(view, manifest, head.skeleton_digest)

    return receive(Incoming(head.namespace, head.path, head.nbytes, head.manifest_offset,
                            head.manifest_size, fill, origin=origin, digests=lambda: verified,
                            saved_at=saved_at, persisted=persisted, content_time=content_time,
                            content_ns=content_ns, saver=sent_saver(head)))  # fmt: skip
