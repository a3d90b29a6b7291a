"""A relay split into stripes, each on a connection of its own, served from the ranges of the
copy that have landed: the plan covers every byte once, a stripe forwards bytes of a lane
that landed while the prefix has not moved, the downstream copy is the same bytes with the
same verified digests, and a tampered stripe or an upstream copy that fails mid-relay fails
the whole transfer, with nothing committed and no stripe left running."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, read_object, write_object
from ckptcache.errors import CkptCacheError
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests
from ckptcache.server.cluster import relay, transfer
from ckptcache.server.cluster.dataplane import Channel, ChannelTampered, recv_msg
from ckptcache.server.state import Incoming, Inflight
from ckptcache.wire import peer

KEY = ("default", "/ckpt/model.pt")
BLOCK = 64 << 10


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks and records of 64 KiB, so that a test object of a few MiB has many."""
    monkeypatch.setattr(relay, "MIN_BLOCK", BLOCK)
    monkeypatch.setattr(transfer, "RELAY_RECORD", BLOCK)


def _image() -> tuple[dict[str, torch.Tensor], Any, bytearray]:
    g = torch.Generator().manual_seed(5)
    obj = {f"t{i}": torch.randn(150_001 + 7919 * i, generator=g) for i in range(4)}
    flat = flatten(obj)
    plan = plan_object(flat, KEY[1], KEY[0])
    image = bytearray(plan.layout.nbytes)
    write_object(memoryview(image), plan, flat)  # type: ignore[arg-type]
    table = compute_digests(memoryview(image), plan.manifest)
    off = plan.layout.digest_offset
    image[off : off + 8 * len(table)] = pack_digests(table)
    return obj, plan, image


def _pair() -> tuple[Channel, Channel]:
    sa, sb = socket.socketpair()
    return (Channel(sa, b"k" * 32, b"r" * 32, peer_id="down"),
            Channel(sb, b"r" * 32, b"k" * 32, peer_id="up"))  # fmt: skip


@pytest.mark.parametrize(("lanes", "streams"), [((0,), 1), ((0,), 4), ((0, 300_000), 3),
                                                ((0, 4096, 900_000), 2)])  # fmt: skip
def test_plan_covers_every_byte_once_in_the_order_it_is_due(lanes, streams) -> None:
    body = 1_500_000
    blocks = relay.plan(body, lanes, streams, BLOCK)
    assert len(blocks) == streams
    spans = sorted((lo, hi) for stripe in blocks for _lane, lo, hi in stripe)
    assert spans[0][0] == 0 and spans[-1][1] == body
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap, no overlap
    sizes = [sum(hi - lo for _l, lo, hi in s) for s in blocks]
    assert max(sizes) - min(sizes) <= len(lanes) * BLOCK  # dealt round robin: balanced
    for stripe in blocks:  # each stripe goes through each lane in order
        for lane in range(len(lanes)):
            own = [lo for ln, lo, _hi in stripe if ln == lane]
            assert own == sorted(own)


