"""A flood of idle TCP connections to the data port of a daemon with few file descriptors.

The daemon runs with ``RLIMIT_NOFILE`` 256 (hard and soft: it cannot raise it) and receives
1,100 connections that never say a word. During and after the flood a client saves and loads
over its control socket and a real peer pushes backup copies to it; the idle connections are
closed (the oldest dropped for newcomers, the rest once the handshake deadline has passed).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import uuid

from tests.e2e.cluster.test_cluster import state
from tests.e2e.cluster.test_network_security import data_addr
from tests.helpers import assert_same, wait_until

FLOOD = 1100


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset: closed as well


def _use(a, b, directory, seed: int) -> None:
    """A local save and load on ``b`` and a backup copy pushed from ``a`` to ``b``."""
    local, pushed = directory / f"local-{seed}.pt", directory / f"pushed-{seed}.pt"
    with b.client() as cb:
        cb.save(state(seed), local)
        assert_same(state(seed), cb.load(local, verify=True))
    with a.client() as ca:
        ca.save(state(seed + 1), pushed, durability="backup")
        assert ca.status(pushed).replicas == ("node1",)
    assert b.info(pushed).origin == "node0"


def test_daemon_stays_responsive_through_a_connection_flood(daemon_factory, etcd_server, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this test holds 1,100 sockets
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("lease_ttl: 2\nsecret: s3cret\nhandshake_timeout: 2\n")
    name = f"c{uuid.uuid4().hex[:8]}"
    nodes = []
    for i in range(2):
        d = daemon_factory(
            "--config", str(cfg), "--coordinator", etcd_server.url, "--cluster", name,
            "--listen", "127.0.0.1:0", "--node-id", f"node{i}", "--host", f"host{i}",
            "--backup", "auto", "--memory-limit", "256MiB", start=False,
        )  # fmt: skip
        if i == 1:
            d.wrapper = ["prlimit", "--nofile=256:256", "--"]
        nodes.append(d.start())
    a, b = nodes
    wait_until(lambda: all(len(d.status().cluster_nodes) == 2 for d in nodes))
    assert "open-files=256" in b.log()
    host, port = data_addr(b).rsplit(":", 1)
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            flood.append(socket.create_connection((host, int(port)), timeout=30))
        _use(a, b, tmp_path, 10)  # during the flood
        for s in flood:
            s.setblocking(False)
        wait_until(lambda: all(_closed_by_peer(s) for s in flood), timeout=120)
        _use(a, b, tmp_path, 20)  # after it
        with socket.create_connection((host, int(port)), timeout=30) as idle:
            idle.setblocking(False)  # alone: only the handshake deadline can close it
            wait_until(lambda: _closed_by_peer(idle), timeout=60)
    finally:
        for s in flood:
            with contextlib.suppress(OSError):
                s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "dropped the oldest unauthenticated data-plane connection" in b.log()
