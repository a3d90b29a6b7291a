"""A coordinator wrapper that counts round trips (per operation and per calling scope).

Every call through :class:`CountingCoordinator` is one request to the coordinator (etcd: one
HTTP round trip through its JSON gateway). The daemon reports the totals as the Prometheus
counter ``ckptcache_coordinator_requests{op}`` and logs the count of each remote load, so the
cost of a plan is measured, not guessed (``benchmarks/restore/README.md``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from ckptcache.server.cluster.coord.base import Coordinator, NodeInfo, Revisioned

__all__ = ["CountingCoordinator"]


class CountingCoordinator(Coordinator):
    """Delegates to ``inner``; counts each request, in total and in the caller's :meth:`tally`."""

    def __init__(self, inner: Coordinator, on_request: Callable[[str], None] | None = None):
        super().__init__(inner.prefix, inner.ttl)
        self.inner = inner
        self.totals: Counter[str] = Counter()
        self._on_request = on_request
        self._local = threading.local()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def tally(self) -> Iterator[Counter[str]]:
        """Count the requests this thread makes inside the ``with`` block (nestable)."""
        scopes: list[Counter[str]] = self._scopes()
        mine: Counter[str] = Counter()
        scopes.append(mine)
        try:
            yield mine
        finally:
            scopes.remove(mine)

    def _scopes(self) -> list[Counter[str]]:
        scopes: list[Counter[str]] | None = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def _count(self, op: str) -> None:
        with self._lock:
            self.totals[op] += 1
        for scope in self._scopes():
            scope[op] += 1
        if self._on_request is not None:
            self._on_request(op)

    def join(self, node: NodeInfo) -> None:
        self._count("join")
        self.node = node
        self.inner.join(node)

    def announce(self, key: str, value: dict[str, Any]) -> None:
        self._count("announce")
        self.inner.announce(key, value)

    def withdraw(self, key: str) -> None:
        self._count("withdraw")
        self.inner.withdraw(key)

    def elect(self, key: str, value: dict[str, Any]) -> bool:
        self._count("elect")
        return self.inner.elect(key, value)

    def release(self, key: str) -> bool:
        self._count("release")
        return self.inner.release(key)

    def record(self, key: str, value: dict[str, Any]) -> None:
        self._count("record")
        self.inner.record(key, value)

    def read(self, key: str) -> Revisioned:
        self._count("get")
        return self.inner.read(key)

    def advance(
        self, key: str, value: dict[str, Any], field: str, expect: Revisioned | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        self._count("advance")
        return self.inner.advance(key, value, field, expect)

    def get(self, key: str) -> dict[str, Any] | None:
        self._count("get")
        return self.inner.get(key)

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        self._count("scan")
        return self.inner.scan(prefix)

    def live_nodes(self) -> list[NodeInfo]:
        self._count("live_nodes")
        return self.inner.live_nodes()

    def wait_change(self, timeout: float) -> None:
        self.inner.wait_change(timeout)  # not a request: a local wait (see the base class)

    def healthy(self) -> bool:
        return self.inner.healthy()

    def close(self) -> None:
        self.inner.close()
