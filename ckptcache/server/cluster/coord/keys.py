"""Every coordinator key the daemon reads or writes, built in one place.

Keys are relative to the coordinator's prefix (``/ckptcache/<cluster>/<job>/``). The schema
(lifetimes and values in :mod:`ckptcache.server.cluster.coord.records`)::

    nodes/<node_id>                              leased  NodeInfo, signed
    holders/<path_hash>/<digest>/<node_id>       leased  who holds which content of a path
    holders/<path_hash>/inflight/<node_id>       leased  a copy still arriving (relayed)
    writer/<path_hash>                           leased  the one node writing a path now
    loads/<path_hash>                            leased  the group's storage reader
    reps/<path_hash>/<digest>                    leased  elected representative of a group
    persisted/<path_hash>/<digest>               durable the group's persisted record
    latest/<path_hash>                           durable the cluster's newest save of a path

These strings are the wire between daemons of different versions sharing one etcd: a change
here is a protocol change, so the unit tests pin each one.
"""

from __future__ import annotations

__all__ = [
    "INFLIGHT",
    "NODES",
    "digest_of",
    "group_prefix",
    "holder_key",
    "holders_prefix",
    "inflight_key",
    "latest_key",
    "load_key",
    "node_key",
    "persisted_key",
    "persisted_prefix",
    "rep_key",
    "writer_key",
]

#: Prefix of the signed node records.
NODES = "nodes/"

#: The digest slot of a ``holders/`` key that marks a copy still arriving, not a content.
INFLIGHT = "inflight"


def node_key(node_id: str) -> str:
    """A node's signed record."""
    return f"{NODES}{node_id}"


def holders_prefix(ph: str) -> str:
    """Every holding (and copy in flight) of the path ``ph``."""
    return f"holders/{ph}/"


def group_prefix(ph: str, digest: str) -> str:
    """The redundancy group of one content of a path: its holders."""
    return f"{holders_prefix(ph)}{digest}/"


def holder_key(ph: str, digest: str, node_id: str) -> str:
    """``node_id`` holds content ``digest`` of the path ``ph``."""
    return f"{group_prefix(ph, digest)}{node_id}"


def inflight_key(ph: str, node_id: str) -> str:
    """``node_id`` is receiving a copy of the path ``ph`` and relays it as it lands."""
    return f"{holders_prefix(ph)}{INFLIGHT}/{node_id}"


def writer_key(ph: str) -> str:
    """The one node writing the path ``ph`` to storage now."""
    return f"writer/{ph}"


def load_key(ph: str) -> str:
    """The one node reading the path ``ph`` from storage for its group."""
    return f"loads/{ph}"


def rep_key(ph: str, digest: str) -> str:
    """The elected representative of a redundancy group."""
    return f"reps/{ph}/{digest}"


def persisted_prefix(ph: str) -> str:
    """Every persisted record of the path ``ph``."""
    return f"persisted/{ph}/"


def persisted_key(ph: str, digest: str) -> str:
    """The durable record that content ``digest`` of the path ``ph`` was persisted."""
    return f"{persisted_prefix(ph)}{digest}"


def latest_key(ph: str) -> str:
    """The durable record of the newest save of the path ``ph``, whichever node made it."""
    return f"latest/{ph}"


def digest_of(key: str) -> str:
    """The digest slot of a ``holders/`` or ``persisted/`` key (``INFLIGHT`` for a copy in
    flight; ``""`` for a key too short to have one)."""
    parts = key.split("/")
    return parts[2] if len(parts) > 2 else ""
