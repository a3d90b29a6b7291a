"""The rpyc face of the daemon: one restricted ``request(kind, body)`` call per message.

rpyc is configured so a client can reach nothing but :meth:`CacheService.exposed_request`:
no public attributes, no pickle, no setattr. Peer credentials of the Unix socket are checked
before the first byte of rpyc is read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import zlib
from collections.abc import Callable
from typing import Any

import rpyc
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream
from rpyc.utils.authenticators import AuthenticationError
from rpyc.utils.server import ThreadedServer

from ckptcache import errors
from ckptcache.server.core import CacheCore, Handler, Session
from ckptcache.server.plans import plan_index
from ckptcache.wire import messages as m

__all__ = [
    "RPC_CONFIG",
    "CacheService",
    "CappedThreadedServer",
    "peer_credentials_authenticator",
]

log = logging.getLogger(__name__)

#: rpyc settings shared by both ends: nothing but the exposed request method is reachable.
RPC_CONFIG: dict[str, Any] = {
    "allow_public_attrs": False,
    "allow_all_attrs": False,
    "allow_pickle": False,
    "allow_getattr": True,  # needed to reach exposed_* names only
    "allow_setattr": False,
    "allow_delattr": False,
    "import_custom_exceptions": False,
    "instantiate_custom_exceptions": False,
    # rpyc's operators on netrefs (str/repr/cmp/hash of the service) stay off as well.
    "allow_safe_attrs": False,
    "sync_request_timeout": 120,
}

_PEERCRED = struct.Struct("3i")


class CappedChannel(Channel):  # type: ignore[misc]
    """An rpyc channel that refuses frames larger than :data:`MAX_FRAME_BYTES` before
    reading them, so a client cannot make the daemon buffer gigabytes."""

    def recv(self) -> bytes:
        header = self.stream.read(self.FRAME_HEADER.size)
        length, compressed = self.FRAME_HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise EOFError(f"rpyc frame of {length} bytes exceeds the cap of {MAX_FRAME_BYTES}")
        data = self.stream.read(length + len(self.FLUSHER))[: -len(self.FLUSHER)]
        if compressed:
            # A small compressed frame may not expand past the cap either (zip bombs).
            inflater = zlib.decompressobj()
            data = inflater.decompress(data, MAX_FRAME_BYTES + 1)
            if len(data) > MAX_FRAME_BYTES or inflater.unconsumed_tail:
                raise EOFError(f"rpyc frame inflates past the cap of {MAX_FRAME_BYTES} bytes")
        return bytes(data)


#: Frames (a request with rpyc's framing) above this end the connection; below it, a request
#: body above :data:`ckptcache.wire.messages.MAX_REQUEST_BYTES` gets a typed error.
MAX_FRAME_BYTES = 2 * m.MAX_REQUEST_BYTES + 65536


class CappedThreadedServer(ThreadedServer):  # type: ignore[misc]
    """rpyc's threaded server with :class:`CappedChannel` on every connection."""

    def _serve_client(self, sock: socket.socket, credentials: Any) -> None:
        try:
            addrinfo = sock.getpeername()
            config = dict(
                self.protocol_config, credentials=credentials,
                endpoints=(sock.getsockname(), addrinfo), logger=self.logger,
            )  # fmt: skip
            conn = self.service._connect(CappedChannel(SocketStream(sock)), config)
            self._handle_connection(conn)
        except (EOFError, OSError) as e:
            # close() closes every client socket under the threads serving them: a thread
            # then fails in select or recv on a descriptor that is gone (EBADF). That is the
            # shutdown, not a client's fault; rpyc's caller would log it as an ERROR.
            if not self.active:
                self.logger.debug("client connection closed by the shutdown: %s", e)
            elif isinstance(e, EOFError):
                self.logger.warning("dropped a client connection: %s", e)
            else:
                raise


def peer_credentials_authenticator(allowed_uids: tuple[int, ...]) -> Callable[..., Any]:
    """An rpyc authenticator admitting root, the daemon's own user and ``allowed_uids``."""
    admitted = {0, os.getuid(), *allowed_uids}

    def authenticate(sock: socket.socket) -> tuple[socket.socket, tuple[int, int, int]]:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        if uid not in admitted:
            log.warning("refused connection from pid %d uid %d: not an allowed user", pid, uid)
            raise AuthenticationError(f"uid {uid} is not allowed")
        return sock, (pid, uid, gid)

    return authenticate


