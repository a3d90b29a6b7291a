"""Defaults shared by the client and the daemon (documented in README: "Configuration")."""

from __future__ import annotations

import os

__all__ = ["ENV_NAMESPACE", "ENV_SOCKET", "default_namespace", "default_shm_dir", "default_socket"]

#: Clients find their daemon through this variable before trying the default path.
ENV_SOCKET = "CKPTCACHE_SOCKET"
#: The job namespace: objects of different jobs on one node never collide.
ENV_NAMESPACE = "CKPTCACHE_NAMESPACE"


def default_socket() -> str:
    """``$CKPTCACHE_SOCKET``, else ``/tmp/ckptcache-<uid>/daemon.sock``."""
    return os.environ.get(ENV_SOCKET) or f"/tmp/ckptcache-{os.getuid()}/daemon.sock"


def default_shm_dir() -> str:
    """Where a daemon keeps its segments unless configured: ``/dev/shm/ckptcache-<uid>``."""
    return f"/dev/shm/ckptcache-{os.getuid()}"


def default_namespace() -> str:
    """``$CKPTCACHE_NAMESPACE``, else ``default``."""
    return os.environ.get(ENV_NAMESPACE) or "default"
