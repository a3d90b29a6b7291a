"""Finding and trusting the daemon, and the one connection a client's requests share.

A request is one round trip: the message encoded, sent with the connection's lock held (the
daemon answers one connection's requests in order), the reply decoded or the daemon's typed
error raised here again. Requests that block in the daemon (``wait``, ``prefetch``) go on a
second connection (:meth:`Connection.waiting`) so they hold up no save or load.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import rpyc
from rpyc.core.stream import SocketStream

from ckptcache import errors
from ckptcache.client._peer import connect_daemon, trusted_daemon_uids
from ckptcache.client._settings import Settings, discover_socket
from ckptcache.errors import CorruptCheckpoint, DaemonUnavailable
from ckptcache.wire import messages as m

__all__ = ["Connection", "make_inert"]

R = TypeVar("R")


def make_inert(conn: Any) -> None:
    """Detach a connection inherited through ``fork`` without touching the parent's use of it.

    rpyc closes a connection when it is dropped (``__del__``): a close request sent on the
    socket the parent still uses, then ``shutdown``, which cuts it for both processes. Marked
    closed, it is only freed: the socket's descriptor is closed in this process alone. Its
    proxies (the daemon's root object) send a release of the remote object when they are
    collected, whatever the connection's state: that would free the parent's root in the
    daemon, so nothing is ever sent on it from here."""
    if conn is not None:
        conn._closed = True
        conn._send = lambda *args, **kwargs: None


def _text(value: Any) -> str | None:
    """A string field of a daemon's error reply (anything else: absent)."""
    return value if isinstance(value, str) else None


def _raise_error(err: dict[str, Any]) -> None:
    """Raise the daemon's error reply as the typed error it names (unknown: the root)."""
    cls = getattr(errors, str(err.get("type")), errors.CkptCacheError)
    if not (isinstance(cls, type) and issubclass(cls, errors.CkptCacheError)):
        cls = errors.CkptCacheError
    message = err.get("message", "unknown daemon error")
    if cls is CorruptCheckpoint:  # where the bad copy was, as the daemon saw it
        tensor, tier = _text(err.get("tensor")), _text(err.get("tier"))
        raise CorruptCheckpoint(message, tensor=tensor, tier=tier)
    raise cls(message)


class Connection:
    """One connection to the daemon that ``settings`` name, made at the first request and
    again after the daemon went away.

    ``lock`` (re-entrant) serialises the connection; a save holds it from its reservation to
    its commit. ``forked`` runs when a request finds itself in a forked child that no at-fork
    handler told (a C ``fork()``): the client's parts disown what is the parent's.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.lock = threading.RLock()
        #: The rpyc connection (``None`` until the first request, and after a drop).
        self.rpc: Any = None
        #: (connection, its remote ``request``), looked up once: see :meth:`request`.
        self._remote_request: tuple[Any, Any] | None = None
        #: The socket under :attr:`rpc`, kept to end it at once (see :meth:`drop`).
        self._socket: socket.socket | None = None
        #: Counts connections made: a pin's lease is only released on the one that took it.
        self.epoch = 0
        self.pid = os.getpid()
        self.segments_dir = ""
        self.node_id = ""
        #: The pins each mapping holds, by a weak reference to it (see :meth:`release_with`).
        self._pins: dict[weakref.ref[Any], tuple[int, int]] = {}
        #: The references whose mapping is gone: their pins go with the next request.
        self._unmapped: list[weakref.ref[Any]] = []
        self._waiter: Connection | None = None
        self._waiter_lock = threading.Lock()
        self.forked: Callable[[], None] = self.disown

    def connect(self) -> Any:
        """The connection, made (and greeted) if there is none."""
        if self.pid != os.getpid():  # forked where at-fork handlers did not run (C fork())
            self.forked()
        if self.rpc is not None and not self.rpc.closed:
            return self.rpc
        settings = self.settings
        if not settings.explicit_socket:
            settings.socket_path = discover_socket()
        sock = connect_daemon(
            settings.socket_path, trusted_daemon_uids(settings.daemon_uid),
            min(settings.timeout, 10.0),
        )  # fmt: skip
        self.rpc = rpyc.utils.factory.connect_stream(
            SocketStream(sock), config={"sync_request_timeout": settings.timeout}
        )
        self._socket = sock
        self.epoch += 1
        hello = self.request(
            "hello",
            m.HelloRequest(m.PROTOCOL_VERSION, os.getpid(), settings.namespace),
            m.HelloReply,
        )
        self.segments_dir, self.node_id = hello.shm_dir, hello.node_id
        return self.rpc

    def request(self, kind: str, message: Any, reply_type: type[R] | None = None) -> Any:
        """One round trip on the connection as it is (the caller holds :attr:`lock`)."""
        body = m.encode(message)
        if len(body) > m.MAX_REQUEST_BYTES:
            raise errors.RequestTooLarge(
                f"{kind!r} request of {len(body)} bytes exceeds the daemon's cap of "
                f"{m.MAX_REQUEST_BYTES} bytes"
            )
        try:
            # The daemon's ``request`` looked up once per connection: every lookup through
            # ``rpc.root`` is a round trip of its own (it doubled a save's round trips).
            remote = self._remote_request
            if remote is None or remote[0] is not self.rpc:
                remote = self._remote_request = (self.rpc, self.rpc.root.request)
            text = remote[1](kind, body)
            envelope = json.loads(text)
        except (EOFError, OSError, TimeoutError) as e:
            self.drop()
            raise DaemonUnavailable(
                f"the ckptcache daemon at {self.settings.socket_path} went away during "
                f"{kind!r} ({type(e).__name__}: {e}); restart it, committed checkpoints are kept"
            ) from e
        except BaseException as e:
            # A signal's exception (Ctrl-C) may land mid-frame: the stream is out of step
            # and the request's effect (a reservation) unknown. The connection ends here, and
            # with it what it held in the daemon; the next request makes a new one.
            if not isinstance(e, Exception):
                self.drop()
            raise
        if not envelope.get("ok"):
            _raise_error(envelope.get("error", {}))
        result = envelope.get("result")
        if reply_type is None:
            return result
        return m.decode(reply_type, json.dumps(result), reply=True)

    def call(self, kind: str, message: Any, reply_type: type[R] | None = None) -> Any:
        """A request, connecting first and releasing the pins dropped since the last one."""
        with self.lock:
            self.connect()
            self._flush_releases()
            return self.request(kind, message, reply_type)

    def waiting(self) -> Connection:
        """A second connection, for requests that block in the daemon (``wait``, up to 30 s
        each; ``prefetch``, a remote load). The daemon answers one connection's requests in
        order and :attr:`lock` serialises this one: on it, such a request would hold up every
        save, load and status call of the threads sharing the client."""
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = Connection(self.settings)
            return self._waiter

    def release_with(self, mapping: object, lease: int, epoch: int) -> None:
        """Release ``lease`` (taken on connection ``epoch``) once ``mapping`` is garbage, with
        the next request. The callback is ``list.append``, run by the collector in C: a
        Python finalizer could be cut short by a signal's exception landing in it (Ctrl-C at
        the moment the last tensor of a load goes), and the pin would stay for the life of
        the connection."""
        self._pins[weakref.ref(mapping, self._unmapped.append)] = (epoch, lease)

    def seg_path(self, name: str) -> str:
        """The file of the daemon's segment ``name``."""
        return os.path.join(self.segments_dir, name)

    def drop(self) -> None:
        """End the connection at once (the next request makes a new one); the daemon aborts
        its reservations and drops its pins. Safe to call from a handler of ``BaseException``:
        it never waits on the daemon."""
        sock, self._socket = self._socket, None
        conn, self.rpc = self.rpc, None
        self._remote_request = None
        # The socket shut down first: the daemon sees the stream end at once. rpyc's own
        # close sends a close request and waits for its reply: on a stream left out of step
        # (a request cut short by a signal), or a daemon that stopped answering, that wait
        # lasts the whole request timeout. Nothing is sent on it afterwards (``make_inert``).
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        make_inert(conn)
        if sock is not None:
            sock.close()

    def _flush_releases(self) -> None:
        # Nothing is forgotten before the request is answered: a signal's exception landing
        # before it leaves every pin to the next request, one inside it ends the connection
        # (and the pins with it), one after it sends some again (the daemon ignores a lease
        # it no longer has).
        unmapped = self._unmapped
        gone = unmapped[:]
        pins = [self._pins.get(ref) for ref in gone]
        leases = tuple(pin[1] for pin in pins if pin is not None and pin[0] == self.epoch)
        if leases:
            self.request("release", m.ReleaseRequest(leases))
        for ref in gone:
            self._pins.pop(ref, None)
        del unmapped[: len(gone)]

    def close_waiter(self) -> None:
        """Close the second connection, if one was made."""
        with self._waiter_lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.close()

    def close(self) -> None:
        """Release the pins dropped, then close (a parent's connection is only disowned)."""
        with self.lock:
            if self.rpc is not None and self.pid == os.getpid():
                try:
                    self._flush_releases()
                except errors.CkptCacheError:
                    pass
            if self.pid != os.getpid():
                make_inert(self.rpc)  # the parent's: closing it would cut the parent's too
            self.drop()

    def after_fork(self) -> None:
        """In a forked child: new locks (a thread of the parent may have held one at the
        fork) and no second connection (the parent's, disowned); :meth:`disown` follows."""
        self.lock = threading.RLock()
        self._waiter_lock = threading.Lock()
        if self._waiter is not None:
            self._waiter.disown()
        self._waiter = None

    def disown(self) -> None:
        """Forked: the parent's socket is not ours to use or close, nor its pins to release."""
        make_inert(self.rpc)
        self.rpc = None
        self._pins, self._unmapped = {}, []
        self._socket = None  # closed in this process alone once collected, never shut down
        self.pid = os.getpid()
