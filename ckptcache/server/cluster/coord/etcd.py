"""etcd v3 through its JSON gateway (etcd3gw): leases, transactions, prefix scans.

The node's lease is refreshed every ``ttl/3`` by a background thread (never queued behind
other requests: a slow put must not let the lease lapse). If etcd is unreachable
for longer than ``ttl`` the lease is gone: the node reports unhealthy (its representative roles
are lost, so it must not start new persists) and, once etcd answers again, it takes a new
lease and re-announces everything it had announced — an etcd restart is survived without a
daemon restart.

Membership reads are incremental: a full read of ``nodes/`` costs etcd and the client O(N) per
call, and every daemon reads it every half second while saving, loading or keeping backups —
at a thousand nodes that was most of the coordination traffic. :meth:`live_nodes` keeps the
last view with its revision r and asks only for the keys modified after r, plus etcd's count of
keys in the range (one request, same consistency as a full read). Additions and updates arrive
as keys; a deletion shows as the count falling short of the view, and only then is the prefix
read in full. (A watch would cost no request at all, but etcd's JSON gateway multiplexes every
HTTP client over one internal HTTP/2 connection: beyond ~250 open watch streams per member it
stops answering, etcd-io/etcd#11826.)
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from typing import Any
from urllib.parse import urlparse

from ckptcache.server.cluster.coord.base import (
    Coordinator,
    CoordinatorUnavailable,
    NodeInfo,
    Revisioned,
    order_of,
    read_node,
)
from ckptcache.server.cluster.coord.keys import NODES, node_key

__all__ = ["EtcdCoordinator"]

log = logging.getLogger(__name__)

#: Seconds :meth:`EtcdCoordinator.close` gives etcd to answer the lease revoke (per connect
#: and per read). Short on purpose: a stop must not hang on a dead or hung etcd, and the
#: revoke is only a courtesy — an unrevoked lease expires on its own after ``ttl``.
CLOSE_TIMEOUT = 1.0
#: Seconds :meth:`EtcdCoordinator.close` waits for the keep-alive thread: it may be inside a
#: request to a hung etcd (up to the client timeout); it is a daemon thread and stops making
#: requests once closed, so there is no point in waiting it out.
KEEPALIVE_JOIN_TIMEOUT = 0.5


class EtcdCoordinator(Coordinator):
    """Coordinator on a real etcd cluster (``etcd://host:port``)."""

    def __init__(self, url: str, prefix: str, ttl: float):
        super().__init__(prefix, ttl)
        from etcd3gw.client import Etcd3Client

        parsed = urlparse(url)
        self._client = Etcd3Client(
            host=parsed.hostname or "127.0.0.1", port=parsed.port or 2379, timeout=5
        )
        self._lease: Any = None
        self._lease_ok_until = 0.0
        self._lease_epoch = 0  # bumped by every lease grant: see lease_epoch()
        self._announced: dict[str, dict[str, Any]] = {}
        #: Announced keys etcd may not have (their put failed): sent again by the keep-alive.
        self._unsent: set[str] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()  # ends the keep-alive thread
        self._closed = threading.Event()  # set by close(): no request is started after it
        self._thread: threading.Thread | None = None
        # None: a node key whose value is malformed (kept so the count below still matches).
        self._members: dict[bytes, NodeInfo | None] = {}
        self._members_rev = 0  # revision of the view; 0: none yet
        self._members_lock = threading.Lock()

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed.is_set():
            # Closed (the daemon is stopping): fail at once rather than start a request that
            # a hung etcd would hold for the full client timeout, and so nothing retries.
            raise CoordinatorUnavailable(f"etcd {what} refused: the coordinator is closed")
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # etcd3gw raises requests/connection errors of many kinds
            raise CoordinatorUnavailable(f"etcd {what} failed: {type(e).__name__}: {e}") from e

    def _new_lease(self) -> None:
        self._lease = self._guard("lease grant", self._client.lease, max(1, int(self.ttl)))
        self._lease_epoch += 1
        self._lease_ok_until = time.monotonic() + self.ttl
        self._unsent = set(self._announced)
        self._send_unsent()

    def _send_unsent(self) -> None:
        """Put every announced key etcd may be missing (call with ``self._lock`` held); a
        key stays pending until its put succeeds."""
        for key in sorted(self._unsent):
            value = self._announced.get(key)
            if value is not None:
                self._put(key, value, lease=True)
            self._unsent.discard(key)

    def _put(self, key: str, value: dict[str, Any], *, lease: bool) -> None:
        self._guard("put", self._client.put, self.prefix + key, json.dumps(value),
                    lease=self._lease if lease else None)  # fmt: skip

    def _under_lease(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args, lease=...)`` under this node's lease. If etcd no longer knows the lease
        (it lapsed while this node was stalled longer than the TTL, or it was revoked), take a
        new one — re-announcing everything — and try once more, rather than failing every
        request until the keep-alive thread notices. Call with ``self._lock`` held."""
        try:
            return self._guard(what, fn, *args, lease=self._lease)
        except CoordinatorUnavailable as e:
            if not _lease_not_found(e.__cause__):
                raise
        log.warning("etcd lease was gone (this node stalled past its TTL?); took a new one")
        self._new_lease()
        return self._guard(what, fn, *args, lease=self._lease)

    def join(self, node: NodeInfo) -> None:
        self.node = node
        with self._lock:
            self._announced[node_key(node.node_id)] = node.to_dict()
            self._new_lease()
        self._thread = threading.Thread(target=self._keepalive, name="etcd-lease", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        while not self._stop.wait(max(0.2, self.ttl / 3)):
            # The refresh runs without ``self._lock``: announcements hold it through their
            # requests, and an etcd slow to answer puts (or a queue of them) must not hold
            # the refresh back until the lease lapses and the node looks dead to the others.
            lease = self._lease
            try:
                remaining = self._guard("lease refresh", lease.refresh)
                if remaining is not None and int(remaining) <= 0:
                    raise CoordinatorUnavailable("lease expired")
                # Nor is the lock taken to record it. A lease replaced meanwhile got its own
                # deadline from _new_lease, just now: setting it again changes nothing.
                if self._lease is lease:
                    self._lease_ok_until = time.monotonic() + self.ttl
            except CoordinatorUnavailable as e:
                self._refresh_failed(lease, e)
                continue
            if self._unsent:
                self._resend()

    def _resend(self) -> None:
        """etcd answers again: put the announcements whose puts failed meanwhile. Left to
        the next round while a request holds the lock (the refresh must never wait on it)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._stop.is_set():
                return
            pending = len(self._unsent)
            try:
                self._send_unsent()
            except CoordinatorUnavailable as e:
                log.debug("announcements still pending (%d): %s", len(self._unsent), e)
                return
        finally:
            self._lock.release()
        log.info("etcd answers again: re-sent %d announcement(s) it had missed", pending)

    def _refresh_failed(self, lease: Any, error: CoordinatorUnavailable) -> None:
        """Retry while the lease may still be alive; past its TTL take a new one (and
        re-announce), unless another request already did."""
        with self._lock:
            if self._stop.is_set():
                return  # stopped while waiting for the lock: no retry, no new lease
            if self._lease is not lease:
                return  # a request found it gone and took a new one meanwhile
            if time.monotonic() < self._lease_ok_until:
                log.warning("etcd lease refresh failed (%s); retrying", error)
                return
            try:
                self._new_lease()
                log.warning("etcd lease was lost; took a new one and re-announced")
            except CoordinatorUnavailable as e2:
                log.warning("etcd unreachable: %s", e2)

    def announce(self, key: str, value: dict[str, Any]) -> None:
        """Put ``key`` under the lease. If the put fails (etcd unreachable for a moment) the
        error is raised and the key stays pending: the keep-alive puts it once etcd answers
        again, so an announcement is never lost to an outage shorter than the lease."""
        with self._lock:
            self._announced[key] = value
            try:
                self._under_lease("put", self._client.put, self.prefix + key, json.dumps(value))
            except CoordinatorUnavailable:
                self._unsent.add(key)
                raise

    def withdraw(self, key: str) -> None:
        with self._lock:
            self._announced.pop(key, None)
            self._unsent.discard(key)
        self._guard("delete", self._client.delete, self.prefix + key)

    def elect(self, key: str, value: dict[str, Any]) -> bool:
        if not self.healthy():
            return False  # cut off: never claim a role we may not be able to keep
        with self._lock:
            return bool(self._under_lease("create", self._client.create, self.prefix + key,
                                          json.dumps(value)))  # fmt: skip

    def release(self, key: str) -> bool:
        # One transaction: delete the key only if it is attached to this node's lease. A key
        # created under an earlier lease of this node is gone with that lease already.
        lease = self._lease  # read without the lock: the keep-alive holds it through requests
        if lease is None:
            return False
        encoded = _b64((self.prefix + key).encode())
        result = self._guard("release", self._client.transaction, {
            "compare": [{"key": encoded, "result": "EQUAL", "target": "LEASE",
                         "lease": str(lease.id)}],
            "success": [{"request_delete_range": {"key": encoded}}],
            "failure": [],
        })  # fmt: skip
        return bool(result.get("succeeded", False))

    def record(self, key: str, value: dict[str, Any]) -> None:
        self._put(key, value, lease=False)

    def read(self, key: str) -> Revisioned:
        found = self._guard("get", self._client.get, self.prefix + key, metadata=True)
        if not found:
            return None, 0
        return _decode(key, found[0][0]), int(found[0][1].get("mod_revision", 0))

    def advance(
        self, key: str, value: dict[str, Any], field: str, expect: Revisioned | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """A read (or ``expect``), then a transaction that puts only if the key's revision is
        still the one read (0: absent); lost to a concurrent put, it reads again (each pass
        one put was made, so it ends)."""
        encoded = _b64((self.prefix + key).encode())
        while True:
            before, revision = expect if expect is not None else self.read(key)
            expect = None
            if order_of(before, field) >= order_of(value, field):
                return False, before
            result = self._guard("advance", self._client.transaction, {
                "compare": [{"key": encoded, "result": "EQUAL", "target": "MOD",
                             "mod_revision": revision}],
                "success": [{"request_put": {"key": encoded,
                                             "value": _b64(json.dumps(value).encode())}}],
                "failure": [],
            })  # fmt: skip
            if result.get("succeeded", False):
                return True, before

    def get(self, key: str) -> dict[str, Any] | None:
        values = self._guard("get", self._client.get, self.prefix + key)
        return _decode(key, values[0]) if values else None

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        items = self._guard("scan", self._client.get_prefix, self.prefix + prefix)
        out = {}
        for value, meta in items:
            key = meta["key"]
            key = key.decode() if isinstance(key, bytes) else key
            key = key[len(self.prefix) :]
            out[key] = _decode(key, value)
        return out

    def live_nodes(self) -> list[NodeInfo]:
        """Nodes whose lease is alive, as of now: only keys changed since the last read
        travel (see the module docstring)."""
        with self._members_lock:
            prefix = (self.prefix + NODES).encode()
            span = {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + b"0")}
            if self._members_rev:
                out = self._range({**span, "min_mod_revision": self._members_rev + 1})
                for kv in out.get("kvs", []):
                    self._members[base64.b64decode(kv["key"])] = _node(kv)
                if int(out.get("count", 0)) != len(self._members):  # a node left: read it all
                    self._members_rev = 0
            if not self._members_rev:
                out = self._range(span)
                self._members = {
                    base64.b64decode(kv["key"]): _node(kv) for kv in out.get("kvs", [])
                }
            self._members_rev = int(out["header"]["revision"])
            nodes = [n for n in self._members.values() if n is not None]
            return sorted(nodes, key=lambda n: n.node_id)

    def _range(self, request: dict[str, Any]) -> dict[str, Any]:
        client = self._client
        out: dict[str, Any] = self._guard("scan", client.post, client.get_url("/kv/range"),
                                          json=request)  # fmt: skip
        return out

    def healthy(self) -> bool:
        return time.monotonic() < self._lease_ok_until

    def lease_remaining(self) -> float:
        return max(0.0, self._lease_ok_until - time.monotonic())

    def lease_epoch(self) -> int:
        return self._lease_epoch

    def close(self) -> None:
        """Revoke the lease (best effort) and stop the keep-alive, in bounded time.

        Runs on the daemon's stop path, so it never waits on etcd for long: other threads may
        hold ``self._lock`` inside requests to a hung etcd (each up to the client timeout,
        one after another), so it is not taken; the keep-alive thread is given a moment, not
        waited out; the revoke gets :data:`CLOSE_TIMEOUT` and one try. If etcd does not
        answer, the lease — and every announcement and election under it — expires on its
        own after ``ttl``, as it would had the node crashed. Requests begun after this point
        fail at once (see :meth:`_guard`).
        """
        self._closed.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=KEEPALIVE_JOIN_TIMEOUT)
        # Read without the lock: a lease granted by a keep-alive request still in flight is
        # not revoked here and simply expires (see above).
        lease = self._lease
        if lease is None:
            return
        client = self._client
        try:
            client.session.post(
                client.get_url("/kv/lease/revoke"), json={"ID": lease.id},
                timeout=(CLOSE_TIMEOUT, CLOSE_TIMEOUT),
            )  # fmt: skip
        except Exception as e:  # etcd down or hung: the lease expires on its own
            log.info("etcd lease not revoked (%s: %s); it expires within %gs",
                     type(e).__name__, e, self.ttl)  # fmt: skip


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _decode(key: str, value: bytes | str) -> dict[str, Any]:
    """A value as JSON; one that is not a JSON object (a hand edit of etcd) reads as ``{}``,
    present but empty, which every typed record rejects
    (:mod:`ckptcache.server.cluster.coord.records`) and every presence check still sees."""
    try:
        out = json.loads(value)
    except ValueError:
        out = None
    if isinstance(out, dict):
        return out
    log.warning("coordinator key %s holds no JSON object", key)
    return {}


def _node(kv: dict[str, Any]) -> NodeInfo | None:
    key = base64.b64decode(kv["key"]).decode(errors="replace")
    return read_node(key, _decode(key, base64.b64decode(kv["value"])))


def _lease_not_found(error: BaseException | None) -> bool:
    """Whether etcd answered "requested lease not found" (gRPC NOT_FOUND through the gateway)."""
    detail = getattr(error, "detail_text", None)
    if not isinstance(detail, str):
        return False
    try:
        answer = json.loads(detail)
    except ValueError:
        return False
    return isinstance(answer, dict) and "lease not found" in str(answer.get("message", ""))
