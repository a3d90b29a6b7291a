"""Cluster coordination: membership with leases, elections, and durable records.

Two implementations pass one conformance suite: :class:`EmbeddedCoordinator` (in-process, a
single node needs nothing installed) and :class:`EtcdCoordinator` (etcd v3 through its JSON
gateway). :func:`make_coordinator` picks one from a URL (``embedded://``, ``etcd://host:port``).
"""

from ckptcache.server.cluster.coord.base import (
    Coordinator,
    CoordinatorUnavailable,
    NodeInfo,
    sign_node,
    verify_node,
)
from ckptcache.server.cluster.coord.embedded import EmbeddedCoordinator

__all__ = [
    "Coordinator",
    "CoordinatorUnavailable",
    "EmbeddedCoordinator",
    "NodeInfo",
    "make_coordinator",
    "sign_node",
    "verify_node",
]


def make_coordinator(url: str, *, cluster: str, job: str, ttl: float) -> Coordinator:
    """Build the coordinator named by ``url``; keys live under ``/ckptcache/<cluster>/<job>/``."""
    prefix = f"/ckptcache/{cluster}/{job}/"
    if url in ("", "embedded", "embedded://"):
        return EmbeddedCoordinator(prefix, ttl)
    if url.startswith(("etcd://", "etcd+http://")):
        from ckptcache.server.cluster.coord.etcd import EtcdCoordinator

        return EtcdCoordinator(url, prefix, ttl)
    raise ValueError(f"unknown coordinator {url!r}: use embedded:// or etcd://host:port")
