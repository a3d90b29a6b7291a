"""Is the cache on? One answer for users and adapters, so a silent fallback is visible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptcache.errors import CkptCacheError, DaemonUnavailable
from ckptcache.wire.messages import DaemonStatus

if TYPE_CHECKING:
    from ckptcache.client._client import Client

__all__ = ["CacheStatus", "cache_status"]


@dataclass(frozen=True)
class CacheStatus:
    """Whether this process's saves go through a daemon (``reachable``), which one, and how
    many saves were written through to storage instead (``fallbacks``)."""

    reachable: bool
    socket: str
    namespace: str
    #: ``"write-through"`` or ``"raise"`` (``CKPTCACHE_REQUIRE=1``): what a missing daemon does.
    fallback: str
    fallbacks: int = 0
    #: Why the daemon is not reachable ("" when it is).
    error: str = ""
    #: The daemon's counters (memory reserved vs stored, segments, ...) when reachable.
    daemon: DaemonStatus | None = None

    def describe(self) -> str:
        """One line for logs."""
        if self.reachable:
            return f"cache reachable at {self.socket} (namespace {self.namespace!r})"
        then = "saves fail" if self.fallback == "raise" else "saves write through to storage"
        return f"cache NOT reachable at {self.socket}: {self.error}; {then}"


def cache_status(client: Client) -> CacheStatus:
    """Ask ``client``'s daemon for its status; a missing daemon is an answer, not an error."""
    common = {"socket": client.socket_path, "namespace": client.namespace,
              "fallback": client.fallback, "fallbacks": client.fallbacks}  # fmt: skip
    try:
        return CacheStatus(True, daemon=client.daemon_status(), **common)  # type: ignore[arg-type]
    except DaemonUnavailable as e:
        return CacheStatus(False, error=str(e), **common)  # type: ignore[arg-type]
    except CkptCacheError as e:  # a daemon that answers wrongly (protocol, permissions)
        return CacheStatus(False, error=f"{type(e).__name__}: {e}", **common)  # type: ignore[arg-type]
