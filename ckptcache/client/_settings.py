"""A client's settings: which daemon, which namespace, how long to wait, what a missing daemon
does. One object shared by the client's parts, so a change (``client.fallback = "raise"``)
reaches every part at once."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ckptcache._defaults import (
    candidate_sockets,
    default_allow_stale,
    default_fallback,
    default_namespace,
)

__all__ = ["FALLBACKS", "Setting", "Settings", "check_timeout", "discover_socket"]

#: What a save does when the daemon is gone or full: write the file itself, or raise.
FALLBACKS = ("write-through", "raise")


def discover_socket() -> str:
    """The first default socket that exists (the daemon may start later: then the first)."""
    candidates = candidate_sockets()
    return next((p for p in candidates if os.path.exists(p)), candidates[0])


@dataclass
class Settings:
    """What :class:`~ckptcache.client.Client` was given, with the environment's defaults."""

    socket_path: str
    #: Whether ``socket_path`` was given: else it is looked up again at each reconnect.
    explicit_socket: bool
    namespace: str
    timeout: float
    fallback: str
    daemon_uid: int | None
    #: While the cluster's coordinator is unreachable, load a possibly older copy (this
    #: node's, or the stored file) instead of raising CoordinatorUnavailable.
    allow_stale: bool = False

    @classmethod
    def resolve(
        cls,
        socket_path: str | None,
        namespace: str | None,
        timeout: float,
        fallback: str | None,
        daemon_uid: int | None,
        allow_stale: bool | None = None,
    ) -> Settings:
        """The settings for these arguments (``None``: the environment's default)."""
        fallback = fallback or default_fallback()
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be 'write-through' or 'raise', not {fallback!r}")
        if allow_stale is not None and not isinstance(allow_stale, bool):
            raise TypeError(f"allow_stale must be True, False or None, not {allow_stale!r}")
        if check_timeout(timeout) is None or timeout == 0:  # a client's requests need a limit
            raise ValueError(f"timeout must be a positive, finite number of seconds, not {timeout}")
        if socket_path is not None and not isinstance(socket_path, (str, os.PathLike)):
            raise TypeError(f"socket_path must be a path, not {type(socket_path).__name__}")
        if socket_path is not None:
            socket_path = os.fspath(socket_path)
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {namespace!r}")
        if daemon_uid is not None and (
            not isinstance(daemon_uid, int) or isinstance(daemon_uid, bool) or daemon_uid < 0
        ):
            raise TypeError(f"daemon_uid must be a user id (an int >= 0), not {daemon_uid!r}")
        return cls(
            socket_path or discover_socket(), bool(socket_path), namespace or default_namespace(),
            timeout, fallback, daemon_uid,
            default_allow_stale() if allow_stale is None else allow_stale,
        )  # fmt: skip

    def given(self) -> dict[str, Any]:
        """The arguments that make a client with these settings (its own connection)."""
        return {
            "socket_path": self.socket_path if self.explicit_socket else None,
            "namespace": self.namespace,
            "timeout": self.timeout,
            "fallback": self.fallback,
            "daemon_uid": self.daemon_uid,
            "allow_stale": self.allow_stale,
        }

    def server_wait(self) -> float:
        """How long the daemon may wait inside one request: well inside our own timeout, so
        the reply (an error at worst) arrives before the connection is given up."""
        return max(0.0, min(self.timeout * 0.8, self.timeout - 1.0))


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` (seconds), checked: None or a number >= 0 (``inf``: None, no limit);
    :class:`TypeError` or :class:`ValueError` naming ``name`` otherwise."""
    if timeout is None:
        return None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"{name} must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, not {timeout}")
    return None if math.isinf(timeout) else float(timeout)


class Setting:
    """A field of the owner's :class:`Settings` (its ``settings``), read and written as the
    owner's own attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.settings, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.settings, self.name, value)
