"""A relay that starts sending a copy after that copy was committed here (the fetch that
found it in flight sent its head first): the generation is pinned as the relay joins, so
the sharer cannot give its pages back meanwhile, and the relay sends the copy's bytes, not
holes."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests
from ckptcache.server.cluster.dataplane import Channel
from ckptcache.server.cluster.transfer import receive_relayed, relay_in_flight
from ckptcache.server.state import Incoming, NewerHeld
from tests.server.conftest import NS, digested, object_bytes, save_object

MiB = 1 << 20


def test_a_relay_joining_after_the_commit_sends_the_copy_bytes(make_core):
    core = make_core(memory_limit=256 * MiB, pool_bytes=0, share_pages=False)
    state = core.state
    value = torch.randn(2 * MiB)
    newer, older = "/ckpt/iter_2/model.pt", "/ckpt/iter_1/model.pt"
    save_object(core, core.saves.open_session(1, os.getuid()), newer, value)
    partner = state.index.newest((NS, newer))
    digested(partner)
    # An older step's copy read from storage: settled, so the sharer may hollow it at once.
    plan, image = object_bytes(older, value)
    table = compute_digests(memoryview(image), plan.manifest)
    at = plan.layout.digest_offset
    image[at : at + 8 * len(table)] = pack_digests(table)
    body = bytes(memoryview(image)[HEADER_SIZE:])
    flights = []

    def fill(view: memoryview, advance) -> None:
        flights.append(state.inflight[(NS, older)])  # what a fetch arriving now is given
        view[:] = body
        advance(len(view))

    ns = partner.committed_ns - 10**9
    gen = core.ingest.receive(Incoming(
        NS, older, plan.layout.nbytes, plan.layout.manifest_offset, len(plan.manifest_bytes),
        fill, origin="storage", persisted=True, digests=lambda: table, content_ns=ns,
        content_time=ns / 1e9,
    ))  # fmt: skip
    (flight,) = flights
    sender, receiver = socket.socketpair()
    up, down = Channel(sender, b"k" * 32, b"r" * 32), Channel(receiver, b"r" * 32, b"k" * 32)
    pins_while_sending = []

    def relay() -> None:
        with state.relaying(flight, up):  # as the relay joins: before the sharer runs
            pins_while_sending.append(gen.pins)
            core.sharer.run_once()
        relay_in_flight(up, state, flight)

    thread = threading.Thread(target=relay)
    thread.start()
    out = bytearray(len(body))
    receive_relayed(down, memoryview(out), lambda n: None)
    down.close()
    thread.join(30)
    assert pins_while_sending == [1] and gen.segment.hollow == 0
    assert bytes(out) == body
    assert gen.pins == 0
    assert core.sharer.run_once() > 0  # once the relay is done, its pages may be shared


def test_relays_of_a_copy_refused_at_its_commit_stop_before_its_segment_is_given_back(
    make_core, monkeypatch
):
    """A copy that landed while a trainer here saved the same path later is refused at its
    commit (newest wins): the relay still sending from its segment (blocked on a slow peer)
    is hung up before the segment goes back to the arena, where another save may take it."""
    core = make_core(memory_limit=256 * MiB, pool_bytes=0, share_pages=False)
    state = core.state
    path, value = "/ckpt/model.pt", torch.randn(2 * MiB)
    plan, image = object_bytes(path, value)
    table = compute_digests(memoryview(image), plan.manifest)
    at = plan.layout.digest_offset
    image[at : at + 8 * len(table)] = pack_digests(table)
    body = bytes(memoryview(image)[HEADER_SIZE:])
    sender, slow_peer = socket.socketpair()  # the peer never reads: the relay blocks
    up = Channel(sender, b"k" * 32, b"r" * 32)
    relays: list[threading.Thread] = []
    flights = []

    def fill(view: memoryview, advance) -> None:
        flight = state.inflight[(NS, path)]
        flights.append(flight)
        view[:] = body
        advance(len(view))
        relay = threading.Thread(target=relay_quietly, args=(up, state, flight))
        relay.start()
        relays.append(relay)
        assert state.lock.wait_for(lambda: bool(flight.senders), 10)
        # A trainer here saves the same path meanwhile: the copy is older than that.
        save_object(core, core.saves.open_session(1, os.getuid()), path, value + 1)

    released = []
    release = state.arena.release

    def recording_release(segment) -> None:
        if flights and segment is flights[0].segment:  # relays still sending from it
            released.append(len(flights[0].senders))
        release(segment)

    monkeypatch.setattr(state.arena, "release", recording_release)
    with pytest.raises(NewerHeld):
        core.ingest.receive(Incoming(
            NS, path, plan.layout.nbytes, plan.layout.manifest_offset, len(plan.manifest_bytes),
            fill, origin="node9", digests=lambda: table, content_ns=1, content_time=1e-9,
        ))  # fmt: skip
    relays[0].join(30)
    slow_peer.close()
    assert not relays[0].is_alive()
    assert released == [0]


def relay_quietly(channel: Channel, state, flight) -> None:
    try:
        relay_in_flight(channel, state, flight)
    except OSError:  # hung up: what the refusal does to it
        pass
