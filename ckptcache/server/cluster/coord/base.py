"""The coordinator contract.

Call order (one daemon)::

    coord.join(node)                 # register this node under a lease kept alive in background
    coord.announce(key, value)       # leased keys: vanish when the node's lease expires
    coord.elect(key, value) -> bool  # create-if-absent under the lease: one winner per key
    coord.record(key, value)         # durable keys (no lease): survive every node
    coord.read(key) -> (value, rev)  # a value and its revision, for a later advance
    coord.advance(key, value, field) # durable, moves only forward in ``field`` (atomic)
    coord.get(key) / coord.scan(prefix) / coord.live_nodes()
    coord.wait_change(timeout)       # until a key may have changed (no request)
    coord.close()                    # revoke the lease: announcements and elections end now

Keys are relative to the coordinator's prefix (``/ckptcache/<cluster>/<job>/``); values are
JSON-serialisable dicts. Every method may raise :class:`CoordinatorUnavailable`.

Node records tell peers where to dial, so they are signed: ``sig`` is an HMAC-SHA256, under
a key derived from the cluster secret, of the coordinator prefix and the record's canonical
JSON (node id, host, data address, issue time). A writer to etcd without the secret cannot
make a node be dialled (:func:`sign_node` / :func:`verify_node`).

Key schema used by the daemon: :mod:`ckptcache.server.cluster.coord.keys` (every key is built
there);
the values under them: :mod:`ckptcache.server.cluster.coord.records` (typed, checked when read).
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from ckptcache import errors as _errors
from ckptcache.server.cluster.coord.keys import NODES
from ckptcache.server.cluster.coord.records import MalformedRecord

__all__ = [
    "Coordinator",
    "CoordinatorUnavailable",
    "NodeInfo",
    "Revisioned",
    "order_of",
    "read_node",
    "sign_node",
    "verify_node",
]

log = logging.getLogger(__name__)


#: The coordinator (etcd) cannot be reached; cluster features pause until it returns. One
#: class with the public error, so a client sees the same type the daemon raised.
CoordinatorUnavailable = _errors.CoordinatorUnavailable

#: A durable key as :meth:`Coordinator.read` gives it: its value (None: absent) and its
#: revision (0: absent, or a coordinator without revisions).
Revisioned = tuple[dict[str, Any] | None, int]


@dataclass(frozen=True)
class NodeInfo:
    """One daemon as the cluster sees it."""

    node_id: str
    host: str
    data_addr: str  # "ip:port" of its data plane ("" when it has none)
    issued: float = 0.0  # when the record was signed (wall clock; for audits)
    sig: str = ""  # see :func:`sign_node`

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> NodeInfo:
        """Inverse of :meth:`to_dict`; raises :class:`MalformedRecord` for a value without
        a node id or host, or with a field of the wrong type."""
        if not isinstance(raw, dict):
            raise MalformedRecord(f"node record is a {type(raw).__name__}, not an object")
        try:
            node_id, host = raw["node_id"], raw["host"]
            issued = raw.get("issued", 0.0)
            if isinstance(issued, bool) or not isinstance(issued, (int, float)):
                raise TypeError(f"issued={issued!r}")
            return cls(str(node_id), str(host), str(raw.get("data_addr", "")), float(issued),
                       str(raw.get("sig", "")))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise MalformedRecord(f"node record lacks or mistypes {e}") from e


def _node_mac(node: NodeInfo, secret: bytes, prefix: str) -> str:
    fields = {k: v for k, v in node.to_dict().items() if k != "sig"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    key = hmac.new(secret, b"ckptcache node record", hashlib.sha256).digest()
    return hmac.new(key, f"{prefix}\0{canonical}".encode(), hashlib.sha256).hexdigest()


def sign_node(node: NodeInfo, secret: bytes, prefix: str, issued: float) -> NodeInfo:
    """``node`` signed with the cluster ``secret`` for the coordinator ``prefix``."""
    node = replace(node, issued=issued, sig="")
    return replace(node, sig=_node_mac(node, secret, prefix))


def verify_node(node: NodeInfo, secret: bytes, prefix: str) -> bool:
    """Whether ``node`` was signed with ``secret`` for ``prefix`` (and not altered since)."""
    return bool(node.sig) and hmac.compare_digest(node.sig, _node_mac(node, secret, prefix))


def order_of(value: dict[str, Any] | None, field: str) -> int:
    """The integer ``field`` of a value :meth:`Coordinator.advance` keeps (-1: none)."""
    found = None if value is None else value.get(field)
    return found if isinstance(found, int) and not isinstance(found, bool) else -1


def read_node(key: str, raw: object) -> NodeInfo | None:
    """The node record of ``key``, or None (logged) when it is malformed: a record nobody's
    daemon wrote names no node to dial, and must not stop the others from being listed."""
    try:
        return NodeInfo.from_dict(raw)
    except MalformedRecord as e:
        log.warning("ignored coordinator key %s: %s", key, e)
        return None


class Coordinator(abc.ABC):
    """Membership, leased announcements, elections and durable records."""

    def __init__(self, prefix: str, ttl: float):
        self.prefix = prefix
        self.ttl = ttl
        self.node: NodeInfo | None = None

    @abc.abstractmethod
    def join(self, node: NodeInfo) -> None:
        """Register ``node`` under a fresh lease and keep the lease alive."""

    @abc.abstractmethod
    def announce(self, key: str, value: dict[str, Any]) -> None:
        """Put ``key`` under this node's lease (re-announced if the lease had to be renewed,
        and put later if this put fails: it raises, but the announcement is not lost)."""

    @abc.abstractmethod
    def withdraw(self, key: str) -> None:
        """Remove an announcement (or any key)."""

    @abc.abstractmethod
    def elect(self, key: str, value: dict[str, Any]) -> bool:
        """Create ``key`` under this node's lease if absent; True if this node now holds it."""

    @abc.abstractmethod
    def release(self, key: str) -> bool:
        """Delete ``key`` only if this node holds it (created under its current lease by
        :meth:`elect`); True if it was deleted. A role another node holds by now (this node's
        lease lapsed and another node was elected) is left alone: :meth:`withdraw` would
        delete it and let a third node take the role while the second still acts on it."""

    @abc.abstractmethod
    def record(self, key: str, value: dict[str, Any]) -> None:
        """Put a durable key (no lease)."""

    def read(self, key: str) -> Revisioned:
        """The value of ``key`` (None: absent) and its revision (0: absent, or a coordinator
        without revisions), to hand to :meth:`advance` as ``expect``."""
        return self.get(key), 0

    @abc.abstractmethod
    def advance(
        self, key: str, value: dict[str, Any], field: str, expect: Revisioned | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """Put the durable ``key`` to ``value`` unless it holds a value whose integer
        ``field`` is not smaller than ``value``'s, in one atomic step (a compare-and-swap: no
        put in between is lost or overwritten by an older one). Returns whether ``value`` was
        put, and the value found there before (the newer one that stayed, when it was not).
        A value whose ``field`` is missing or not an integer counts as the oldest.
        ``expect``: what :meth:`read` returned earlier; while it is still current, the put
        needs no read of its own (one request instead of two)."""

    @abc.abstractmethod
    def get(self, key: str) -> dict[str, Any] | None:
        """Value of ``key``, or None."""

    @abc.abstractmethod
    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every key under ``prefix`` (relative keys) with its value."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """Whether this node's lease is known to be alive (False while cut off)."""

    def lease_remaining(self) -> float:
        """Seconds this node's lease is known to stay alive (counted from the last refresh
        etcd answered, on this node's monotonic clock): no other node can take a role this
        node holds before then. An embedded coordinator's lease never lapses."""
        return float("inf")

    def lease_epoch(self) -> int:
        """Which of this node's leases is the current one: a number that changes each time
        the node takes a new lease. A role elected under one lease went with it, so the next
        lease's :meth:`lease_remaining` says nothing about that role. An embedded
        coordinator's lease never changes."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Revoke the lease and stop background work."""

    def wait_change(self, timeout: float) -> None:
        """Block until a key may have changed, or ``timeout`` seconds at most.

        The base waits out ``timeout`` (callers pass a jittered, exponentially growing
        backoff); a coordinator that can be told of changes returns as soon as one lands.
        No watch through etcd's JSON gateway: it stalls past ~250 open streams per member
        (``docs/scale.md``)."""
        time.sleep(max(0.0, timeout))

    def live_nodes(self) -> list[NodeInfo]:
        """Nodes whose lease is alive, sorted by id."""
        nodes = [read_node(k, v) for k, v in self.scan(NODES).items()]
        return sorted((n for n in nodes if n is not None), key=lambda n: n.node_id)
