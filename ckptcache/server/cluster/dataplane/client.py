"""The data plane's client: one authenticated connection to a peer."""

from __future__ import annotations

import socket

from ckptcache.server.cluster.dataplane._sockets import DEAD_PEER_SECONDS, tune
from ckptcache.server.cluster.dataplane.handshake import PeerRefused, TLSConfig, client_handshake

__all__ = ["DataPlaneClient"]


class DataPlaneClient:
    """One authenticated connection to a peer's data plane (``channel`` carries the requests).

    ``node_id`` names this node in the handshake; ``expect`` is the id the peer must prove
    (the node whose signed record gave ``address``); ``dead_peer``: seconds of silence
    (nothing acknowledged, no SYN answered) after which the peer counts as gone.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        timeout: float = 300.0,
        tls: TLSConfig | None = None,
        *,
        node_id: str = "",
        expect: str | None = None,
        dead_peer: float = DEAD_PEER_SECONDS,
    ):
        host, _, port = address.rpartition(":")
        self.address = address
        # A peer cut off by a partition never answers the SYN: give up on it as on a silent
        # connection (the kernel would retry for minutes), then use the caller's timeout.
        self.sock = socket.create_connection((host, int(port)), timeout=min(timeout, dead_peer))
        self.sock.settimeout(timeout)
        tune(self.sock, dead_peer)
        try:
            if tls is not None:
                self.sock = tls.client_context().wrap_socket(self.sock, server_hostname=host)
        except OSError as e:  # the TLS handshake failed: the peer is refused as a whole
            self.close()
            raise PeerRefused(f"data-plane peer {address} refused the handshake: {e}") from e
        try:
            self.channel = client_handshake(
                self.sock, secret, node_id=node_id, expect=expect, address=address
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection."""
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.close()
            return
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
