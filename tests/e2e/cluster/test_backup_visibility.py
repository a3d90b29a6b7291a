"""A backup acknowledged is findable at once: every node can load a ``durability="backup"``
save the moment it returns, however slowly the coordinator takes the holders' announcements.

The window is made wide and deterministic by a proxy in front of etcd that holds every write
of a ``holders/`` key for a while: a backup node that acknowledged before announcing (the old
order) leaves a loader on a third node with no holder to find.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from ckptcache.server.cluster.coord import NodeInfo
from ckptcache.server.cluster.coord.etcd import EtcdCoordinator
from tests.helpers import assert_same

#: How long the proxy holds each write of a holder announcement (seconds).
HOLD = 1.5


class SlowHoldersEtcd:
    """An HTTP proxy to etcd's JSON gateway that delays puts of ``holders/`` keys by
    ``hold`` seconds and forwards everything else at once (``url`` as EtcdServer's)."""

    def __init__(self, target_port: int, hold: float = HOLD):
        self.target_port = target_port
        self.hold = hold
        self.held = 0  # announcements delayed so far
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as etcd3gw's session expects

            def do_GET(self) -> None:
                proxy.forward(self, b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/kv/put") and b"/holders/" in _key_of(body):
                    proxy.held += 1
                    time.sleep(proxy.hold)
                proxy.forward(self, body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"etcd://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        try:
            self._forward(handler, body)
        except OSError:  # a daemon stopped (or etcd went) mid-request: its client retries
            handler.close_connection = True

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=30)
        try:
            headers = {"Content-Type": handler.headers.get("Content-Type", "application/json")}
            upstream.request(handler.command, handler.path, body or None, headers)
            reply = upstream.getresponse()
            data = reply.read()
        finally:
            upstream.close()
        handler.send_response(reply.status)
        handler.send_header("Content-Type", reply.getheader("Content-Type", "application/json"))
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _key_of(body: bytes) -> bytes:
    try:
        return base64.b64decode(json.loads(body)["key"])
    except (ValueError, KeyError, TypeError):
        return b""


@pytest.fixture
def slow_holders(etcd_server: Any) -> Iterator[SlowHoldersEtcd]:
    proxy = SlowHoldersEtcd(etcd_server.client_port)
    yield proxy
    proxy.close()


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 16, generator=g), "step": seed}


def test_a_backup_save_is_loadable_on_every_node_when_it_returns(
    cluster_factory, slow_holders, tmp_path
):
    a, _b, c = cluster_factory(3, ttl=5.0, etcd=slow_holders)
    path = tmp_path / "iter_1" / "model.pt"
    with a.client() as ca:
        ca.save(_state(1), path, durability="backup")
        assert ca.status(path).replicas == ("node1",)
    with c.client() as cc:  # at once: no wait for the announcements to settle
        # From a peer: nothing is on storage (no persist root). Not asserted through
        # status(path), whose newest generation may be a re-replicated copy by then.
        assert_same(_state(1), cc.load(path, verify=True))
    assert slow_holders.held > 0  # the announcements really went through the slow path


def test_the_origin_can_drop_its_copy_right_after_a_backup_save(
    cluster_factory, slow_holders, tmp_path
):
    """The bench's peer load: save with a backup, drop the local copy, load it back."""
    a, _b = cluster_factory(2, ttl=5.0, etcd=slow_holders)
    path = tmp_path / "model.pt.cluster"
    with a.client() as ca:
        ca.save(_state(2), path, durability="backup")
        ca.delete(path)
        assert_same(_state(2), ca.load(path))
        assert ca.status(path).last_load_tier == "peer"


def test_a_slow_announcement_does_not_cost_the_node_its_lease(etcd_server, caplog):
    """A put that etcd answers after longer than the lease TTL (here held by the proxy)
    must not hold back the lease refresh: the node keeps its lease, nothing is re-taken."""
    proxy = SlowHoldersEtcd(etcd_server.client_port, hold=4.5)
    coord = EtcdCoordinator(proxy.url, f"/ckptcache/lease-{id(proxy)}/default/", ttl=3.0)
    try:
        coord.join(NodeInfo("n0", "h0", ""))
        lease = coord._lease.id
        coord.announce("holders/p/d/n0", {"node": "n0"})  # held 4.5 s: past the 3 s TTL
        assert coord._lease.id == lease, "the lease lapsed while the put was held"
        assert "lease was gone" not in caplog.text and "lease was lost" not in caplog.text
        assert [n.node_id for n in coord.live_nodes()] == ["n0"]
    finally:
        coord.close()
        proxy.close()
