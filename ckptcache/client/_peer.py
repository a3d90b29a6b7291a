"""Who the client talks to: the daemon socket's directory and peer credentials are checked
before the first byte is sent.

A user who pre-creates the socket directory of a daemon that is not running could otherwise
run a daemon there and receive (and alter) a root trainer's checkpoints.
"""

from __future__ import annotations

import os
import socket
import struct

from ckptcache._defaults import ENV_DAEMON_UID
from ckptcache._secure_fs import foreign_control
from ckptcache.errors import DaemonUnavailable

__all__ = ["connect_daemon", "trusted_daemon_uids"]

_PEERCRED = struct.Struct("3i")


def trusted_daemon_uids(daemon_uid: int | None = None) -> set[int]:
    """Root, this process's uid, and ``daemon_uid`` or ``$CKPTCACHE_DAEMON_UID`` if set."""
    trusted = {0, os.geteuid()}
    if daemon_uid is None:
        env = os.environ.get(ENV_DAEMON_UID, "").strip()
        if env:
            try:
                daemon_uid = int(env)
            except ValueError:
                raise DaemonUnavailable(f"{ENV_DAEMON_UID}={env!r} is not a numeric uid") from None
    if daemon_uid is not None:
        trusted.add(daemon_uid)
    return trusted


def _check_socket_dir(path: str, trusted: set[int]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(directory)
    except OSError as e:
        raise DaemonUnavailable(f"no ckptcache daemon at {path} ({e.strerror})") from e
    problem = foreign_control(st, trusted)
    if problem is not None:
        raise DaemonUnavailable(
            f"refusing the daemon socket {path}: its directory {directory} {problem}, so "
            f"another user could plant a socket there (trusted: root, you and {ENV_DAEMON_UID})"
        )


def connect_daemon(path: str, trusted: set[int], timeout: float) -> socket.socket:
    """A connected Unix socket to ``path`` whose listener runs as a trusted uid.

    Raises :class:`DaemonUnavailable` naming the reason when the directory or the peer is not
    trusted; nothing has been sent on the socket when this returns.
    """
    _check_socket_dir(path, trusted)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, _gid = _PEERCRED.unpack(raw)
        if uid not in trusted:
            raise DaemonUnavailable(
                f"refusing the daemon at {path}: it runs as uid {uid} (pid {pid}), which is "
                f"neither root, you, nor {ENV_DAEMON_UID}; a local user may be squatting on "
                "the socket"
            )
        sock.settimeout(None)
    except DaemonUnavailable:  # a ConnectionError, hence an OSError: handled first
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise DaemonUnavailable(
            f"no ckptcache daemon at {path} ({e.strerror or e}); start one with "
            "`ckptcache daemon` or set CKPTCACHE_SOCKET"
        ) from e
    return sock
