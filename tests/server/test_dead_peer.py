"""The dead-peer time is an operator setting: ``dead_peer_timeout`` reaches both ends of every
data-plane connection (``TCP_USER_TIMEOUT``, keep-alive probes inside it) and a value the
kernel cannot honour is refused with the key named.

A real server and client on loopback; the accepted socket is read back in the request
handler, on the server's own thread.
"""

from __future__ import annotations

import socket
import threading

import pytest

from ckptcache.errors import ConfigError
from ckptcache.server.cluster.dataplane import (
    ConnectionLimits,
    DataPlaneClient,
    DataPlaneServer,
    recv_msg,
    send_msg,
)
from ckptcache.server.config import DaemonConfig, load_config

SECRET = b"s" * 32


def _user_timeout(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)


@pytest.mark.parametrize("seconds, probe", [(3.0, 1), (10.0, 2), (1.5, 1)])
def test_both_ends_use_the_configured_dead_peer_time(seconds, probe):
    seen: dict[str, int] = {}
    handled = threading.Event()

    def handler(channel, request) -> None:
        seen["server"] = _user_timeout(channel.sock)
        seen["server_probe"] = channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        send_msg(channel, {"ok": True})
        handled.set()

    server = DataPlaneServer("127.0.0.1:0", SECRET, {"ping": handler}, node_id="srv",
                             limits=ConnectionLimits(dead_peer=seconds))  # fmt: skip
    server.start()
    try:
        with DataPlaneClient(server.address, SECRET, 30, node_id="cli", expect="srv",
                             dead_peer=seconds) as client:  # fmt: skip
            assert _user_timeout(client.sock) == int(seconds * 1000)
            assert client.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == probe
            send_msg(client.channel, {"op": "ping"})
            assert recv_msg(client.channel) == {"ok": True}
        assert handled.wait(10)
    finally:
        server.close()
    assert seen == {"server": int(seconds * 1000), "server_probe": probe}


def test_the_limits_keep_the_dead_peer_time_when_capped():
    assert ConnectionLimits(dead_peer=2.0).capped(64).dead_peer == 2.0


def test_dead_peer_timeout_is_a_config_key(tmp_path):
    assert DaemonConfig().dead_peer_timeout == 10.0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dead_peer_timeout: 3\n")
    assert load_config(str(cfg), environ={}).dead_peer_timeout == 3.0
    for bad in ("0.5", "0", "-1", "soon", ".inf", ".nan"):
        cfg.write_text(f"dead_peer_timeout: {bad}\n")
        with pytest.raises(ConfigError, match="dead_peer_timeout"):
            load_config(str(cfg), environ={})
