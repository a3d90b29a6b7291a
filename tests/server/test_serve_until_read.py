"""A node serving a fetch keeps the generation it sent pinned until the fetching node has
read every byte (``sendfile`` queued the segment's pages, not copies of them), and no longer
holds the path's send slot meanwhile: a fetching node that read everything but keeps its
connection open blocks no other node's fetch."""

from __future__ import annotations

import os

import torch

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.server.cluster.dataplane import recv_msg, send_msg
from ckptcache.server.cluster.dataplane.client import DataPlaneClient
from ckptcache.wire import peer
from tests.helpers import wait_until
from tests.server.conftest import NS, save_object

SECRET = "s" * 32


def _fetch(addr, path: str) -> tuple[DataPlaneClient, str, bytes]:
    """Fetch ``path`` from ``addr``, reading every byte; the connection is left open."""
    c = DataPlaneClient(addr, SECRET.encode(), 30, node_id="peer", expect="holder")
    send_msg(c.channel, peer.encode(peer.FetchRequest(NS, path)))
    head = peer.decode_fetch_reply(recv_msg(c.channel))
    if isinstance(head, peer.Refused):
        return c, head.error, b""
    body = bytearray(head.nbytes - HEADER_SIZE)
    c.channel.recv_into(memoryview(body))  # the body, then the digest table
    return c, "ok", bytes(body)


def test_a_peer_that_read_everything_keeps_the_pin_but_not_the_send_slot(make_core, tmp_path,
                                                                          shared_coordinator):  # fmt: skip
    holder = make_core(node_id="holder", listen="127.0.0.1:0", secret=SECRET, pool_bytes=0)
    addr = holder.cluster.server.address
    holder.cluster.fetching.read_limit = 120.0  # longer than any wait below
    path = str(tmp_path / "m.pt")
    session = holder.saves.open_session(1, os.getuid())
    value = torch.arange(1 << 16, dtype=torch.float32)
    save_object(holder, session, path, value)
    gen = holder.state.index.newest((NS, path))
    first, outcome, body = _fetch(addr, path)
    assert outcome == "ok" and value.numpy().tobytes() in body
    try:
        others: list[DataPlaneClient] = []

        def another_fetch() -> bool:
            c, answer, _ = _fetch(addr, path)
            others.append(c)
            return answer == "ok"

        wait_until(another_fetch, timeout=20, what="a second fetch served")
        assert gen.pins >= 1  # the first peer's bytes may still be queued: pinned
    finally:
        first.close()
        for c in others:
            c.close()
    wait_until(lambda: gen.pins == 0, timeout=30, what="the pins gone with the peers")
