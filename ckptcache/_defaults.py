"""Defaults shared by the client and the daemon (documented in README: "Configuration")."""

from __future__ import annotations

import os

__all__ = [
    "ENV_FALLBACK_LOG_EVERY",
    "ENV_NAMESPACE",
    "ENV_REQUIRE",
    "ENV_SOCKET",
    "default_fallback",
    "default_namespace",
    "default_shm_dir",
    "default_socket",
    "fallback_log_every",
]

#: Clients find their daemon through this variable before trying the default path.
ENV_SOCKET = "CKPTCACHE_SOCKET"
#: The job namespace: objects of different jobs on one node never collide.
ENV_NAMESPACE = "CKPTCACHE_NAMESPACE"
#: ``1``: a missing daemon is an error (``DaemonUnavailable``), never a silent write-through.
ENV_REQUIRE = "CKPTCACHE_REQUIRE"
#: Log a line every this many write-through fallbacks (the first one is always logged).
ENV_FALLBACK_LOG_EVERY = "CKPTCACHE_FALLBACK_LOG_EVERY"


def default_socket() -> str:
    """``$CKPTCACHE_SOCKET``, else ``/tmp/ckptcache-<uid>/daemon.sock``."""
    return os.environ.get(ENV_SOCKET) or f"/tmp/ckptcache-{os.getuid()}/daemon.sock"


def default_shm_dir() -> str:
    """Where a daemon keeps its segments unless configured: ``/dev/shm/ckptcache-<uid>``."""
    return f"/dev/shm/ckptcache-{os.getuid()}"


def default_namespace() -> str:
    """``$CKPTCACHE_NAMESPACE``, else ``default``."""
    return os.environ.get(ENV_NAMESPACE) or "default"


def default_fallback() -> str:
    """``"raise"`` when ``$CKPTCACHE_REQUIRE`` is set to a true value, else ``"write-through"``."""
    required = os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes", "on")
    return "raise" if required else "write-through"


def fallback_log_every() -> int:
    """``$CKPTCACHE_FALLBACK_LOG_EVERY`` (default 100, at least 1)."""
    try:
        return max(1, int(os.environ.get(ENV_FALLBACK_LOG_EVERY) or 100))
    except ValueError:
        return 100