class CacheService(rpyc.Service):  # type: ignore[misc]
    """One instance per client connection; dispatches each request to the part that owns it
    (:meth:`ckptcache.server.core.CacheCore.handlers`)."""

    def __init__(self, core: CacheCore):
        self._core = core
        self._session: Session | None = None
        index = plan_index(core)
        self._handlers: dict[str, Handler] = {
            **core.handlers(),
            "keep_plan": (m.KeepPlanRequest, index.keep),
            "find_plan": (m.FindPlanRequest, index.find),
            "list_plans": (m.ListPlansRequest, index.list),
        }

    def on_connect(self, conn: rpyc.Connection) -> None:
        pid, uid, gid = conn._config.get("credentials") or (0, os.getuid(), os.getgid())
        self._session = self._core.saves.open_session(pid, uid, gid)

    def on_disconnect(self, conn: rpyc.Connection) -> None:
        if self._session is not None:
            self._core.saves.close_session(self._session)
            self._session = None

    def _hello(self, body: str) -> str:
        req = m.decode(m.HelloRequest, body)
        if req.protocol != m.PROTOCOL_VERSION:
            return m.error_envelope(
                "ProtocolMismatch",
                f"client speaks protocol {req.protocol}, daemon {m.PROTOCOL_VERSION}: "
                "install the same ckptcache version on both sides",
            )
        cfg = self._core.config
        from ckptcache._version import __version__

        return m.ok_envelope(
            m.HelloReply(m.PROTOCOL_VERSION, cfg.node_id, cfg.segments_dir, __version__)
        )

    def _abort_raw(self, body: str) -> None:
        """A commit that cannot even be decoded still names its reservation: give it back."""
        try:
            reservation = json.loads(body).get("reservation")
        except (ValueError, AttributeError):
            return
        if isinstance(reservation, int) and self._session is not None:
            self._core.saves.abort(self._session, m.AbortRequest(reservation))

    # -- the rpyc surface: one method, nothing else reachable or listed ------------------

    def _rpyc_getattr(self, name: str) -> Any:
        """rpyc's attribute hook: only ``request`` resolves (not the ``get_service_name`` /
        ``get_service_aliases`` every rpyc service carries, nor any internal name)."""
        if name in ("request", "exposed_request"):
            return self.exposed_request
        raise AttributeError(f"cannot access {name!r}")

    def _rpyc_setattr(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot set {name!r}")

    def _rpyc_delattr(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name!r}")

    def __dir__(self) -> list[str]:
        """What rpyc's remote ``dir()`` answers: the one request method."""
        return ["exposed_request"]

    def exposed_request(self, kind: str, body: str) -> str:
        """Dispatch one message; errors come back as typed envelopes, never as exceptions."""
        try:
            if not isinstance(kind, str) or not isinstance(body, str):
                raise ValueError("request kind and body must be strings")
            if len(body) > m.MAX_REQUEST_BYTES or len(kind) > 64:
                return m.error_envelope(
                    "RequestTooLarge",
                    f"{kind[:64]!r} request of {len(body)} bytes exceeds the daemon's cap of "
                    f"{m.MAX_REQUEST_BYTES} bytes",
                )
            if kind == "hello":
                return self._hello(body)
            handler = self._handlers.get(kind)
            if handler is None:
                return m.error_envelope("ProtocolMismatch", f"unknown request kind {kind!r}")
            request_type, fn = handler
            assert self._session is not None
            try:
                request = m.decode(request_type, body)
            except errors.ProtocolMismatch:
                if kind in ("commit", "commit_pinned"):
                    self._abort_raw(body)  # a refused commit holds nothing
                raise
            result = fn(self._session, request)
            return m.ok_envelope(result if result is not None else {})
        except errors.CkptCacheError as e:
            # Where a corrupt copy was found travels with the error (CorruptCheckpoint).
            return m.error_envelope(type(e).__name__, str(e), tensor=getattr(e, "tensor", None),
                                    tier=getattr(e, "tier", None))  # fmt: skip
        except ValueError as e:
            if kind in ("commit", "commit_pinned"):
                self._abort_raw(body)
            return m.error_envelope("ProtocolMismatch", f"malformed {kind!r} request: {e}")
        except Exception as e:  # a bug: keep the daemon up, tell the client what happened
            log.exception("internal error handling %r", kind)
            return m.error_envelope("CkptCacheError", f"internal daemon error: {e!r}")