class _Relay:
    """An upstream core receiving a copy through ``fill`` and a downstream core receiving it
    by striped relay while it lands upstream; ``spoil(index, channel)`` may tamper with the
    relaying end of a stripe."""

    def __init__(self, make_core: Callable[..., Any], streams: int, lanes: tuple[int, ...]):
        self.obj, self.plan, self.image = _image()
        self.up, self.down = (make_core(memory_limit=64 << 20, node_id=n) for n in ("up", "down"))
        self.streams, self.lanes = streams, lanes
        self.body = len(self.image) - HEADER_SIZE
        self.blocks = relay.plan(self.body, lanes, streams, BLOCK)
        self.channels = [_pair() for _ in range(streams)]
        self.errors: dict[str, BaseException] = {}
        self.received: list[Any] = []
        self.downstream_has: list[int] = []  # body offsets the downstream copy has in place
        self.landed_down = threading.Event()
        #: The upstream copy in flight, taken as its fill starts (it may commit before a
        #: sender's thread runs, and leave the table of objects in flight).
        self.flight: Inflight | None = None
        self.flight_ready = threading.Event()
        self.senders: list[threading.Thread] = []

    def incoming(self, fill: Callable[..., None], origin: str) -> Incoming:
        layout = self.plan.layout
        return Incoming(*KEY, layout.nbytes, layout.manifest_offset, len(self.plan.manifest_bytes),
                        fill, origin=origin)  # fmt: skip

    def serve(self, spoil: Callable[[int, Channel], None] | None) -> None:
        def one(index: int) -> None:
            try:
                flight = self._flight()
                if spoil is not None:
                    spoil(index, self.channels[index][0])
                relay.send_blocks(self.channels[index][0], self.up.state, flight,
                                  self.blocks[index])  # fmt: skip
                if index == 0:  # the relay stays open until the downstream node has it all
                    assert peer.decode_ack(recv_msg(self.channels[0][0])) == peer.Ack()
            except BaseException as e:
                self.errors[f"send{index}"] = e
            finally:
                self.channels[index][0].close()  # a failed sender hangs up

        self.senders = [threading.Thread(target=one, args=(i,), daemon=True)
                        for i in range(self.streams)]  # fmt: skip
        for sender in self.senders:
            sender.start()

    def _flight(self) -> Inflight:
        assert self.flight_ready.wait(30)
        assert self.flight is not None
        return self.flight

    def receive_down(self) -> None:
        head = peer.RelayHead(
            namespace=KEY[0], path=KEY[1], nbytes=self.plan.layout.nbytes,
            manifest_offset=self.plan.layout.manifest_offset,
            manifest_size=len(self.plan.manifest_bytes), lanes=self.lanes, block=BLOCK,
            streams=self.streams, token="t",
        )  # fmt: skip

        @contextlib.contextmanager
        def pull(index: int) -> Iterator[Channel]:
            try:
                yield self.channels[index][1]
            finally:  # hung up once its stripe is in, as a node's connection is
                self.channels[index][1].close()

        def fill(view: memoryview, advance: Any) -> None:
            def lane(index: int, end: int) -> None:
                advance.lane(index, end)
                self.downstream_has.append(end)
                self.landed_down.set()

            tracked = _Tracked(advance, lane)
            relay.receive(self.channels[0][1], view, head, self.streams, tracked, pull)

        try:
            self.received.append(self.down.ingest.receive(self.incoming(fill, "up")))
        except BaseException as e:
            self.errors["receive"] = e

    def run(self, fill: Callable[..., None], spoil: Callable[[int, Channel], None] | None = None):
        self.serve(spoil)
        down = threading.Thread(target=self.receive_down)
        down.start()

        def filling(view: memoryview, advance: Any) -> None:
            self.flight = self.up.state.inflight[KEY]
            self.flight_ready.set()
            fill(view, advance)

        try:
            gen = self.up.ingest.receive(self.incoming(filling, "storage"))
        finally:
            down.join(60)
            for sender in self.senders:  # each ends once its peer has read what it sent
                sender.join(60)
            for a, b in self.channels:
                a.close()
                b.close()
        assert not down.is_alive() and not any(s.is_alive() for s in self.senders)
        return gen


class _Tracked:
    """A :class:`~ckptcache.server.state.Landing` whose lane reports are seen by the test."""

    def __init__(self, landing: Any, lane: Callable[[int, int], None]):
        self._landing, self.lane = landing, lane

    def __call__(self, n: int) -> None:
        self._landing(n)

    def lanes(self, starts: Any) -> None:
        self._landing.lanes(starts)


@pytest.fixture
def landing_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`relay.receive` reports lanes to a :class:`Landing`: the test's wrapper is one."""
    monkeypatch.setattr(relay, "Landing", _Tracked)


@pytest.mark.usefixtures("landing_type")
def test_a_stripe_forwards_a_lane_that_landed_before_the_prefix_moves(make_core) -> None:
    """The copy lands in two lanes, the second first: the downstream node has bytes of the
    second lane while the first has none (a relay that follows the prefix would wait for the
    whole first lane), then the whole copy, with the same verified digests."""
    lanes = (0, 1 << 20)
    r = _Relay(make_core, 3, lanes)
    image_body = memoryview(r.image)[HEADER_SIZE:]

    def fill(view: memoryview, advance: Any) -> None:
        advance.lanes(lanes)
        second = lanes[1]
        half = second + (len(view) - second) // 2
        view[second:half] = image_body[second:half]
        advance.lane(1, half)
        # The first lane lands only once the downstream node holds bytes of the second.
        assert r.landed_down.wait(30), r.errors
        assert any(end > second for end in r.downstream_has)
        view[:second] = image_body[:second]
        advance.lane(0, second)
        view[half:] = image_body[half:]
        advance.lane(1, len(view))

    gen_up = r.run(fill)
    assert r.errors == {}
    (gen_down,) = r.received
    assert gen_down.digests == gen_up.digests == compute_digests(memoryview(r.image),
                                                                 r.plan.manifest)  # fmt: skip
    out = read_object(gen_down.segment.mapping, gen_down.segment.read_header().manifest_offset,
                      len(r.plan.manifest_bytes), zero_copy=False)  # fmt: skip
    assert all(torch.equal(out[k], v) for k, v in r.obj.items())
    assert not r.up.state.inflight and not r.down.state.inflight


