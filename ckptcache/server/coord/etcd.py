"""etcd v3 through its JSON gateway (etcd3gw): leases, transactions, prefix scans.

The node's lease is refreshed every ``ttl/3`` by a background thread. If etcd is unreachable
for longer than ``ttl`` the lease is gone: the node reports unhealthy (its representative roles
are lost, so it must not start new persists) and, once etcd answers again, it takes a new
lease and re-announces everything it had announced — an etcd restart is survived without a
daemon restart.

Membership (:meth:`EtcdCoordinator.membership`) is a view fed by one watch on ``nodes/``: a
full read of the prefix costs etcd and the client O(N) per call, which at a thousand nodes
reading it twice a second each is most of the cluster's coordination traffic. The watch is
opened on first use, re-synchronised (a read at revision r, then a watch from r + 1) after any
break, with exponential backoff and full jitter so that an etcd restart does not bring every
node back in the same instant.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

from ckptcache.server.coord.base import Coordinator, CoordinatorUnavailable, NodeInfo

__all__ = ["EtcdCoordinator"]

log = logging.getLogger(__name__)


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
        self._announced: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._members: _MemberWatch | None = None

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # etcd3gw raises requests/connection errors of many kinds
            raise CoordinatorUnavailable(f"etcd {what} failed: {type(e).__name__}: {e}") from e

    def _new_lease(self) -> None:
        self._lease = self._guard("lease grant", self._client.lease, max(1, int(self.ttl)))
        self._lease_ok_until = time.monotonic() + self.ttl
        for key, value in self._announced.items():
            self._put(key, value, lease=True)

    def _put(self, key: str, value: dict[str, Any], *, lease: bool) -> None:
        self._guard("put", self._client.put, self.prefix + key, json.dumps(value),
                    lease=self._lease if lease else None)  # fmt: skip

    def join(self, node: NodeInfo) -> None:
        self.node = node
        with self._lock:
            self._announced[f"nodes/{node.node_id}"] = node.to_dict()
            self._new_lease()
        self._thread = threading.Thread(target=self._keepalive, name="etcd-lease", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        while not self._stop.wait(max(0.2, self.ttl / 3)):
            with self._lock:
                try:
                    remaining = self._guard("lease refresh", self._lease.refresh)
                    if remaining is not None and int(remaining) <= 0:
                        raise CoordinatorUnavailable("lease expired")
                    self._lease_ok_until = time.monotonic() + self.ttl
                except CoordinatorUnavailable as e:
                    if time.monotonic() < self._lease_ok_until:
                        log.warning("etcd lease refresh failed (%s); retrying", e)
                        continue
                    try:
                        self._new_lease()
                        log.warning("etcd lease was lost; took a new one and re-announced")
                    except CoordinatorUnavailable as e2:
                        log.warning("etcd unreachable: %s", e2)

    def announce(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._announced[key] = value
            self._put(key, value, lease=True)

    def withdraw(self, key: str) -> None:
        with self._lock:
            self._announced.pop(key, None)
        self._guard("delete", self._client.delete, self.prefix + key)

    def elect(self, key: str, value: dict[str, Any]) -> bool:
        if not self.healthy():
            return False  # cut off: never claim a role we may not be able to keep
        with self._lock:
            return bool(self._guard("create", self._client.create, self.prefix + key,
                                    json.dumps(value), lease=self._lease))  # fmt: skip

    def record(self, key: str, value: dict[str, Any]) -> None:
        self._put(key, value, lease=False)

    def get(self, key: str) -> dict[str, Any] | None:
        values = self._guard("get", self._client.get, self.prefix + key)
        return json.loads(values[0]) if values else None

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        items = self._guard("scan", self._client.get_prefix, self.prefix + prefix)
        out = {}
        for value, meta in items:
            key = meta["key"]
            key = key.decode() if isinstance(key, bytes) else key
            out[key[len(self.prefix) :]] = json.loads(value)
        return out

    def healthy(self) -> bool:
        return time.monotonic() < self._lease_ok_until

    def membership(self) -> list[NodeInfo]:
        with self._lock:
            if self._members is None and not self._stop.is_set():
                self._members = _MemberWatch(self)
            watch = self._members
        view = watch.view() if watch is not None and self.healthy() else None
        return self.live_nodes() if view is None else view

    def close(self) -> None:
        self._stop.set()
        if self._members is not None:
            self._members.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._lease is not None:
                try:
                    self._lease.revoke()
                except Exception:
                    pass


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class _MemberWatch:
    """``nodes/`` mirrored by one etcd watch stream (a thread and an HTTP connection)."""

    def __init__(self, coord: EtcdCoordinator):
        self._coord = coord
        self._prefix = (coord.prefix + "nodes/").encode()
        self._members: dict[bytes, NodeInfo] = {}
        self._synced = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._response: Any = None
        threading.Thread(target=self._run, name="etcd-members", daemon=True).start()

    def view(self) -> list[NodeInfo] | None:
        """The members, or None while the view is not known to be in sync."""
        with self._lock:
            if not self._synced:
                return None
            return sorted(self._members.values(), key=lambda n: n.node_id)

    def stop(self) -> None:
        """End the watch (wakes the reading thread by shutting its socket down)."""
        self._stop.set()
        response = self._response
        if response is not None:
            try:  # the reader blocks in recv: only a shutdown of the socket wakes it
                dup = socket.fromfd(response.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                dup.shutdown(socket.SHUT_RDWR)
                dup.close()
            except (OSError, ValueError, AttributeError):
                pass

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._follow()
            except Exception as e:  # any break: resynchronise from a fresh read
                log.debug("membership watch broke: %s: %s", type(e).__name__, e)
            with self._lock:
                self._synced = False
            if time.monotonic() - started > 10:
                backoff = 0.1  # it had been working: start the backoff again
            # Full jitter: N nodes that lost etcd together come back spread over the window.
            if self._stop.wait(random.uniform(0, backoff)):
                return
            backoff = min(2 * backoff, max(1.0, self._coord.ttl))

    def _follow(self) -> None:
        import requests

        client = self._coord._client
        end = self._prefix[:-1] + bytes([self._prefix[-1] + 1])
        span = {"key": _b64(self._prefix), "range_end": _b64(end)}
        out = client.post(client.get_url("/kv/range"), json=span)
        members = {}
        for kv in out.get("kvs", []):
            raw = json.loads(base64.b64decode(kv["value"]))
            members[base64.b64decode(kv["key"])] = NodeInfo.from_dict(raw)
        start = int(out["header"]["revision"]) + 1
        with requests.Session() as session:
            self._response = response = session.post(
                client.get_url("/watch"), stream=True, timeout=(5, None),
                json={"create_request": {**span, "start_revision": start}},
            )  # fmt: skip
            if self._stop.is_set():
                return
            for line in response.iter_lines():
                if not line.strip():
                    continue
                result = json.loads(line).get("result")
                if result is None or result.get("canceled"):
                    raise ConnectionError(f"watch ended: {line[:200]!r}")
                if result.get("created"):
                    with self._lock:
                        self._members, self._synced = members, True
                    continue
                self._apply(result.get("events", []))
        raise ConnectionError("watch stream closed")

    def _apply(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            for event in events:
                key = base64.b64decode(event["kv"]["key"])
                if event.get("type") == "DELETE":
                    self._members.pop(key, None)
                else:
                    raw = json.loads(base64.b64decode(event["kv"]["value"]))
                    self._members[key] = NodeInfo.from_dict(raw)
