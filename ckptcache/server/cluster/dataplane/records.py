"""Records: how bytes travel on an authenticated data-plane connection (framing and tags).

After the handshake (:mod:`ckptcache.server.cluster.dataplane.handshake`) each direction has its own
key, and every byte travels in records::

    length (4 B, big endian) | payload | Poly1305 tag (16 B) over length + payload

keyed by a one-time key ``HMAC(direction key, sequence number)``: a relay cannot inject,
reorder, replay or cut records unnoticed. Records are authenticated, not encrypted (TLS, see
:class:`~ckptcache.server.cluster.dataplane.handshake.TLSConfig`, for confidentiality). Bulk
payloads
leave by ``sendfile`` from the segment; their tags are computed alongside (sender) and checked
one record behind the receive position (receiver), so authentication overlaps the transfer.
Tags are computed in C with the interpreter lock released where the record extension is built
(:mod:`~ckptcache.server.cluster.dataplane._tagging`), and a receiver that digests what it
receives does so in the same pass as the tag check.
A JSON message (:func:`send_msg` / :func:`recv_msg`) is one record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import mmap
import socket
import ssl
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from ckptcache.errors import CkptCacheError
from ckptcache.server.cluster.dataplane import _tagging
from ckptcache.server.cluster.dataplane._sockets import recv_exact, recv_exact_into
from ckptcache.server.cluster.dataplane._tagging import Span, Xxh3

__all__ = [
    "MAX_MESSAGE",
    "RECORD_SIZE",
    "Channel",
    "ChannelTampered",
    "RecordHasher",
    "mac",
    "recv_msg",
    "send_msg",
]

_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_TAG = 16
#: Largest record that is not bulk bytes (a message): headers carry manifests, ~150 bytes per
#: tensor.
MAX_MESSAGE = 64 << 20
#: Bulk record size: large enough to amortise a tag, small enough to pipeline its check.
RECORD_SIZE = 4 << 20


class ChannelTampered(CkptCacheError, ConnectionError):
    """A record on an authenticated connection failed its tag (injected, altered, reordered
    or cut): the connection is dropped and nothing it carried is used."""


class RecordHasher(Protocol):
    """Digests taken in the same pass as each received record's tag check (see
    :meth:`Channel.recv_into`): what to hash of each record, and the digests it completed."""

    #: The running digest, fed across records in order.
    state: Xxh3

    def spans(self, start: int, end: int) -> list[Span]:
        """What to hash of bytes ``[start, end)`` of the view being filled, in order, as
        ``(lo, hi, ends)`` relative to ``start``."""
        ...

    def hashed(self, digests: list[int]) -> None:
        """The digests of the storages that the record just checked completed, in order."""
        ...


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``secret`` (handshake proofs and record keys)."""
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


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
        c2s, s2c = mac(secret, b"c2s", transcript), mac(secret, b"s2c", transcript)
        return cls(sock, *((c2s, s2c) if client else (s2c, c2s)), peer_id=peer_id)

    # ------------------------------------------------------------------ tags

    @staticmethod
    def _tag(key: bytes, seq: int, head: bytes, payload: Any) -> bytes:
        return _tagging.tag(mac(key, _SEQ.pack(seq)), head, payload)

    def _next_send(self) -> int:
        seq, self._send_seq = self._send_seq, self._send_seq + 1
        return seq

    def _next_recv(self) -> int:
        seq, self._recv_seq = self._recv_seq, self._recv_seq + 1
        return seq

    def _check(self, seq: int, head: bytes, payload: Any, tag: bytes) -> None:
        self._verify(seq, self._tag(self._recv_key, seq, head, payload), tag)

    def _verify(self, seq: int, computed: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(computed, tag):
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

    def recv_bytes(self, limit: int = MAX_MESSAGE) -> bytes:
        """Receive one record of at most ``limit`` bytes."""
        head = recv_exact(self.sock, _LEN.size)
        (n,) = _LEN.unpack(head)
        if n > limit:
            raise ChannelTampered(f"oversize record ({n} bytes) from {self.peer_id or '?'}")
        payload = recv_exact(self.sock, n)
        self._check(self._next_recv(), head, payload, recv_exact(self.sock, _TAG))
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

    def until_read(self, limit: float) -> None:
        """Return once the peer has read everything sent so far: it hangs up, or sends its
        next message (left unread here, for whoever reads it), or after ``limit`` seconds.
        ``sendfile`` over TCP is zero copy: the records it queued still reference the file's
        pages until the peer reads them (on loopback, until it copies them out of its own
        receive queue), so a sender keeps those pages unchanged (the generation pinned)
        until this returns. A peer that reads later than ``limit`` may meet changed bytes,
        which fail their tags: the transfer fails, never a wrong byte taken in. Over TLS the
        bytes were copied when sent."""
        if isinstance(self.sock, ssl.SSLSocket):
            return
        before = self.sock.gettimeout()
        try:
            self.sock.settimeout(limit)
            self.sock.recv(1, socket.MSG_PEEK)
        except OSError:
            pass  # a reset, or the limit: the peer reads no more in time
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(before)

    def recv_into(
        self,
        view: memoryview,
        progress: Callable[[int], None] | None = None,
        hasher: RecordHasher | None = None,
    ) -> None:
        """Fill ``view`` from records. Each record's tag is checked while the next one arrives;
        ``progress(n)`` reports each time the first ``n`` bytes are in place *and* verified:
        as soon as the check ends (from the checking thread), not when the next record is in,
        so a relay forwards a record one record's time sooner. With ``hasher``, what it asks
        of each record is hashed in the same pass as the tag check (the record read from
        memory once), and the digests reach it once the tag checked, before ``progress``."""
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
                head = recv_exact(self.sock, _LEN.size)
                (n,) = _LEN.unpack(head)
                if n == 0 or pos + n > len(view):
                    raise ChannelTampered(
                        f"record of {n} bytes overruns the {len(view) - pos} bytes expected "
                        f"from {self.peer_id or '?'}"
                    )
                recv_exact_into(self.sock, view[pos : pos + n])
                tag = recv_exact(self.sock, _TAG)
                check = self._helper().submit(self._check_region, self._next_recv(), head,
                                              view, pos, n, tag, hasher)  # fmt: skip
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
        self,
        seq: int,
        head: bytes,
        view: memoryview,
        start: int,
        n: int,
        tag: bytes,
        hasher: RecordHasher | None,
    ) -> None:
        with view[start : start + n] as part:  # released before the caller may unmap ``view``
            if hasher is None:
                self._check(seq, head, part, tag)
                return
            got, digests = _tagging.tag_and_hash(mac(self._recv_key, _SEQ.pack(seq)), head, part,
                                        hasher.spans(start, start + n), hasher.state)  # fmt: skip
            self._verify(seq, got, tag)
        hasher.hashed(digests)  # only once the record is known authentic

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