@pytest.mark.usefixtures("landing_type")
def test_a_tampered_stripe_fails_the_whole_relay(make_core) -> None:
    r = _Relay(make_core, 3, (0,))
    image_body = memoryview(r.image)[HEADER_SIZE:]

    def forge(index: int, channel: Channel) -> None:
        if index == 2:
            channel._send_key = b"x" * 32  # records keyed wrong, as if altered on the wire

    def fill(view: memoryview, advance: Any) -> None:
        view[:] = image_body
        advance(len(view))

    r.run(fill, spoil=forge)
    assert isinstance(r.errors.get("receive"), (ChannelTampered, ConnectionError, CkptCacheError))
    assert r.received == [] and r.down.state.find(*KEY) is None  # nothing committed downstream
    assert not [t for t in threading.enumerate() if t.name.startswith("relay-stripe")]


@pytest.mark.usefixtures("landing_type")
def test_an_upstream_copy_that_fails_mid_relay_fails_every_stripe(make_core) -> None:
    r = _Relay(make_core, 3, (0,))
    image_body = memoryview(r.image)[HEADER_SIZE:]

    def fill(view: memoryview, advance: Any) -> None:
        half = len(view) // 2
        view[:half] = image_body[:half]
        advance(half)
        assert r.landed_down.wait(30), r.errors
        raise OSError("storage went away mid-read")

    with pytest.raises(OSError, match="storage went away"):
        r.run(fill)
    assert "receive" in r.errors  # the downstream copy failed too, typed or a cut connection
    assert isinstance(r.errors["receive"], (ConnectionError, CkptCacheError, OSError))
    assert r.received == [] and r.down.state.find(*KEY) is None
    assert all(isinstance(e, ConnectionError) for k, e in r.errors.items() if k != "receive")
    assert not [t for t in threading.enumerate() if t.name.startswith("relay-stripe")]


def test_a_relay_stripe_joins_only_from_the_asking_node_once_and_never_a_failed_copy() -> None:
    relays = relay.Relays()
    flight = Inflight(None, HEADER_SIZE + 4 * BLOCK, 0, 0)  # type: ignore[arg-type]
    blocks = relay.plan(flight.body, (0,), 3, BLOCK)
    with relays.open(flight, "down", blocks) as token:
        assert relays.join(token, 1, "intruder") is None
        assert relays.join("nope", 1, "down") is None
        assert relays.join(token, 0, "down") is None  # the fetch's own connection has it
        assert relays.join(token, 1, "down") == (flight, blocks[1])
        assert relays.join(token, 1, "down") is None  # a stripe is taken once
        flight.failed = True
        assert relays.join(token, 2, "down") is None
    flight.failed = False
    assert relays.join(token, 2, "down") is None  # closed with the fetch's connection


def test_relay_messages_round_trip_and_an_unstriped_head_is_the_older_one() -> None:
    head = peer.RelayHead(namespace="ns", path="/p", nbytes=1 << 30, manifest_offset=4096,
                          manifest_size=512, lanes=(0, 1 << 28), block=BLOCK, streams=4,
                          token="t")  # fmt: skip
    assert peer.decode_fetch_reply(peer.encode(head)) == head
    plain = peer.RelayHead(namespace="ns", path="/p", nbytes=1 << 30, manifest_offset=4096,
                           manifest_size=512)  # fmt: skip
    assert not {"lanes", "block", "streams", "token"} & set(peer.encode(plain))
    ask = peer.FetchRequest("ns", "/p", streams=4, relays=True)
    assert peer.decode_request(peer.encode(ask)) == ask
    assert "relays" not in peer.encode(peer.FetchRequest("ns", "/p", streams=4))
    stripe = peer.RelayStripe(token="t", index=2)
    assert peer.decode_request(peer.encode(stripe)) == stripe
    with pytest.raises(ValueError):  # a striped relay names what the receiver plans with
        peer.RelayHead(namespace="ns", path="/p", nbytes=1 << 30, manifest_offset=4096,
                       manifest_size=512, streams=4)  # fmt: skip


