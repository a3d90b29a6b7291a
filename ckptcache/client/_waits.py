"""Waiting for persistence: ``Client.wait`` and a save with ``durability="persisted"``.

A wait first lets this client's own non-blocking saves of the paths finish (a save still
copying is not in the daemon yet), then asks the daemon, in slices of at most 30 s on the
second connection, until each path is persisted, or will never be (an error that says why).
"""

from __future__ import annotations

import time

from ckptcache.client._connection import Connection
from ckptcache.client._ledger import Ledger
from ckptcache.client._paths import in_storage
from ckptcache.client._settings import Settings
from ckptcache.errors import (
    CheckpointDeleted,
    CheckpointNotFound,
    PathNotAllowed,
    PersistConflict,
    PersistError,
    PersistTimeout,
)
from ckptcache.wire import messages as m
from ckptcache.wire.states import WaitState

__all__ = ["Waits"]

#: The longest one wait request may block in the daemon: no request outlives the connection.
_SLICE_SECONDS = 30.0


def _settled(reply: m.WaitReply, path: str, strict: bool) -> bool:
    """Whether ``reply`` ends the wait for ``path``; raises when it ends in an error (in
    ``strict`` mode: a path asked for by name, not one of everything this client saved)."""
    state = reply.state
    if state == WaitState.PERSISTED:
        return True
    if state == WaitState.FAILED:
        raise PersistError(f"persisting {path!r} failed: {reply.error}")
    if state == WaitState.CONFLICT:
        raise PersistConflict(f"{path!r} was not persisted: {reply.error}")
    if state == WaitState.SUPERSEDED:
        return True  # storage holds a write made after this save: nothing left to wait for
    if state == WaitState.DROPPED:
        if not strict:
            return True  # the user removed its directory: nothing left to wait for
        raise CheckpointDeleted(f"{path!r} will not be persisted: {reply.error}")
    if state == WaitState.MEMORY_ONLY:
        if not strict:
            return True
        raise PathNotAllowed(
            f"{path!r} is cached in memory only: it is under no --persist-root of the "
            "daemon, so it will never be persisted"
        )
    return False


class Waits:
    """Waits for this client's saves, and the daemon's persists."""

    def __init__(self, settings: Settings, connection: Connection, ledger: Ledger):
        self._settings, self._connection, self._ledger = settings, connection, ledger

    def wait(self, path: str | None, prefix: str | None, timeout: float | None) -> None:
        """See :meth:`Client.wait` (``path`` and ``prefix`` normalized, not both given)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._saves(path, prefix, deadline)
        self.persisted(path, prefix, deadline)

    def _saves(self, path: str | None, prefix: str | None, deadline: float | None) -> None:
        """Wait for this client's pending non-blocking saves of ``path`` (under ``prefix``,
        or all): a save still copying is not in the daemon yet, so it has nothing to wait on."""
        from concurrent.futures import TimeoutError as FutureTimeout

        from ckptcache.client._async import pending_saves

        def match(p: str) -> bool:
            return p == path if path is not None else prefix is None or p.startswith(prefix)

        for handle in pending_saves(self._ledger, match):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(left)
            except FutureTimeout:
                raise PersistTimeout(
                    f"the non-blocking save of {handle.path!r} did not finish within the timeout"
                ) from None

    def persisted(self, path: str | None, prefix: str | None, deadline: float | None) -> None:
        """The daemon side of a wait: ``path``, every object under ``prefix``, or with
        neither, every path this client saved through the daemon."""
        if prefix is not None:
            self._one(prefix, True, deadline)
            return
        paths = [path] if path is not None else sorted(self._ledger.saved)
        for p in paths:
            self._one(p, False, deadline, strict=path is not None)

    def _one(self, path: str, prefix: bool, deadline: float | None, strict: bool = True) -> None:
        while True:
            # Wait in slices so no single request outlives the connection's timeout.
            left = _SLICE_SECONDS if deadline is None else deadline - time.monotonic()
            wait = min(left, _SLICE_SECONDS, self._settings.server_wait())
            req = m.WaitRequest(self._settings.namespace, path, prefix, max(0.0, wait))
            if not prefix and path in self._ledger.written_through:
                return  # its file is complete on storage (fsynced, renamed): persisted
            try:
                reply = self._connection.waiting().call("wait", req, m.WaitReply)
            except CheckpointNotFound:
                if in_storage(path) or not strict:
                    return  # written through, or evicted after it was persisted
                raise
            if _settled(reply, path, strict):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise PersistTimeout(f"{path!r} was not persisted within the timeout")
