"""Pipelined relay: a daemon forwards an object to a peer while it is still arriving."""

from __future__ import annotations

import socket
import threading

import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, read_object, write_object
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests
from ckptcache.server.cluster import transfer
from ckptcache.server.cluster.dataplane import Channel
from ckptcache.server.cluster.transfer import receive_relayed, relay_in_flight
from ckptcache.server.state import Incoming


def test_relay_forwards_bytes_before_the_source_has_them_all(make_core, monkeypatch):
    monkeypatch.setattr(transfer, "RELAY_RECORD", 64 << 10)  # relay granularity small enough to see
    obj = {"a": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(1 << 17)}
    flat = flatten(obj)
    plan = plan_object(flat, "/ckpt/model.pt", "default")
    image = bytearray(plan.layout.nbytes)
    write_object(memoryview(image), plan, flat)
    table = compute_digests(memoryview(image), plan.manifest)
    image[plan.layout.digest_offset : plan.layout.digest_offset + 8 * len(table)] = pack_digests(
        table
    )
    body = memoryview(image)[HEADER_SIZE:]

    # The fixture's cores are shut down and their shm directories removed after the test.
    upstream, downstream = (make_core(memory_limit=64 << 20, node_id=n) for n in ("up", "down"))
    downstream_started = threading.Event()
    relayed: list[BaseException] = []
    received: list = []
    sa, sb = socket.socketpair()
    a, b = Channel(sa, b"k" * 32, b"r" * 32), Channel(sb, b"r" * 32, b"k" * 32)

    def slow_fill(view, advance):
        half = len(view) // 2
        view[:half] = body[:half]
        advance(half)
        # The second half lands only after the downstream node has the first half.
        assert downstream_started.wait(30)
        view[half:] = body[half:]
        advance(len(view))

    def relay():
        try:
            key = ("default", "/ckpt/model.pt")
            while key not in upstream.state.inflight:
                threading.Event().wait(0.01)
            relay_in_flight(a, upstream.state, upstream.state.inflight[key])
        except BaseException as e:
            relayed.append(e)

    def receive_down():
        def fill(view, advance):
            def tracking(n):
                advance(n)
                if n > 0:  # bytes arrived while the upstream still misses half of them
                    downstream_started.set()

            receive_relayed(b, view, tracking)

        try:
            received.append(downstream.ingest.receive(Incoming(
                "default", "/ckpt/model.pt", plan.layout.nbytes, plan.layout.manifest_offset,
                len(plan.manifest_bytes), fill, origin="up",
            )))  # fmt: skip
        finally:
            b.close()  # hung up once the copy is in, as a node's connection is

    threads = [threading.Thread(target=relay), threading.Thread(target=receive_down)]
    for t in threads:
        t.start()
    gen_up = upstream.ingest.receive(Incoming(
        "default", "/ckpt/model.pt", plan.layout.nbytes, plan.layout.manifest_offset,
        len(plan.manifest_bytes), slow_fill, origin="storage", verify=True,
    ))  # fmt: skip
    for t in threads:
        t.join(60)
    assert relayed == [] and len(received) == 1
    gen_down = received[0]
    assert gen_up.digests == gen_down.digests == table  # verified on both hops
    assert "/ckpt/model.pt" not in {k[1] for k in upstream.state.inflight}
    out = read_object(gen_down.segment.mapping, gen_down.segment.read_header().manifest_offset,
                      len(plan.manifest_bytes), zero_copy=False)  # fmt: skip
    assert torch.equal(out["a"], obj["a"]) and torch.equal(out["b"], obj["b"])
