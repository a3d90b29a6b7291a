"""Defaults shared by the client and the daemon (documented in docs/daemon.md and docs/api.md)."""

from __future__ import annotations

import os

__all__ = [
    "ENV_ALLOW_STALE",
    "ENV_DAEMON_UID",
    "ENV_FALLBACK_LOG_EVERY",
    "ENV_NAMESPACE",
    "ENV_REQUIRE",
    "ENV_SKIP_UNCHANGED",
    "ENV_SOCKET",
    "candidate_sockets",
    "default_allow_stale",
    "default_fallback",
    "default_namespace",
    "default_shm_dir",
    "default_socket",
    "fallback_log_every",
    "skip_unchanged",
]

#: Clients find their daemon through this variable before trying the default paths.
ENV_SOCKET = "CKPTCACHE_SOCKET"
#: The job namespace: objects of different jobs on one node never collide.
ENV_NAMESPACE = "CKPTCACHE_NAMESPACE"
#: A uid (besides root and the client's own) that clients accept as their daemon.
ENV_DAEMON_UID = "CKPTCACHE_DAEMON_UID"
#: ``0`` turns off saves that skip storages unchanged since (see Guarantees in docs/design.md).
ENV_SKIP_UNCHANGED = "CKPTCACHE_SKIP_UNCHANGED"

#: Where a daemon running as root listens: /run is writable by root alone.
ROOT_SOCKET = "/run/ckptcache/daemon.sock"


def _user_socket(uid: int) -> str:
    """A user daemon's socket: in ``$XDG_RUNTIME_DIR`` (private to the user) when set."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ckptcache", "daemon.sock")
    return f"/tmp/ckptcache-{uid}/daemon.sock"


#: ``1``: a missing daemon is an error (``DaemonUnavailable``), never a silent write-through.
ENV_REQUIRE = "CKPTCACHE_REQUIRE"
#: Set to a true value, loads accept a possibly older copy while the coordinator is down.
ENV_ALLOW_STALE = "CKPTCACHE_ALLOW_STALE"
#: Log a line every this many write-through fallbacks (the first one is always logged).
ENV_FALLBACK_LOG_EVERY = "CKPTCACHE_FALLBACK_LOG_EVERY"


def default_socket() -> str:
    """The daemon's socket: ``$CKPTCACHE_SOCKET``, else ``/run/ckptcache/daemon.sock`` for
    root and ``$XDG_RUNTIME_DIR/ckptcache/daemon.sock`` (or ``/tmp/ckptcache-<uid>/``) for
    other users."""
    explicit = os.environ.get(ENV_SOCKET)
    if explicit:
        return explicit
    uid = os.geteuid()
    return ROOT_SOCKET if uid == 0 else _user_socket(uid)


def candidate_sockets() -> list[str]:
    """Where a client looks for its daemon, in order: ``$CKPTCACHE_SOCKET``, else its own
    user's daemon, then the node's root daemon."""
    explicit = os.environ.get(ENV_SOCKET)
    if explicit:
        return [explicit]
    uid = os.geteuid()
    return [ROOT_SOCKET] if uid == 0 else [_user_socket(uid), ROOT_SOCKET]


def default_shm_dir() -> str:
    """Where a daemon keeps its segments unless configured: ``/dev/shm/ckptcache-<uid>``."""
    return f"/dev/shm/ckptcache-{os.geteuid()}"


def default_namespace() -> str:
    """``$CKPTCACHE_NAMESPACE``, else ``default``."""
    return os.environ.get(ENV_NAMESPACE) or "default"


def default_fallback() -> str:
    """``"raise"`` when ``$CKPTCACHE_REQUIRE`` is set to a true value, else ``"write-through"``."""
    required = os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes", "on")
    return "raise" if required else "write-through"


def default_allow_stale() -> bool:
    """Whether ``$CKPTCACHE_ALLOW_STALE`` is set to a true value."""
    return os.environ.get(ENV_ALLOW_STALE, "").strip().lower() in ("1", "true", "yes", "on")


def fallback_log_every() -> int:
    """``$CKPTCACHE_FALLBACK_LOG_EVERY`` (default 100, at least 1)."""
    try:
        return max(1, int(os.environ.get(ENV_FALLBACK_LOG_EVERY) or 100))
    except ValueError:
        return 100


def skip_unchanged() -> bool:
    """Whether saves may skip storages the kernel proves unwritten: unless
    ``$CKPTCACHE_SKIP_UNCHANGED`` is set to a false value."""
    value = os.environ.get(ENV_SKIP_UNCHANGED, "").strip().lower()
    return value not in ("0", "false", "no", "off")
