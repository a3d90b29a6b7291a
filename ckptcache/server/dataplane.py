"""The daemon-to-daemon data plane: plain TCP, every byte authenticated, bulk bytes by sendfile.

Every connection starts with a mutual challenge that also names both nodes::

    client -> server   MAGIC + client_nonce (16 B) + client_id (1-byte length + UTF-8)
    server -> client   server_nonce (16 B) + server_id + HMAC(secret, "server" + T)
    client -> server   HMAC(secret, "client" + T)

where ``T`` is the transcript (magic, both nonces, both ids). The client checks that the
server is the node it meant to dial (the id of the signed coordinator record), the server
that the client is not itself (reflection). Both then derive one key per direction,
``HMAC(secret, "c2s" + T)`` and ``HMAC(secret, "s2c" + T)``, and every byte after the
handshake travels in records::

    length (4 B, big endian) | payload | Poly1305 tag (16 B) over length + payload

keyed by a one-time key ``HMAC(direction key, sequence number)``. A relay that forwards the
handshake between two real nodes therefore cannot read its keys, inject, reorder, replay or
cut records unnoticed, and a replayed handshake fails on the fresh nonce of the other side.
The records are authenticated, not encrypted: confidentiality on an untrusted network needs
TLS (:class:`TLSConfig`, mutual TLS against the cluster CA; the challenge runs inside it).
Bulk payloads still leave by ``sendfile`` from the segment; their tags are computed alongside
(sender) and checked one record behind the receive position (receiver), so authentication
overlaps the transfer.

Requests (JSON records, bulk records follow):

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
import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import mmap
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.poly1305 import Poly1305

from ckptcache.errors import CkptCacheError

__all__ = [
    "Channel",
    "ChannelTampered",
    "DataPlaneClient",
    "DataPlaneServer",
    "PeerRefused",
    "TLSConfig",
    "recv_msg",
    "send_msg",
]

log = logging.getLogger(__name__)

MAGIC = b"CKPTDP2\n"
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_TAG = 16
_MAX_HEADER = 64 << 20  # headers carry manifests: ~150 bytes per tensor
#: Bulk record size: large enough to amortise a tag, small enough to pipeline its check.
RECORD_SIZE = 4 << 20
_MAX_ID = 255
#: accept() errors that mean "out of a resource for now": back off and go on.
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class PeerRefused(CkptCacheError, ConnectionRefusedError):
    """The peer failed the shared-secret handshake (or we failed its)."""


class ChannelTampered(CkptCacheError, ConnectionError):
    """A record on an authenticated connection failed its tag (injected, altered, reordered
    or cut): the connection is dropped and nothing it carried is used."""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
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
#: the 300 s socket timeout, which held a ``durability="backup"`` save past its client's
#: timeout; a slow but live peer keeps acknowledging and never trips it.
DEAD_PEER_SECONDS = 10.0


def _tune(sock: socket.socket, dead_peer: float = DEAD_PEER_SECONDS) -> None:
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


def _lp(data: bytes) -> bytes:
    return bytes([len(data)]) + data


def _node_id_bytes(node_id: str) -> bytes:
    raw = node_id.encode()
    if len(raw) > _MAX_ID:
        raise ValueError(f"node id longer than {_MAX_ID} bytes: {node_id!r}")
    return raw


def _transcript(cn: bytes, sn: bytes, cid: bytes, sid: bytes) -> bytes:
    return MAGIC + cn + sn + _lp(cid) + _lp(sid)


class Channel:
    """An authenticated connection: every record carries a tag under a per-direction key
    bound to the handshake, and a sequence number folded into the tag's one-time key."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, peer_id: str = ""):
        self.sock = sock
        self.peer_id = peer_id
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_handshake(
        cls, sock: socket.socket, secret: bytes, transcript: bytes, *, client: bool, peer_id: str
    ) -> Channel:
        """The channel both ends derive from one handshake transcript."""
        c2s, s2c = _mac(secret, b"c2s", transcript), _mac(secret, b"s2c", transcript)
        return cls(sock, *((c2s, s2c) if client else (s2c, c2s)), peer_id=peer_id)

    # ------------------------------------------------------------------ tags

    @staticmethod
    def _tag(key: bytes, seq: int, head: bytes, payload: Any) -> bytes:
        mac = Poly1305(_mac(key, _SEQ.pack(seq)))
        mac.update(head)
        mac.update(payload)
        return mac.finalize()

    def _next_send(self) -> int:
        seq, self._send_seq = self._send_seq, self._send_seq + 1
        return seq

    def _next_recv(self) -> int:
        seq, self._recv_seq = self._recv_seq, self._recv_seq + 1
        return seq

    def _check(self, seq: int, head: bytes, payload: Any, tag: bytes) -> None:
        if not hmac.compare_digest(self._tag(self._recv_key, seq, head, payload), tag):
            raise ChannelTampered(
                f"record {seq} from data-plane peer {self.peer_id or '?'} failed authentication"
            )

    def _helper(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dataplane-mac")
        return self._pool

    # ------------------------------------------------------------------ records

    def send_bytes(self, payload: bytes) -> None:
        """Send one record."""
        head = _LEN.pack(len(payload))
        self.sock.sendall(head + payload + self._tag(self._send_key, self._next_send(),
                                                     head, payload))  # fmt: skip

    def recv_bytes(self, limit: int = _MAX_HEADER) -> bytes:
        """Receive one record of at most ``limit`` bytes."""
        head = _recv_exact(self.sock, _LEN.size)
        (n,) = _LEN.unpack(head)
        if n > limit:
            raise ChannelTampered(f"oversize record ({n} bytes) from {self.peer_id or '?'}")
        payload = _recv_exact(self.sock, n)
        self._check(self._next_recv(), head, payload, _recv_exact(self.sock, _TAG))
        return payload

    def send_file(
        self,
        source: str | int,
        offset: int,
        count: int,
        mapping: mmap.mmap | None = None,
        *,
        record: int = RECORD_SIZE,
    ) -> None:
        """Send ``count`` bytes of file ``source`` (a path, or a descriptor the caller opened
        and keeps) from ``offset`` by ``sendfile`` (straight from the page cache), each
        record's tag computed from ``mapping`` (the caller's mapping of the file, already
        faulted in; else a fresh one) while the record leaves, in records of at most
        ``record`` bytes.

        ``socket.sendfile`` (not ``os.sendfile``): sockets with a timeout are non-blocking
        underneath, and it waits for writability instead of failing with EAGAIN.
        """
        if count <= 0:
            return
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(open(source, "rb", closefd=isinstance(source, str)))
            if mapping is None:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapping = stack.enter_context(
                    mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
                )
            view = stack.enter_context(memoryview(mapping))

            def tag_of(seq: int, head: bytes, start: int, n: int) -> bytes:
                with view[start : start + n] as part:  # released before the result is seen
                    return self._tag(self._send_key, seq, head, part)

            pos, end = offset, offset + count
            while pos < end:
                n = min(record, end - pos)
                head = _LEN.pack(n)
                tag = self._helper().submit(tag_of, self._next_send(), head, pos, n)
                try:
                    self.sock.sendall(head)
                    sent = self.sock.sendfile(f, pos, n)
                    if sent != n:
                        raise ConnectionError(f"sent {sent} of {n} bytes")
                finally:
                    wait([tag])  # never unmap under a running tag
                self.sock.sendall(tag.result())
                pos += n

    def recv_into(self, view: memoryview, progress: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` from records. Each record's tag is checked while the next one arrives;
        ``progress(n)`` reports each time the first ``n`` bytes are in place *and* verified:
        as soon as the check ends (from the checking thread), not when the next record is in,
        so a relay forwards a record one record's time sooner."""
        pos = 0
        pending: Future[None] | None = None
        failed: list[BaseException] = []  # a check or a progress report that failed

        def reported(end: int) -> Callable[[Future[None]], None]:
            def done(check: Future[None]) -> None:
                # Checks run in order on one thread: no report past a failed one.
                if failed or check.exception() is not None or progress is None:
                    return
                try:
                    progress(end)
                except BaseException as e:  # raised by the receiving thread below
                    failed.append(e)

            return done

        try:
            while pos < len(view):
                head = _recv_exact(self.sock, _LEN.size)
                (n,) = _LEN.unpack(head)
                if n == 0 or pos + n > len(view):
                    raise ChannelTampered(
                        f"record of {n} bytes overruns the {len(view) - pos} bytes expected "
                        f"from {self.peer_id or '?'}"
                    )
                recv_exact_into(self.sock, view[pos : pos + n])
                tag = _recv_exact(self.sock, _TAG)
                check = self._helper().submit(self._check_region, self._next_recv(), head,
                                              view, pos, n, tag)  # fmt: skip
                pos += n
                if pos < len(view):  # the last one is reported below, once all are done
                    check.add_done_callback(reported(pos))
                if pending is not None:
                    pending.result()  # an earlier record's error, raised here
                pending = check
            if pending is not None:
                check, pending = pending, None
                check.result()  # in order: every earlier check and its report are done
                if failed:
                    raise failed[0]
                if progress is not None:
                    progress(pos)
        finally:
            if pending is not None:
                wait([pending])  # an earlier error is propagating; never leave a check behind

    def _check_region(
        self, seq: int, head: bytes, view: memoryview, start: int, n: int, tag: bytes
    ) -> None:
        with view[start : start + n] as part:  # released before the caller may unmap ``view``
            self._check(seq, head, part, tag)

    def close(self) -> None:
        """Close the connection (and the tag helper)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        try:
            self.sock.close()
        except OSError:
            pass


def send_msg(channel: Channel, message: dict[str, Any]) -> None:
    """Send one JSON message as a record."""
    channel.send_bytes(json.dumps(message).encode())


def recv_msg(channel: Channel) -> dict[str, Any]:
    """Receive one JSON message."""
    message = json.loads(channel.recv_bytes())
    if not isinstance(message, dict):
        raise ConnectionError("malformed message")
    return message


Handler = Callable[[Channel, dict[str, Any]], None]


@dataclass(frozen=True)
class TLSConfig:
    """Optional TLS for the data plane: this node's certificate and key, and the cluster CA
    that every peer's certificate must be signed by (both directions are verified)."""

    cert: str
    key: str
    ca: str

    def server_context(self) -> ssl.SSLContext:
        """Context for accepted connections (peers must present a CA-signed certificate)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Context for outgoing connections.

        Peers are dialled by IP address, so host names are not checked; the CA signature and
        the shared-secret challenge (which names the node) together authenticate the peer.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds that keep a flood of peers (or of idle sockets) from exhausting the daemon."""

    handshake_timeout: float = 5.0
    max_connections: int = 256
    max_unauthenticated: int = 32
    #: Seconds of silence after which an accepted peer counts as dead (``_tune``).
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
        self._id = _node_id_bytes(node_id)
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
        backoff = 0.0
        while not self._stop:
            try:
                conn, peer = self.sock.accept()
            except OSError as e:
                if self._stop:
                    return
                if e.errno in _EXHAUSTED:
                    # Out of descriptors (or kernel memory): the pending connection stays in
                    # the backlog; wait for handshakes to end or time out, then go on.
                    backoff = min(1.0, max(0.05, backoff * 2))
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
            backoff = 0.0
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
            _shutdown(evicted)  # its thread sees the hang-up and closes it
        return True

    def _handshake(self, conn: socket.socket, deadline: float) -> Channel | None:
        hello = _recv_exact(conn, len(MAGIC) + 17, deadline)
        if not hello.startswith(MAGIC):
            return None
        client_nonce = hello[len(MAGIC) : len(MAGIC) + 16]
        client_id = _recv_exact(conn, hello[-1], deadline)
        if client_id == self._id and self._id:
            return None  # our own hello reflected back at us
        server_nonce = secrets.token_bytes(16)
        transcript = _transcript(client_nonce, server_nonce, client_id, self._id)
        conn.sendall(server_nonce + _lp(self._id) + _mac(self.secret, b"server", transcript))
        proof = _recv_exact(conn, 32, deadline)
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", transcript)):
            return None
        return Channel.from_handshake(conn, self.secret, transcript, client=False,
                                      peer_id=client_id.decode(errors="replace"))  # fmt: skip

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        channel: Channel | None = None
        tracked = conn  # the accepted socket, as counted by _admit (TLS wraps it anew)
        try:
            _tune(conn, self.limits.dead_peer)
            deadline = time.monotonic() + self.limits.handshake_timeout
            try:
                if self._tls is not None:
                    conn.settimeout(self.limits.handshake_timeout)
                    conn = self._tls.wrap_socket(conn, server_side=True)
                channel = self._handshake(conn, deadline)
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


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class DataPlaneClient:
    """One authenticated connection to a peer's data plane (``channel`` carries the requests).

    ``node_id`` names this node in the handshake; ``expect`` is the id the peer must prove
    (the node whose signed record gave ``address``); ``dead_peer``: seconds of silence
    (nothing acknowledged, no SYN answered) after which the peer counts as gone.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        timeout: float = 300.0,
        tls: TLSConfig | None = None,
        *,
        node_id: str = "",
        expect: str | None = None,
        dead_peer: float = DEAD_PEER_SECONDS,
    ):
        host, _, port = address.rpartition(":")
        self.address = address
        # A peer cut off by a partition never answers the SYN: give up on it as on a silent
        # connection (the kernel would retry for minutes), then use the caller's timeout.
        self.sock = socket.create_connection((host, int(port)), timeout=min(timeout, dead_peer))
        self.sock.settimeout(timeout)
        _tune(self.sock, dead_peer)
        client_nonce, own_id = secrets.token_bytes(16), _node_id_bytes(node_id)
        try:
            if tls is not None:
                self.sock = tls.client_context().wrap_socket(self.sock, server_hostname=host)
            self.sock.sendall(MAGIC + client_nonce + _lp(own_id))
            server_nonce = _recv_exact(self.sock, 16)
            server_id = _recv_exact(self.sock, _recv_exact(self.sock, 1)[0])
            proof = _recv_exact(self.sock, 32)
        except (OSError, ConnectionError) as e:
            self.close()
            raise PeerRefused(f"data-plane peer {address} refused the handshake: {e}") from e
        transcript = _transcript(client_nonce, server_nonce, own_id, server_id)
        if not hmac.compare_digest(proof, _mac(secret, b"server", transcript)):
            self.close()
            raise PeerRefused(f"data-plane peer {address} does not know the cluster secret")
        peer_id = server_id.decode(errors="replace")
        if expect is not None and peer_id != expect:
            self.close()
            raise PeerRefused(
                f"data-plane peer {address} is node {peer_id!r}, not {expect!r} as its record says"
            )
        self.sock.sendall(_mac(secret, b"client", transcript))
        self.channel = Channel.from_handshake(self.sock, secret, transcript, client=True,
                                              peer_id=peer_id)  # fmt: skip

    def close(self) -> None:
        """Close the connection."""
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.close()
            return
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
