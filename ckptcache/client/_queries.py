"""Queries: what the cache (or storage) holds, and requests that change no checkpoint's bytes:
``status``, ``exists``, ``delete``, ``list``, ``verify``, ``prefetch`` and the daemon's own
counters."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from typing import Any

from ckptcache.client._connection import Connection
from ckptcache.client._paths import complete_in_storage, is_url, normalize_path
from ckptcache.client._settings import Settings
from ckptcache.errors import CheckpointNotFound, DaemonUnavailable
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState

__all__ = ["Queries"]


class Queries:
    """Answers a client's questions (see :class:`~ckptcache.client.Client` for each)."""

    def __init__(self, settings: Settings, connection: Connection):
        self._settings, self._connection = settings, connection

    def status(self, path: str) -> m.ObjectInfo:
        """What the cache (or storage) holds for ``path`` (normalized)."""
        namespace = self._settings.namespace
        try:
            return self._connection.call("stat", m.StatRequest(namespace, path), m.ObjectInfo)  # type: ignore[no-any-return]
        except (CheckpointNotFound, DaemonUnavailable) as e:
            if not complete_in_storage(path):
                if isinstance(e, DaemonUnavailable):
                    raise
                # The daemon's answer covers its memory alone ("load it from storage"):
                # storage was looked at too, and holds nothing complete there either.
                raise CheckpointNotFound(
                    f"{path!r} is neither cached (namespace {namespace!r}) nor "
                    f"{_on_storage(path)}; check the path"
                ) from e
            size, mtime = (
                (os.path.getsize(path), os.path.getmtime(path)) if not is_url(path) else (0, 0.0)
            )
            return m.ObjectInfo(
                namespace, path, 0, size, ("storage",), mtime, "", 0, False,
                persist_state=PersistState.PERSISTED,
            )  # fmt: skip

    def exists(self, path: str) -> bool:
        """Whether ``path`` (normalized) can be loaded from the cache or from storage."""
        try:
            self.status(path)
        except (CheckpointNotFound, DaemonUnavailable):
            return False
        return True

    def delete(self, path: str) -> int:
        """Drop every cached generation of ``path``; the count dropped."""
        request = m.DeleteRequest(self._settings.namespace, path)
        return int(self._connection.call("delete", request, m.DeleteReply).dropped)

    def list(self, prefix: str, all_namespaces: bool) -> list[m.ObjectInfo]:
        """Newest generation of every cached path starting with ``prefix``."""
        ns = None if all_namespaces else self._settings.namespace
        reply = self._connection.call("list", m.ListRequest(ns, prefix), m.ListReply)
        return list(reply.objects)

    def verify(self, path: str) -> m.VerifyReply:
        """The daemon's recomputation of ``path``'s digests."""
        request = m.VerifyRequest(self._settings.namespace, path)
        return self._connection.call("verify", request, m.VerifyReply)  # type: ignore[no-any-return]

    def prefetch(
        self, paths: Any, progress: Callable[[int, int, str, str], None] | None
    ) -> builtins.list[str]:
        """Warm this node's cache with ``paths``; the tier each came from."""
        one = isinstance(paths, (str, os.PathLike))
        items = [normalize_path(p) for p in ([paths] if one else paths)]
        tiers = []
        for i, path in enumerate(items):
            req = m.PrefetchRequest(self._settings.namespace, path, self._settings.server_wait())
            reply = self._connection.waiting().call("prefetch", req, m.PrefetchReply)
            tiers.append(reply.tier)
            if progress is not None:
                progress(i + 1, len(items), path, reply.tier)
        return tiers

    def pool(self) -> m.PoolReply:
        """The daemon's spare segments."""
        return self._connection.call("pool", m.PoolRequest(), m.PoolReply)  # type: ignore[no-any-return]

    def daemon_status(self) -> m.DaemonStatus:
        """Daemon-wide counters."""
        return self._connection.call("status", m.StatusRequest(), m.DaemonStatus)  # type: ignore[no-any-return]


def _on_storage(path: str) -> str:
    """Where storage stands for a path it holds no complete checkpoint of."""
    if not is_url(path) and os.path.lexists(path):
        return "a complete checkpoint on storage (the file there is not one: inspect --verify)"
    return "on storage"