def _relay_when_in_flight(
    up: Any, send: Channel, striped: bool, flights: list[Inflight],
    sender: dict[str, BaseException],
) -> threading.Thread:  # fmt: skip
    """A thread relaying ``up``'s copy of :data:`KEY` on ``send`` once it is in flight (in
    one stripe, or on one connection); the flight goes to ``flights``, an error to
    ``sender``."""

    def relay_it() -> None:
        while KEY not in up.state.inflight:
            threading.Event().wait(0.005)
        flight = up.state.inflight[KEY]
        flights.append(flight)
        try:
            if striped:
                relay.send_blocks(
                    send, up.state, flight, relay.plan(flight.body, (0,), 1, BLOCK)[0]
                )
            else:
                transfer.relay_in_flight(send, up.state, flight)
        except BaseException as e:
            sender["error"] = e

    t = threading.Thread(target=relay_it, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("striped", [True, False])
def test_a_failed_copy_stops_its_relays_before_its_segment_is_given_back(make_core, striped):
    """A relay sending bytes that landed, blocked on a peer that reads nothing, when the copy
    fails: the failure hangs the relay up and waits for it, so no relay reads the segment
    once it is given back (it may hold another object by then)."""
    _obj, plan, image = _image()
    up = make_core(memory_limit=64 << 20, node_id="up")
    send, stalled = _pair()  # ``stalled`` is never read
    sender: dict[str, BaseException] = {}
    flights: list[Inflight] = []
    t = _relay_when_in_flight(up, send, striped, flights, sender)

    def fill(view: memoryview, advance: Any) -> None:
        view[:] = memoryview(image)[HEADER_SIZE:]
        advance(len(view))  # all landed: the relay sends until the peer's buffers are full
        while not (flights and flights[0].senders):
            threading.Event().wait(0.005)
        threading.Event().wait(0.2)
        raise OSError("the copy failed after it landed")

    layout = plan.layout
    with pytest.raises(OSError, match="failed after it landed"):
        up.ingest.receive(Incoming(*KEY, layout.nbytes, layout.manifest_offset,
                                   len(plan.manifest_bytes), fill, origin="storage"))  # fmt: skip
    assert flights[0].senders == set()  # stopped before the segment went back
    t.join(5)
    assert not t.is_alive()
    assert isinstance(sender.get("error"), OSError)
    send.close()
    stalled.close()


@pytest.mark.parametrize("striped", [True, False])
def test_a_relay_still_sending_after_the_commit_keeps_the_generation(make_core, striped):
    """A relay blocked on a slow peer while the copy it follows commits: the generation stays
    pinned until the relay ends, so retiring it (eviction, a delete) meanwhile cannot give its
    segment to another save while the relay reads it; the segment goes with the relay."""
    _obj, plan, image = _image()
    up = make_core(memory_limit=64 << 20, node_id="up")
    send, stalled = _pair()  # ``stalled`` is not read until the end
    sender: dict[str, BaseException] = {}
    flights: list[Inflight] = []
    t = _relay_when_in_flight(up, send, striped, flights, sender)

    def fill(view: memoryview, advance: Any) -> None:
        view[:] = memoryview(image)[HEADER_SIZE:]
        advance(len(view))  # all landed: the relay sends until the peer's buffers are full
        while not (flights and flights[0].senders):
            threading.Event().wait(0.005)

    layout = plan.layout
    gen = up.ingest.receive(Incoming(*KEY, layout.nbytes, layout.manifest_offset,
                                     len(plan.manifest_bytes), fill, origin="storage"))  # fmt: skip
    assert t.is_alive() and flights[0].senders  # still sending, from the committed segment
    with up.state.lock.held():
        assert gen.pins == 1 and flights[0].held is gen
        up.state.retire_locked(gen)  # evicted or deleted meanwhile
    assert gen.retired and gen.segment.name not in up.state.arena.free  # kept for the relay
    stalled.close()  # the peer goes: the relay's send fails and it ends
    t.join(30)
    assert not t.is_alive()
    with up.state.lock.held():
        assert gen.pins == 0 and not gen.retired and flights[0].held is None
        assert gen.segment.name in up.state.arena.free  # given back with the relay
    send.close()
