"""The daemon-to-daemon data plane: plain TCP, HMAC-authenticated, bulk bytes by sendfile.

Framing: each message is a 4-byte big-endian length and a JSON object; bulk bytes follow a
message raw (never inside JSON). Every connection starts with a mutual challenge::

    client -> server   MAGIC + client_nonce (16 B)
    server -> client   server_nonce (16 B) + HMAC(secret, "server" + client_nonce + server_nonce)
    client -> server   HMAC(secret, "client" + server_nonce + client_nonce)

A peer without the secret is refused (and logged) before any request is read. With TLS
configured (:class:`TLSConfig`), the connection is wrapped first — mutual TLS against the
cluster's CA — and the challenge runs inside it. Requests:

* ``push``: header, then the segment bytes ``[HEADER_SIZE, nbytes)``; the receiver reserves a
  segment in its own arena, ``recv_into`` it, verifies every digest and commits a replica.
* ``fetch``: the sender replies with a header and the bytes of its newest generation.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptcache.errors import CkptCacheError

__all__ = [
    "DataPlaneClient",
    "DataPlaneServer",
    "PeerRefused",
    "TLSConfig",
    "recv_exact_into",
    "send_region",
]

log = logging.getLogger(__name__)

MAGIC = b"CKPTDP1\n"
_LEN = struct.Struct(">I")
_MAX_HEADER = 64 << 20  # headers carry manifests: ~150 bytes per tensor


class PeerRefused(CkptCacheError, ConnectionRefusedError):
    """The peer failed the shared-secret handshake (or we failed its)."""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (zero copy into, e.g., a segment mapping)."""
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def send_region(sock: socket.socket, path: str, offset: int, count: int) -> None:
    """Send ``count`` bytes of file ``path`` from ``offset`` straight from the page cache.

    ``socket.sendfile`` (not ``os.sendfile``): sockets with a timeout are non-blocking
    underneath, and it waits for writability instead of failing with EAGAIN.
    """
    with open(path, "rb") as f:
        sent = sock.sendfile(f, offset, count)
    if sent != count:
        raise ConnectionError(f"sent {sent} of {count} bytes")


def send_msg(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one framed JSON message."""
    data = json.dumps(message).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """Receive one framed JSON message."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"oversize header ({n} bytes)")
    message = json.loads(_recv_exact(sock, n))
    if not isinstance(message, dict):
        raise ConnectionError("malformed message")
    return message


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


Handler = Callable[[socket.socket, dict[str, Any]], None]


@dataclass(frozen=True)
class TLSConfig:
    """Optional TLS for the data plane: this node's certificate and key, and the cluster CA
    that every peer's certificate must be signed by (both directions are verified)."""

    cert: str
    key: str
    ca: str

    def server_context(self) -> ssl.SSLContext:
        """Context for accepted connections (peers must present a CA-signed certificate)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Context for outgoing connections.

        Peers are dialled by IP address, so host names are not checked; the CA signature and
        the shared-secret challenge together authenticate the peer.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


class DataPlaneServer:
    """Accepts authenticated peers and dispatches their requests to ``handlers[op]``."""

    def __init__(
        self,
        listen: str,
        secret: bytes,
        handlers: dict[str, Handler],
        tls: TLSConfig | None = None,
    ):
        host, _, port = listen.rpartition(":")
        self.secret = secret
        self.handlers = handlers
        self._tls = tls.server_context() if tls is not None else None
        self.sock = socket.create_server((host or "0.0.0.0", int(port)), reuse_port=False)
        self.address = f"{host or '127.0.0.1'}:{self.sock.getsockname()[1]}"
        self._stop = False

    def start(self) -> None:
        """Serve in a background thread."""
        threading.Thread(target=self._accept_loop, name="dataplane", daemon=True).start()

    def close(self) -> None:
        """Stop accepting."""
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> bool:
        hello = _recv_exact(conn, len(MAGIC) + 16)
        if not hello.startswith(MAGIC):
            return False
        client_nonce = hello[len(MAGIC) :]
        server_nonce = secrets.token_bytes(16)
        conn.sendall(server_nonce + _mac(self.secret, b"server", client_nonce, server_nonce))
        proof = _recv_exact(conn, 32)
        return hmac.compare_digest(proof, _mac(self.secret, b"client", server_nonce, client_nonce))

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        _tune(conn)
        conn.settimeout(300)
        try:
            try:
                if self._tls is not None:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                authenticated = self._handshake(conn)
            except (OSError, ValueError):
                authenticated = False  # hung up mid-handshake: it could not prove the secret
            if not authenticated:
                log.warning("refused data-plane peer %s: failed the shared-secret handshake", peer)
                return
            while True:
                try:
                    request = recv_msg(conn)
                except ConnectionError:
                    return
                handler = self.handlers.get(str(request.get("op")))
                if handler is None:
                    send_msg(conn, {"ok": False, "error": "ProtocolMismatch",
                                    "message": f"unknown op {request.get('op')!r}"})  # fmt: skip
                    return
                handler(conn, request)
        except (OSError, ValueError) as e:
            log.info("data-plane connection from %s ended: %s", peer, e)
        finally:
            conn.close()


class DataPlaneClient:
    """One authenticated connection to a peer's data plane."""

    def __init__(
        self, address: str, secret: bytes, timeout: float = 300.0, tls: TLSConfig | None = None
    ):
        host, _, port = address.rpartition(":")
        self.address = address
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        _tune(self.sock)
        client_nonce = secrets.token_bytes(16)
        try:
            if tls is not None:
                self.sock = tls.client_context().wrap_socket(self.sock, server_hostname=host)
            self.sock.sendall(MAGIC + client_nonce)
            reply = _recv_exact(self.sock, 48)
        except (OSError, ConnectionError) as e:
            self.close()
            raise PeerRefused(f"data-plane peer {address} refused the handshake: {e}") from e
        server_nonce, proof = reply[:16], reply[16:]
        if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce)):
            self.close()
            raise PeerRefused(f"data-plane peer {address} does not know the cluster secret")
        self.sock.sendall(_mac(secret, b"client", server_nonce, client_nonce))

    def close(self) -> None:
        """Close the connection."""
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
