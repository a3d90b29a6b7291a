"""The single-node coordinator: everything in this process, nothing to install."""

from __future__ import annotations

import threading
from typing import Any

from ckptcache.server.cluster.coord.base import Coordinator, NodeInfo, Revisioned, order_of
from ckptcache.server.cluster.coord.keys import node_key

__all__ = ["EmbeddedCoordinator"]


class EmbeddedCoordinator(Coordinator):
    """In-process dictionaries; "leased" keys live until :meth:`close` (the process is the
    lease). Several instances may share one ``store`` to stand in for nodes in unit tests."""

    def __init__(self, prefix: str, ttl: float, store: dict[str, Any] | None = None):
        super().__init__(prefix, ttl)
        self._store: dict[str, Any] = {} if store is None else store
        # Key -> the value this instance put under its "lease": a key another instance has
        # since put (after this one withdrew or lost it) is not this instance's to remove.
        self._leased: dict[str, Any] = {}
        # Instances sharing a store share its lock, a condition: a write wakes every waiter
        # (the key starts with NUL, outside every prefix, so scans never see it).
        self._lock: threading.Condition = self._store.setdefault("\0changed", threading.Condition())

    def join(self, node: NodeInfo) -> None:
        self.node = node
        self.announce(node_key(node.node_id), node.to_dict())

    def announce(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._store[self.prefix + key] = self._leased[key] = value
            self._lock.notify_all()

    def withdraw(self, key: str) -> None:
        with self._lock:
            self._store.pop(self.prefix + key, None)
            self._leased.pop(key, None)
            self._lock.notify_all()

    def elect(self, key: str, value: dict[str, Any]) -> bool:
        with self._lock:
            if self.prefix + key in self._store:
                return False
            self._store[self.prefix + key] = self._leased[key] = value
            self._lock.notify_all()
            return True

    def release(self, key: str) -> bool:
        with self._lock:
            value = self._leased.pop(key, None)
            if value is None or self._store.get(self.prefix + key) is not value:
                return False
            del self._store[self.prefix + key]
            self._lock.notify_all()
            return True

    def record(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._store[self.prefix + key] = value
            self._lock.notify_all()

    def advance(
        self, key: str, value: dict[str, Any], field: str, expect: Revisioned | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._lock:
            found = self._store.get(self.prefix + key)
            before = dict(found) if found is not None else None
            if order_of(before, field) >= order_of(value, field):
                return False, before
            self._store[self.prefix + key] = dict(value)
            self._lock.notify_all()
            return True, before

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            value = self._store.get(self.prefix + key)
            return dict(value) if value is not None else None

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        full = self.prefix + prefix
        with self._lock:
            return {
                k[len(self.prefix) :]: dict(v) for k, v in self._store.items() if k.startswith(full)
            }

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            for key, value in self._leased.items():
                if self._store.get(self.prefix + key) is value:
                    del self._store[self.prefix + key]
            self._leased.clear()
            self._lock.notify_all()

    def wait_change(self, timeout: float) -> None:
        """Return when any instance on this store writes, or after ``timeout`` seconds."""
        with self._lock:
            self._lock.wait(max(0.0, timeout))
