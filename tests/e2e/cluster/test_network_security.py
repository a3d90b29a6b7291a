"""Attacks from the network and from the coordinator against real daemons on a real etcd.

* A process without the secret writes node records into etcd: they are never dialled.
* A TCP relay in the path between two real daemons forwards their handshake: it can read
  (authentication is not encryption; TLS adds confidentiality) but cannot inject, hijack
  the session or replay a handshake.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import pytest

from ckptcache.errors import ReplicationError
from ckptcache.server.cluster.coord import NodeInfo, sign_node
from tests.e2e.cluster.test_cluster import _has, state
from tests.helpers import wait_until

SECRET = b"s3cret"


def prefix_of(daemon) -> str:
    cluster = daemon.args[daemon.args.index("--cluster") + 1]
    return f"/ckptcache/{cluster}/default/"


def etcd_put(etcd_server, key: str, value: dict) -> None:
    """A raw write to etcd, as anyone with network access to it could do."""
    from etcd3gw.client import Etcd3Client

    host, port = etcd_server.url.removeprefix("etcd://").rsplit(":", 1)
    Etcd3Client(host=host, port=int(port)).put(key, json.dumps(value))


def data_addr(daemon) -> str:
    return next(line.split("data plane ")[1].rstrip(")") for line in daemon.log().splitlines()
                if "data plane" in line)  # fmt: skip


def test_forged_node_records_are_never_dialled(cluster_factory, etcd_server, tmp_path):
    (a,) = cluster_factory(1)
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    trap_addr = f"127.0.0.1:{trap.getsockname()[1]}"
    prefix = prefix_of(a)
    # Sorted after "node0", so --backup auto would pick them first.
    etcd_put(etcd_server, prefix + "nodes/node0a",
             {"node_id": "node0a", "host": "evil", "data_addr": trap_addr})  # fmt: skip
    forged = sign_node(NodeInfo("node0b", "evil", trap_addr), b"guessed", prefix, time.time())
    etcd_put(etcd_server, prefix + "nodes/node0b", forged.to_dict())
    wait_until(lambda: a.status() and "'node0a'" in a.log() and "'node0b'" in a.log())
    assert f"ignored node record 'node0a' (data plane {trap_addr}): unsigned" in a.log()
    assert f"ignored node record 'node0b' (data plane {trap_addr}): forged signature" in a.log()
    with a.client() as c:
        with pytest.raises(ReplicationError, match="no live backup node"):
            c.save(state(1), tmp_path / "m.pt", durability="backup")
        assert c.daemon_status().cluster_nodes == ("node0",)
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody ever dialled the forged address
    trap.close()


class Relay:
    """A TCP relay between a daemon and the real address of another one. It forwards the
    handshake faithfully; what it does afterwards is up to ``mode``."""

    def __init__(self, upstream: str, client_id: str, server_id: str, mode: str):
        self.upstream, self.mode = upstream, mode
        self.hello_len = 8 + 16 + 1 + len(client_id)  # then the client's 32-byte proof
        self.reply_len = 16 + 1 + len(server_id) + 32
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen = bytearray()  # everything the relay received from the upstream node
        self.handshakes: list[bytes] = []
        self.sessions = 0  # authenticated sessions that carried more than a clock probe
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, down: socket.socket) -> None:
        up = socket.create_connection(tuple(self.upstream.rsplit(":", 1)))  # type: ignore[arg-type]
        try:
            hello = _read(down, self.hello_len)
            up.sendall(hello)
            reply = _read(up, self.reply_len)
            down.sendall(reply)
            proof = _read(down, 32)
            self.handshakes.append(hello + proof)
            up.sendall(proof)  # the two real nodes are now mutually authenticated
            # The first frame says what the session is for (length, JSON, tag): the nodes'
            # clock probes take the relayed route too, and pass untouched and unrecorded.
            head = _read(down, 4)
            body = _read(down, int.from_bytes(head, "big"))
            if json.loads(body).get("op") == "clock":
                up.sendall(head + body)
                threading.Thread(target=self._pump, args=(up, down, False, 0, False),
                                 daemon=True).start()  # fmt: skip
                self._pump(down, up, False, 0, False)
                return
            self.sessions += 1
            if self.mode == "hijack":  # keep the session, talk to the node ourselves
                down.close()
                request = json.dumps({"op": "fetch", "namespace": "default",
                                      "path": "/anything"}).encode()  # fmt: skip
                up.sendall(len(request).to_bytes(4, "big") + request + bytes(16))
                self.seen += _drain(up)
                return
            up.sendall(head + body)
            if self.mode != "inject":
                self.seen += head + body
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()
            self._pump(down, up, self.mode == "inject", len(head + body))
        except (OSError, ValueError):
            pass

    def _pump(
        self, src: socket.socket, dst: socket.socket, inject: bool, start: int = 0,
        record: bool = True,
    ) -> None:  # fmt: skip
        forwarded = start
        try:
            while data := src.recv(1 << 16):
                if inject and forwarded < 100_000 <= forwarded + len(data):
                    data = bytearray(data)
                    data[100_000 - forwarded] ^= 0x01  # one flipped bit in the payload
                    data = bytes(data)
                if record and not inject:
                    self.seen += data
                forwarded += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def replay(self, handshake: bytes) -> bytes:
        """Replay a recorded client handshake to the upstream node; returns all it says."""
        with socket.create_connection(tuple(self.upstream.rsplit(":", 1))) as up:  # type: ignore[arg-type]
            up.sendall(handshake[: self.hello_len])
            reply = _read(up, self.reply_len)
            up.sendall(handshake[self.hello_len :] + b"\0" * 64)
            return reply + _drain(up)

    def close(self) -> None:
        self.sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _drain(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except OSError:
        pass
    return out


def _route_through(etcd_server, b, relay: Relay) -> None:
    """Make node1's (correctly signed) record point at the relay, as an attacker in the network
    path would have it: the record is genuine, the route is not."""
    prefix = prefix_of(b)
    node = sign_node(NodeInfo("node1", "host1", relay.address), SECRET, prefix, time.time())
    etcd_put(etcd_server, prefix + "nodes/node1", node.to_dict())


def save_through(a, relay: Relay, directory, seed: int) -> tuple:
    """Save with a backup copy until one goes through the relay (node0's view of the records
    is refreshed every half second); returns the path and the error of that save."""
    outcome: list = []

    def attempt() -> bool:
        before, path, error = relay.sessions, directory / f"m{seed}-{time.monotonic_ns()}.pt", None
        with a.client() as c:
            try:
                c.save(state(seed), path, durability="backup")
            except ReplicationError as e:
                error = e
        if relay.sessions > before:
            outcome.extend((path, error))
            return True
        return False

    wait_until(attempt, timeout=60, interval=0.2)
    return tuple(outcome)


@pytest.fixture
def relayed_pair(cluster_factory, etcd_server) -> Callable[[str], tuple]:
    def make(mode: str) -> tuple:
        # Whole pushes: each attempt saves the same state, which a push less what the backup
        # node holds from the attempts before would leave off the wire.
        a, b = cluster_factory(2, config="incremental_push: false\n")
        relay = Relay(data_addr(b), "node0", "node1", mode)
        _route_through(etcd_server, b, relay)
        return a, b, relay

    return make


def test_honest_relay_sees_bytes_but_the_copy_is_intact(relayed_pair, tmp_path):
    a, b, relay = relayed_pair("pass")
    path, error = save_through(a, relay, tmp_path, 2)
    assert error is None and b.info(path).origin == "node0"
    # Authenticated, not encrypted: the relay saw the tensor bytes (TLS hides them).
    assert state(2)["w"].numpy().tobytes()[:4096] in bytes(relay.seen)
    relay.close()


def test_relay_cannot_inject_into_a_backup_copy(relayed_pair, tmp_path):
    a, b, relay = relayed_pair("inject")
    path, error = save_through(a, relay, tmp_path, 3)
    assert isinstance(error, ReplicationError)
    assert not _has(b, path)  # nothing the relay touched was committed
    wait_until(lambda: "failed authentication" in b.log())  # logged after the refusal is sent
    relay.close()


def test_relay_cannot_hijack_or_replay_a_handshake(relayed_pair, tmp_path):
    a, b, relay = relayed_pair("hijack")
    with b.client() as cb:
        cb.save(state(4), tmp_path / "secret.pt")  # something worth stealing on node1
    _path, error = save_through(a, relay, tmp_path, 5)
    assert isinstance(error, ReplicationError)
    wait_until(lambda: "failed authentication" in b.log())
    assert bytes(relay.seen) == b""  # node1 answered the forged request with a hang-up
    reply = relay.replay(relay.handshakes[0])
    assert len(reply) == relay.reply_len  # a fresh challenge, then nothing: the proof is stale
    wait_until(lambda: b.log().count("failed the shared-secret handshake") >= 1)
    relay.close()
