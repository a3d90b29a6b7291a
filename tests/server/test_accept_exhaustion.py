"""Accept loops survive running out of file descriptors (EMFILE): they log, back off and go on.

Both listeners run in this process; its soft ``RLIMIT_NOFILE`` is lowered until every
descriptor is taken, a connection is left waiting in the backlog, and the limit restored.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
from collections.abc import Callable

import rpyc

from ckptcache.server.cluster.dataplane import (
    ConnectionLimits,
    DataPlaneClient,
    DataPlaneServer,
    recv_msg,
    send_msg,
)
from ckptcache.server.daemon import ControlServer
from tests.helpers import wait_until


def exhaust_descriptors(connect: Callable[[], socket.socket], logged: Callable[[], bool]):
    """Take every descriptor (each ``connect()`` costs one here and one in the listener),
    then keep a connection waiting for the listener until ``logged()`` says it hit EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    held: list[socket.socket] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 40, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(connect())

        def retry() -> bool:
            if logged():
                return True
            with contextlib.suppress(OSError):  # free one descriptor and queue a connection
                if held:
                    held.pop().close()
                held.append(connect())
            return False

        wait_until(retry, timeout=30)
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_data_plane_accepts_again_after_emfile(caplog):
    server = DataPlaneServer("127.0.0.1:0", b"k", {}, node_id="srv",
                             limits=ConnectionLimits(2.0, 100_000, 100_000))  # fmt: skip
    server.start()
    host, port = server.address.rsplit(":", 1)
    try:
        exhaust_descriptors(lambda: socket.create_connection((host, int(port)), 5),
                                   lambda: "data-plane accept failed" in caplog.text)  # fmt: skip
        assert "EMFILE" in caplog.text
        with DataPlaneClient(server.address, b"k", 30, node_id="cli", expect="srv") as peer:
            send_msg(peer.channel, {"op": "nope"})  # an authenticated round trip
            assert recv_msg(peer.channel)["error"] == "ProtocolMismatch"
    finally:
        server.close()


def test_control_socket_accepts_again_after_emfile(tmp_path, caplog):
    path = str(tmp_path / "ctl.sock")
    server = ControlServer(rpyc.Service, socket_path=path)
    thread = threading.Thread(target=server.start, daemon=True)
    thread.start()

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        return s

    wait_until(lambda: connect().close() is None)  # listening
    try:
        exhaust_descriptors(connect,
                                   lambda: "control socket accept failed" in caplog.text)  # fmt: skip
        conn = rpyc.utils.factory.unix_connect(path)
        conn.ping(timeout=30)  # served: the listener outlived EMFILE
        conn.close()
        assert thread.is_alive()
    finally:
        server.close()
