"""The data plane's handshake: who is at the other end.

Every connection starts with a mutual challenge that also names both nodes::

    client -> server   MAGIC + client_nonce (16 B) + client_id (1-byte length + UTF-8)
    server -> client   server_nonce (16 B) + server_id + HMAC(secret, "server" + T)
    client -> server   HMAC(secret, "client" + T)

where ``T`` is the transcript (magic, both nonces, both ids). The client checks that the
server is the node it meant to dial (the id of the signed coordinator record), the server
that the client is not itself (reflection). Both then derive one key per direction,
``HMAC(secret, "c2s" + T)`` and ``HMAC(secret, "s2c" + T)``, for the records that follow
(:mod:`ckptcache.server.cluster.dataplane.records`). A relay that forwards the handshake between two
real nodes therefore cannot read its keys, and a replayed handshake fails on the fresh nonce
of the other side. Confidentiality on an untrusted network needs TLS (:class:`TLSConfig`,
mutual TLS against the cluster CA; the challenge runs inside it).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
from dataclasses import dataclass

from ckptcache.errors import CkptCacheError
from ckptcache.server.cluster.dataplane._sockets import recv_exact
from ckptcache.server.cluster.dataplane.records import Channel, mac

__all__ = [
    "MAGIC",
    "PeerRefused",
    "TLSConfig",
    "client_handshake",
    "node_id_bytes",
    "server_handshake",
]

MAGIC = b"CKPTDP2\n"
_MAX_ID = 255


class PeerRefused(CkptCacheError, ConnectionRefusedError):
    """The peer failed the shared-secret handshake (or we failed its)."""


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
        the shared-secret challenge (which names the node) together authenticate the peer.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def _lp(data: bytes) -> bytes:
    return bytes([len(data)]) + data


def node_id_bytes(node_id: str) -> bytes:
    """``node_id`` as the handshake carries it (at most 255 bytes of UTF-8)."""
    raw = node_id.encode()
    if len(raw) > _MAX_ID:
        raise ValueError(f"node id longer than {_MAX_ID} bytes: {node_id!r}")
    return raw


def _transcript(cn: bytes, sn: bytes, cid: bytes, sid: bytes) -> bytes:
    return MAGIC + cn + sn + _lp(cid) + _lp(sid)


def server_handshake(
    conn: socket.socket, secret: bytes, own_id: bytes, deadline: float
) -> Channel | None:
    """The server's side of the challenge on an accepted connection, finished by the
    monotonic ``deadline``: the channel, or None when the peer gave no valid proof (or is
    this node, its hello reflected)."""
    hello = recv_exact(conn, len(MAGIC) + 17, deadline)
    if not hello.startswith(MAGIC):
        return None
    client_nonce = hello[len(MAGIC) : len(MAGIC) + 16]
    client_id = recv_exact(conn, hello[-1], deadline)
    if client_id == own_id and own_id:
        return None  # our own hello reflected back at us
    server_nonce = secrets.token_bytes(16)
    transcript = _transcript(client_nonce, server_nonce, client_id, own_id)
    conn.sendall(server_nonce + _lp(own_id) + mac(secret, b"server", transcript))
    proof = recv_exact(conn, 32, deadline)
    if not hmac.compare_digest(proof, mac(secret, b"client", transcript)):
        return None
    return Channel.from_handshake(conn, secret, transcript, client=False,
                                  peer_id=client_id.decode(errors="replace"))  # fmt: skip


def client_handshake(
    sock: socket.socket, secret: bytes, *, node_id: str, expect: str | None, address: str
) -> Channel:
    """The client's side of the challenge on a connected ``sock`` (to ``address``): the
    channel, once the peer proved it knows ``secret`` and, with ``expect``, that it is that
    node; else :class:`PeerRefused`."""
    client_nonce, own_id = secrets.token_bytes(16), node_id_bytes(node_id)
    try:
        sock.sendall(MAGIC + client_nonce + _lp(own_id))
        server_nonce = recv_exact(sock, 16)
        server_id = recv_exact(sock, recv_exact(sock, 1)[0])
        proof = recv_exact(sock, 32)
    except (OSError, ConnectionError) as e:
        raise PeerRefused(f"data-plane peer {address} refused the handshake: {e}") from e
    transcript = _transcript(client_nonce, server_nonce, own_id, server_id)
    if not hmac.compare_digest(proof, mac(secret, b"server", transcript)):
        raise PeerRefused(f"data-plane peer {address} does not know the cluster secret")
    peer_id = server_id.decode(errors="replace")
    if expect is not None and peer_id != expect:
        raise PeerRefused(
            f"data-plane peer {address} is node {peer_id!r}, not {expect!r} as its record says"
        )
    sock.sendall(mac(secret, b"client", transcript))
    return Channel.from_handshake(sock, secret, transcript, client=True, peer_id=peer_id)
