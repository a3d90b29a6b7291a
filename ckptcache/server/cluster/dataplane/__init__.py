"""The daemon-to-daemon data plane: plain TCP, every byte authenticated, bulk bytes by sendfile.

Layered as rpyc's core is, one job a module:

* :mod:`~ckptcache.server.cluster.dataplane.handshake`: who is at the other end (the mutual
  shared-secret challenge that names both nodes, optional mutual TLS);
* :mod:`~ckptcache.server.cluster.dataplane.records`: how bytes travel after it (length-prefixed
  records, each with a Poly1305 tag under a per-direction key; bulk bytes by ``sendfile``),
  tags and the receiver's digests in one pass (``_tagging``, in C where it is built);
* :mod:`~ckptcache.server.cluster.dataplane.server` and
:mod:`~ckptcache.server.cluster.dataplane.client`:
  accepting (bounded, throttled logs, a dispatch per request op) and dialling.

The names other modules use are re-exported here.
"""

from ckptcache.server.cluster.dataplane._sockets import DEAD_PEER_SECONDS, recv_exact_into
from ckptcache.server.cluster.dataplane._tagging import TAG_IMPLEMENTATION, Span, Xxh3
from ckptcache.server.cluster.dataplane.client import DataPlaneClient
from ckptcache.server.cluster.dataplane.handshake import MAGIC, PeerRefused, TLSConfig
from ckptcache.server.cluster.dataplane.records import (
    RECORD_SIZE,
    Channel,
    ChannelTampered,
    RecordHasher,
    recv_msg,
    send_msg,
)
from ckptcache.server.cluster.dataplane.server import ConnectionLimits, DataPlaneServer, Handler

__all__ = [
    "DEAD_PEER_SECONDS",
    "MAGIC",
    "RECORD_SIZE",
    "TAG_IMPLEMENTATION",
    "Channel",
    "ChannelTampered",
    "ConnectionLimits",
    "DataPlaneClient",
    "DataPlaneServer",
    "Handler",
    "PeerRefused",
    "RecordHasher",
    "Span",
    "TLSConfig",
    "Xxh3",
    "recv_exact_into",
    "recv_msg",
    "send_msg",
]
