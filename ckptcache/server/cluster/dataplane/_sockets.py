"""Socket plumbing the data plane's parts share: exact reads (with a deadline for the
handshake), the options that find a dead peer in seconds, and a hang-up that wakes a reader."""

from __future__ import annotations

import socket
import time

__all__ = ["DEAD_PEER_SECONDS", "recv_exact", "recv_exact_into", "shutdown", "tune"]


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (see :func:`recv_exact_into`)."""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` (monotonic) the whole read must finish by
    then, however the peer dribbles its bytes."""
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake deadline passed")
            sock.settimeout(left)
        try:
            n = sock.recv_into(view)
        except TimeoutError as e:
            if deadline is None:
                raise
            raise TimeoutError("handshake deadline passed") from e
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


#: Seconds a peer may leave our bytes (or keep-alive probes) unacknowledged before its
#: connection fails (``TCP_USER_TIMEOUT``), by default: the daemon's ``dead_peer_timeout``.
#: A peer cut off by a partition, or whose host died, is found in this time rather than after
#: the socket timeout, which would hold a ``durability="backup"`` save past its client's
#: timeout; a slow but live peer keeps acknowledging and never trips it.
DEAD_PEER_SECONDS = 10.0


def tune(sock: socket.socket, dead_peer: float = DEAD_PEER_SECONDS) -> None:
    """Low latency, keep-alive probes and a dead-peer timeout of ``dead_peer`` seconds, and
    socket buffers sized for bulk records."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Keep-alive probes start after a quiet spell well inside the dead-peer time (2 s, less
    # for a shorter one), so an idle connection to a vanished peer is found in that time too.
    probe = max(1, min(2, int(dead_peer / 3)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_peer * 1000))
    except (OSError, AttributeError):  # not Linux: the socket timeout still bounds the wait
        pass
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


def shutdown(conn: socket.socket) -> None:
    """Hang ``conn`` up both ways: the thread reading it sees the end and closes it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
