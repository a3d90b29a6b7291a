"""The data plane's server: accept peers, bound them, run the handshake, dispatch requests.

Requests (JSON records, bulk records follow; handlers are the cluster's):

* ``push``: header, then the segment bytes ``[HEADER_SIZE, nbytes)``; the receiver reserves a
  segment in its own arena, receives into it, verifies every digest and commits a replica.
* ``fetch``: the sender replies with a header and the bytes of its newest generation.

Exhaustion: a handshake must finish within ``handshake_timeout``; at most
``max_unauthenticated`` connections wait in it (the oldest is dropped for a newcomer) and
``max_connections`` are served at all; the accept loop backs off on ``EMFILE``/``ENFILE``
instead of dying.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptcache.server.backoff import ACCEPT
from ckptcache.server.cluster.dataplane._sockets import DEAD_PEER_SECONDS, shutdown, tune
from ckptcache.server.cluster.dataplane.handshake import TLSConfig, node_id_bytes, server_handshake
from ckptcache.server.cluster.dataplane.records import Channel, ChannelTampered, recv_msg, send_msg

__all__ = ["ConnectionLimits", "DataPlaneServer", "Handler"]

log = logging.getLogger(__name__)

#: accept() errors that mean "out of a resource for now": back off and go on.
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

#: One request's handler: the channel it came on and the request's JSON message.
Handler = Callable[[Channel, dict[str, Any]], None]


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds that keep a flood of peers (or of idle sockets) from exhausting the daemon."""

    handshake_timeout: float = 5.0
    max_connections: int = 256
    max_unauthenticated: int = 32
    #: Seconds of silence after which an accepted peer counts as dead (``TCP_USER_TIMEOUT``).
    dead_peer: float = DEAD_PEER_SECONDS

    def capped(self, open_files: int) -> ConnectionLimits:
        """These limits, with at most half of ``open_files`` spent on peers (segments, the
        control socket and storage need the rest)."""
        total = max(4, min(self.max_connections, open_files // 2))
        return dataclasses.replace(
            self, max_connections=total, max_unauthenticated=min(self.max_unauthenticated, total)
        )


def _open_file_limit() -> int:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _Throttled:
    """At most ``burst`` log lines per ``every`` seconds (a flood must not flood the log);
    the first line of a window says how many the previous one dropped."""

    def __init__(self, burst: int = 1, every: float = 5.0):
        self.burst, self.every = burst, every
        self._window, self._count, self._dropped = float("-inf"), 0, 0

    def ready(self) -> str | None:
        """None to drop this line; else a suffix for it (empty, or the dropped count)."""
        now = time.monotonic()
        if now - self._window >= self.every:
            dropped, self._window, self._count, self._dropped = self._dropped, now, 0, 0
            self._count += 1
            return f" ({dropped} similar lines dropped)" if dropped else ""
        if self._count < self.burst:
            self._count += 1
            return ""
        self._dropped += 1
        return None


class DataPlaneServer:
    """Accepts authenticated peers and dispatches their requests to ``handlers[op]``."""

    def __init__(
        self,
        listen: str,
        secret: bytes,
        handlers: dict[str, Handler],
        tls: TLSConfig | None = None,
        *,
        node_id: str = "",
        limits: ConnectionLimits | None = None,
    ):
        host, _, port = listen.rpartition(":")
        self.secret = secret
        self.handlers = handlers
        self.node_id = node_id
        self._id = node_id_bytes(node_id)
        self.limits = (limits or ConnectionLimits()).capped(_open_file_limit())
        self._tls = tls.server_context() if tls is not None else None
        self.sock = socket.create_server((host or "0.0.0.0", int(port)), reuse_port=False)
        self.address = f"{host or '127.0.0.1'}:{self.sock.getsockname()[1]}"
        self._stop = False
        self._lock = threading.Lock()
        #: Connections still in the handshake, oldest first; and every connection served.
        self._pending: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._active: set[socket.socket] = set()
        self._refusals = _Throttled()
        self._evictions = _Throttled()
        self._accept_errors = _Throttled()
        self._failed_handshakes = _Throttled(burst=10)

    def start(self) -> None:
        """Serve in a background thread."""
        threading.Thread(target=self._accept_loop, name="dataplane", daemon=True).start()

    def close(self) -> None:
        """Stop accepting."""
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        exhausted = 0  # accept() failures in a row for want of descriptors
        while not self._stop:
            try:
                conn, peer = self.sock.accept()
            except OSError as e:
                if self._stop:
                    return
                if e.errno in _EXHAUSTED:
                    # Out of descriptors (or kernel memory): the pending connection stays in
                    # the backlog; wait for handshakes to end or time out, then go on.
                    backoff = ACCEPT.delay(exhausted)
                    exhausted += 1
                    if (more := self._accept_errors.ready()) is not None:
                        log.error("data-plane accept failed (%s); backing off %.2fs%s",
                                  errno.errorcode.get(e.errno or 0, e), backoff, more)  # fmt: skip
                    time.sleep(backoff)
                elif isinstance(e, (socket.timeout, InterruptedError, ConnectionAbortedError)):
                    pass  # one aborted connection; the listener is fine
                else:
                    log.exception("data-plane accept failed; going on")
                    time.sleep(0.1)
                continue
            exhausted = 0
            if self._admit(conn, peer):
                threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _admit(self, conn: socket.socket, peer: Any) -> bool:
        """Bound the connections: refuse beyond ``max_connections``; beyond
        ``max_unauthenticated`` in the handshake, drop the oldest of them for the newcomer."""
        evicted: socket.socket | None = None
        with self._lock:
            if len(self._active) >= self.limits.max_connections:
                full = True
            else:
                full = False
                if len(self._pending) >= self.limits.max_unauthenticated:
                    evicted, _ = self._pending.popitem(last=False)
                self._pending[conn] = None
                self._active.add(conn)
        if full:
            if (more := self._refusals.ready()) is not None:
                log.warning("refused data-plane peer %s: %d connections already served%s",
                            peer, self.limits.max_connections, more)  # fmt: skip
            conn.close()
            return False
        if evicted is not None:
            if (more := self._evictions.ready()) is not None:
                log.warning("dropped the oldest unauthenticated data-plane connection: "
                            "%d handshakes pending%s",
                            self.limits.max_unauthenticated, more)  # fmt: skip
            shutdown(evicted)  # its thread sees the hang-up and closes it
        return True

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        channel: Channel | None = None
        tracked = conn  # the accepted socket, as counted by _admit (TLS wraps it anew)
        try:
            tune(conn, self.limits.dead_peer)
            deadline = time.monotonic() + self.limits.handshake_timeout
            try:
                if self._tls is not None:
                    conn.settimeout(self.limits.handshake_timeout)
                    conn = self._tls.wrap_socket(conn, server_side=True)
                channel = server_handshake(conn, self.secret, self._id, deadline)
            except (OSError, ValueError) as e:  # hung up, timed out or garbled: no proof
                self._refuse(peer, str(e) or type(e).__name__)
                return
            if channel is None:
                self._refuse(peer, "wrong proof")
                return
            with self._lock:
                self._pending.pop(tracked, None)
            conn.settimeout(300)
            self._requests(channel, peer)
        except (OSError, ValueError) as e:
            log.info("data-plane connection from %s ended: %s", peer, e)
        finally:
            with self._lock:
                self._pending.pop(tracked, None)
                self._active.discard(tracked)
            if channel is not None:
                channel.close()
            else:
                conn.close()

    def _refuse(self, peer: Any, why: str) -> None:
        if (more := self._failed_handshakes.ready()) is not None:
            log.warning("refused data-plane peer %s: failed the shared-secret handshake (%s)%s",
                        peer, why, more)  # fmt: skip

    def _requests(self, channel: Channel, peer: Any) -> None:
        while True:
            try:
                request = recv_msg(channel)
            except ChannelTampered as e:
                log.error("dropped data-plane peer %s (%s): %s", peer, channel.peer_id, e)
                return
            except ConnectionError:
                return
            handler = self.handlers.get(str(request.get("op")))
            if handler is None:
                send_msg(channel, {"ok": False, "error": "ProtocolMismatch",
                                   "message": f"unknown op {request.get('op')!r}"})  # fmt: skip
                return
            try:
                handler(channel, request)
            except ChannelTampered as e:
                log.error("dropped data-plane peer %s (%s): %s", peer, channel.peer_id, e)
                return
