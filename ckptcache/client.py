"""The client of the local daemon: drop-in ``save``/``load`` through shared memory.

A save flattens the object, reserves a segment, copies every storage straight into it (the
only stall) and commits. A load pins the newest generation and maps it copy-on-write, so the
returned CPU tensors are zero-copy views that the trainer may still modify freely.

When the daemon cannot be reached (or has no room), ``save`` writes through to the path with
``torch.save`` and warns once, and ``load`` reads the file at the path: a checkpoint error never
stops training unless ``fallback="raise"`` asks for it.
"""

from __future__ import annotations

import atexit
import builtins
import io
import json
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import rpyc
from rpyc.core.stream import SocketStream

from ckptcache import errors
from ckptcache._defaults import (
    candidate_sockets,
    default_fallback,
    default_namespace,
    fallback_log_every,
)
from ckptcache._peer import connect_daemon, trusted_daemon_uids
from ckptcache._secure_fs import current_umask
from ckptcache._spares import SpareMapper
from ckptcache._workers import LingeringPool
from ckptcache.errors import (
    BudgetExceeded,
    CheckpointDeleted,
    CheckpointNotFound,
    CkptCacheWarning,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    DaemonUnavailable,
    InvalidPath,
    PathNotAllowed,
    PersistConflict,
    PersistError,
    PersistTimeout,
)
from ckptcache.format.layout import HEADER_SIZE, SegmentHeader
from ckptcache.format.manifest import Manifest, unpack_digests, verify_meta
from ckptcache.format.persisted import load_from_storage, stored_archive_complete
from ckptcache.storage import backend_for
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState, Tier, WaitState

# torch and the modules built on it are imported where a save or load needs them, so that the
# control-plane commands (ckptcache ls, status, ...) start without torch.
if TYPE_CHECKING:
    from ckptcache._async import SaveHandle, VersionCheck
    from ckptcache._gpu import Ready
    from ckptcache.format.flatten import Flattened, MapLocation
    from ckptcache.format.manifest import ObjectPlan
    from ckptcache.format.plancache import PlanCache
    from ckptcache.format.shm import Mapping
    from ckptcache.packing import Packed

__all__ = ["DURABILITY_LEVELS", "Client", "normalize_path"]

#: What ``save`` may wait for before it returns.
#: ``memory``: kept in the daemon's memory only, never persisted (an explicit choice; a
#: path under no storage root is otherwise refused). The others: where the save is when it
#: returns (this node's memory, also a backup node's, also storage); all are persisted.
DURABILITY_LEVELS = ("memory", "local", "backup", "persisted")

R = TypeVar("R")

log = logging.getLogger(__name__)

#: Clients with a save thread in this process: their pending non-blocking saves are finished
#: at interpreter exit (the thread is a daemon thread, which exit would otherwise stop).
_SAVERS: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _finish_pending_saves() -> None:
    for client in list(_SAVERS):
        if client._executor_pid == os.getpid():
            client._finish_saves()


def normalize_path(path: Any) -> str:
    """The name of a checkpoint: an absolute local path, or a URL (``s3://...``) unchanged."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise InvalidPath(
            f"checkpoint path must be a str or os.PathLike, not {type(path).__name__}; "
            "ckptcache names objects by the path torch.save would write"
        )
    if not path or "\x00" in path:
        raise InvalidPath(f"invalid checkpoint path {path!r}")
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        return path
    if ".." in path.split(os.sep):
        # Refused rather than resolved: which directory ``..`` names depends on symlinks the
        # lexical resolution would not see, and a checkpoint's name must be one place.
        raise PathNotAllowed(
            f"checkpoint path {path!r} contains '..': give the path without it (for example "
            "os.path.realpath(path))"
        )
    return os.path.abspath(path)


def _is_url(path: str) -> bool:
    return "://" in path


def _text(value: Any) -> str | None:
    """A string field of a daemon's error reply (anything else: absent)."""
    return value if isinstance(value, str) else None


#: Every live client, for the fork handler.
_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _make_inert(conn: Any) -> None:
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


class Client:
    """A connection to the local daemon, with its own namespace, timeouts and fallback policy.

    ``socket_path`` defaults to ``$CKPTCACHE_SOCKET``, else this user's daemon, else the node's
    root daemon (docs/daemon.md, Configuration); the daemon must run as root, this user or
    ``daemon_uid`` (``$CKPTCACHE_DAEMON_UID``), which is checked before a byte is sent.
    ``namespace`` to ``$CKPTCACHE_NAMESPACE`` or ``default``. ``fallback`` is
    ``"write-through"`` (save to the path with torch.save when the daemon is gone or full) or
    ``"raise"``; unset, ``$CKPTCACHE_REQUIRE=1`` means ``"raise"``. Every write-through is
    counted in ``fallbacks`` and reported once: a warning for the first of each cause, a log
    line for every ``$CKPTCACHE_FALLBACK_LOG_EVERY``-th.
    A client may be shared by threads; after ``fork`` the child reconnects (with its own
    locks and threads: the parent's save in flight does not hang it).
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        namespace: str | None = None,
        timeout: float = 60.0,
        fallback: str | None = None,
        daemon_uid: int | None = None,
    ):
        fallback = fallback or default_fallback()
        if fallback not in ("write-through", "raise"):
            raise ValueError(f"fallback must be 'write-through' or 'raise', not {fallback!r}")
        self._explicit_socket = bool(socket_path)
        self.socket_path = socket_path or self._discover_socket()
        self.daemon_uid = daemon_uid
        self.namespace = namespace or default_namespace()
        self.timeout = timeout
        self.fallback = fallback
        self._lock = threading.RLock()
        self._conn: Any = None
        #: (connection, its remote ``request``): see :meth:`_request`.
        self._remote_request: tuple[Any, Any] | None = None
        self._epoch = 0
        self._pid = os.getpid()
        self._segments_dir = ""
        self.node_id = ""
        self._write_maps: dict[str, Mapping] = {}
        self._pending_release: list[tuple[int, int]] = []
        self._warned: set[str] = set()
        #: Saves this client wrote straight to storage because the daemon was gone or full.
        self.fallbacks = 0
        #: Paths this client saved through the daemon (what ``wait()`` waits for).
        self._saved: set[str] = set()
        #: Paths whose newest save by this client was written straight to storage: persisted,
        #: whatever the daemon says (or whether it answers at all).
        self._written_through: set[str] = set()
        self._spares = SpareMapper(self)
        self._executor: LingeringPool | None = None
        self._executor_pid = 0
        self._executor_lock = threading.Lock()
        #: The connection of requests that block in the daemon (see :meth:`_waiting_client`).
        self._waiter: Client | None = None
        self._waiter_lock = threading.Lock()
        #: Save plans by structure (made at the first save: it needs torch).
        self._plans: PlanCache | None = None
        #: Whether the spares were asked for already (:meth:`warmup`, or a first contact).
        self._warmed = False
        _clients.add(self)

    def _fresh(self) -> Client:
        """A new client with this one's settings (its own connection and threads)."""
        return Client(
            self.socket_path if self._explicit_socket else None,
            namespace=self.namespace,
            timeout=self.timeout,
            fallback=self.fallback,
            daemon_uid=self.daemon_uid,
        )

    def _after_fork(self) -> None:
        """In a forked child (an at-fork handler): new locks, since a thread of the parent
        (a save in flight, the spare mapper) may have held one at the fork and does not
        exist here to release it, and none of the parent's threads or connection."""
        self._lock = threading.RLock()
        self._executor_lock = threading.Lock()
        self._executor, self._executor_pid = None, 0
        self._waiter, self._waiter_lock = None, threading.Lock()  # it forks on its own
        self._plans = None  # its lock may have been held at the fork
        self._disown_parent_state()

    def _disown_parent_state(self) -> None:
        """Forked: the parent's socket and mappings are not ours to use or close, nor are
        its saves ours to wait for."""
        _make_inert(self._conn)
        self._conn, self._write_maps, self._pending_release = None, {}, []
        self._saved = set()
        self._written_through = set()
        self._pid, self._spares = os.getpid(), SpareMapper(self)
        self._warmed = False

    # ----------------------------------------------------------------- connection

    def _connect(self) -> Any:
        if self._pid != os.getpid():  # forked where at-fork handlers did not run (C fork())
            self._disown_parent_state()
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if not self._explicit_socket:
            self.socket_path = self._discover_socket()
        sock = connect_daemon(
            self.socket_path, trusted_daemon_uids(self.daemon_uid), min(self.timeout, 10.0)
        )
        conn = rpyc.utils.factory.connect_stream(
            SocketStream(sock), config={"sync_request_timeout": self.timeout}
        )
        self._conn = conn
        self._epoch += 1
        self._pending_release = []
        hello = self._request(
            "hello", m.HelloRequest(m.PROTOCOL_VERSION, os.getpid(), self.namespace), m.HelloReply
        )
        self._segments_dir = hello.shm_dir
        self.node_id = hello.node_id
        return conn

    @staticmethod
    def _discover_socket() -> str:
        """The first default socket that exists (the daemon may start later: then the first)."""
        candidates = candidate_sockets()
        return next((p for p in candidates if os.path.exists(p)), candidates[0])

    def _request(self, kind: str, message: Any, reply_type: type[R] | None = None) -> Any:
        body = m.encode(message)
        if len(body) > m.MAX_REQUEST_BYTES:
            raise errors.RequestTooLarge(
                f"{kind!r} request of {len(body)} bytes exceeds the daemon's cap of "
                f"{m.MAX_REQUEST_BYTES} bytes"
            )
        try:
            # The daemon's ``request`` looked up once per connection: every lookup through
            # ``conn.root`` is a round trip of its own (it doubled a save's round trips).
            remote = self._remote_request
            if remote is None or remote[0] is not self._conn:
                remote = self._remote_request = (self._conn, self._conn.root.request)
            text = remote[1](kind, body)
        except (EOFError, OSError, TimeoutError) as e:
            self._drop_connection()
            raise DaemonUnavailable(
                f"the ckptcache daemon at {self.socket_path} went away during {kind!r} "
                f"({type(e).__name__}: {e}); restart it, committed checkpoints are kept"
            ) from e
        envelope = json.loads(text)
        if not envelope.get("ok"):
            err = envelope.get("error", {})
            cls = getattr(errors, str(err.get("type")), errors.CkptCacheError)
            if not (isinstance(cls, type) and issubclass(cls, errors.CkptCacheError)):
                cls = errors.CkptCacheError
            message = err.get("message", "unknown daemon error")
            if cls is CorruptCheckpoint:  # where the bad copy was, as the daemon saw it
                raise CorruptCheckpoint(
                    message, tensor=_text(err.get("tensor")), tier=_text(err.get("tier"))
                )
            raise cls(message)
        result = envelope.get("result")
        return m.decode(reply_type, json.dumps(result)) if reply_type is not None else result

    def _call(self, kind: str, message: Any, reply_type: type[R] | None = None) -> Any:
        with self._lock:
            self._connect()
            self._flush_releases()
            return self._request(kind, message, reply_type)

    def _waiting_client(self) -> Client:
        """A second connection, for requests that block in the daemon (``wait``, up to 30 s
        each; ``prefetch``, a remote load). The daemon answers one connection's requests in
        order and this client's lock serialises its connection: on it, such a request would
        hold up every save, load and status call of the threads sharing this client."""
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = self._fresh()
                self._waiter.fallback = "raise"  # it never saves; errors go to the caller
            return self._waiter

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def _flush_releases(self) -> None:
        pending, self._pending_release = self._pending_release, []
        leases = tuple(lease for epoch, lease in pending if epoch == self._epoch)
        if leases:
            self._request("release", m.ReleaseRequest(leases))

    def _release_later(self, epoch: int, lease: int) -> Callable[[], None]:
        # Runs from a GC finalizer: it must not touch the connection, only queue the lease.
        return lambda: self._pending_release.append((epoch, lease))

    def close(self) -> None:
        """Finish pending non-blocking saves, release pins, close the connection and the
        cached write mappings."""
        if self._executor is not None and self._executor_pid == os.getpid():
            self._finish_saves()
            self._executor.stop()
            self._executor = None
        with self._waiter_lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.close()
        with self._lock:
            self._spares.stop()
            if self._conn is not None and self._pid == os.getpid():
                try:
                    self._flush_releases()
                except errors.CkptCacheError:
                    pass
            if self._pid != os.getpid():
                _make_inert(self._conn)  # the parent's: closing it would cut the parent's too
            self._drop_connection()
            for mapping in list(self._write_maps.values()):
                from ckptcache._gpu import unpin  # torch is loaded: this client saved

                try:
                    unpin(mapping)
                    mapping.close()
                except BufferError:
                    pass
            self._write_maps = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- save

    def _write_mapping(self, segment: str, capacity: int) -> Mapping:
        """The cached shared mapping of a segment (made once, reused by every later save)."""
        from ckptcache._gpu import unpin
        from ckptcache.format.shm import map_shared

        # The spare thread adds to the cache under this (re-entrant) lock; saves hold it too.
        with self._lock:
            for name in [n for n in self._write_maps if not os.path.exists(self._seg_path(n))]:
                stale = self._write_maps.pop(name)  # the daemon dropped it: free our pages too
                unpin(stale)
                stale.close()
            self._spares.wait_for(segment)
            mapping = self._write_maps.get(segment)
            # A spare trimmed by the daemon after we mapped it is shorter than our mapping.
            if mapping is None or len(mapping) < capacity:
                mapping = map_shared(self._seg_path(segment), capacity)
                self._write_maps[segment] = mapping
            return mapping

    def _server_wait(self) -> float:
        """How long the daemon may wait inside one request: well inside our own timeout, so
        the reply (an error at worst) arrives before the connection is given up."""
        return max(0.0, min(self.timeout * 0.8, self.timeout - 1.0))

    def _seg_path(self, name: str) -> str:
        return os.path.join(self._segments_dir, name)

    def warmup(self, *, wait: bool = False) -> None:
        """Connect and map the daemon's spare segments in the background, so that even the
        first save of this process runs at memcpy speed (call it when the trainer starts);
        ``wait=True`` blocks until they are mapped."""
        self._call("status", m.StatusRequest(), m.DaemonStatus)
        self._warmed = True
        done = self._spares.refresh()
        if wait:
            done.wait()

    def _warm_on_first_contact(self) -> None:
        """What :meth:`warmup` does, started by the first save, load or ``exists`` of a
        client that never called it: a trainer that checks for a checkpoint to resume from,
        or loads one, then finds its first save's segment mapped. (Control-plane calls do not
        start it: a short-lived ``ckptcache ls`` has no use for mapped segments.)"""
        if self._warmed:
            return
        self._warmed = True
        # On the spare thread, which connects by itself: never on the caller's, which a
        # non-blocking save must not hold up behind a save in flight (it holds the lock).
        self._spares.refresh()

    def save(
        self, obj: Any, path: Any, *, durability: str = "local", blocking: bool = True
    ) -> SaveHandle | None:
        """Save ``obj`` under ``path``; returns once the bytes are in the daemon's memory.

        ``blocking=False`` returns a :class:`~ckptcache.SaveHandle` at once and copies in a
        background thread (one at a time, in order); see :func:`ckptcache.save`.
        """
        from ckptcache._async import VersionCheck
        from ckptcache._async import submit as submit_save
        from ckptcache._gpu import record_ready

        t0 = time.perf_counter()
        path = normalize_path(path)
        if durability not in DURABILITY_LEVELS:
            raise ValueError(
                f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}"
            )
        self._warm_on_first_contact()
        flat, plan = self._plan_cache().prepare(obj, path, self.namespace)
        if blocking:
            self._save_planned(obj, flat, plan, path, durability, t0)
            return None
        check = VersionCheck(obj, path, flat)
        flat = check.flat  # private copies of the storages no version counter watches
        # The copy runs on the save thread, whose current CUDA stream is not the trainer's.
        ready = record_ready(flat.storages)
        return submit_save(
            lambda copied: self._save_planned(
                obj, flat, plan, path, durability, t0, check=check, copied=copied, ready=ready
            ),
            path,
            self._background(),
            owner=self,
        )

    def _plan_cache(self) -> PlanCache:
        """This client's save plans by structure (see :mod:`ckptcache.format.plancache`)."""
        from ckptcache.format.plancache import PlanCache

        if self._plans is None:
            self._plans = PlanCache()
        return self._plans

    def save_packed(self, packed: Packed, path: Any, *, durability: str = "local") -> int:
        """Save the ``uint8`` blob that ``packed`` lays out (see :mod:`ckptcache.packing`) under
        ``path``, its items copied straight into the segment: no blob is made, so the stall is
        one copy of the items' bytes. Returns where the blob's bytes start in the archive
        persisted at ``path``. Without a daemon the blob is made and written through, as
        :meth:`save` would write it."""
        import torch

        from ckptcache.format.flatten import flatten
        from ckptcache.format.objectio import plan_object

        t0 = time.perf_counter()
        path = normalize_path(path)
        if durability not in DURABILITY_LEVELS:
            raise ValueError(
                f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}"
            )
        self._warm_on_first_contact()
        # Never written nor read: its storage gives the archive the blob's layout.
        placeholder = torch.empty(packed.nbytes, dtype=torch.uint8)
        flat = flatten(placeholder)
        plan = plan_object(flat, path, self.namespace)
        self._save_planned(placeholder, flat, plan, path, durability, t0, packed=packed)
        return plan.manifest.storages[0].offset - plan.manifest.payload_offset

    def _background(self) -> LingeringPool:
        """The one thread that runs this client's non-blocking saves, in submission order.

        It ends a moment after its last save (a thread idling until ``close()`` would outlive
        its work, and frameworks' thread-leak checks fail on it) and is a daemon thread, so
        it never keeps the process from exiting: saves still pending at exit are finished
        first by :func:`_finish_pending_saves`, an ``atexit`` hook."""
        with self._executor_lock:  # not self._lock: a save in flight may hold that one
            if self._executor is None or self._executor_pid != os.getpid():
                self._executor = LingeringPool(1, "ckptcache-save")
                self._executor_pid = os.getpid()
                _SAVERS.add(self)
            return self._executor

    def _save_planned(
        self,
        obj: Any,
        flat: Flattened,
        plan: ObjectPlan,
        path: str,
        durability: str,
        t0: float,
        *,
        check: VersionCheck | None = None,
        copied: Callable[[], None] | None = None,
        packed: Packed | None = None,
        ready: Ready | None = None,
    ) -> None:
        from ckptcache.format.objectio import write_object

        with self._lock:
            try:
                reply = self._call(
                    "reserve",
                    m.ReserveRequest(
                        self.namespace,
                        path,
                        plan.layout.nbytes,
                        durability,
                        uid=os.geteuid(),
                        gid=os.getegid(),
                        umask=current_umask(),
                        timeout=self._server_wait(),
                    ),
                    m.ReserveReply,
                )
            except (DaemonUnavailable, BudgetExceeded) as e:
                # The trainer is still held (``copied`` not called): torch.save reads the live
                # object (over the copies ``check`` took), and ``check`` decides before the file
                # replaces the previous one.
                if packed is not None:
                    obj = packed.materialize()
                elif check is not None:
                    obj = check.source(obj)
                self._write_through(obj, path, e, check=check)
                return
            released = False
            try:
                mapping = self._write_mapping(reply.segment, reply.capacity)
                if packed is None:
                    write_object(mapping, plan, flat, ready)
                else:
                    _write_packed(mapping, plan, packed)
                if check is not None:
                    check.check()  # torn bytes are never committed: abort below instead
                if copied is not None:
                    copied()
                    released = True
                commit = m.CommitRequest(
                    reply.reservation,
                    plan.layout.manifest_offset,
                    len(plan.manifest_bytes),
                    time.perf_counter() - t0,
                )
                self._call("commit", commit, m.CommitReply)
                self._saved.add(path)
                self._written_through.discard(path)
                self._spares.refresh()  # map the spare the daemon makes for the next new path
            except DaemonUnavailable as e:
                if released:  # the trainer may have stepped: write what the segment holds
                    obj = _read_back(mapping, plan)
                elif packed is not None:
                    obj = packed.materialize()
                self._write_through(obj, path, e)
                return
            except BaseException:
                if self._conn is not None:
                    try:
                        self._request("abort", m.AbortRequest(reply.reservation))
                    except errors.CkptCacheError:
                        pass
                raise

        if durability == "persisted":
            # Not self.wait: on the save thread that would wait for this very save.
            self._wait_persisted(path, None, None)

    def _write_through(
        self,
        obj: Any,
        path: str,
        reason: errors.CkptCacheError,
        *,
        check: VersionCheck | None = None,
    ) -> None:
        """Write ``obj`` to ``path`` with ``torch.save``, whole or not at all: a failed write
        (a crash, a full disk, ``check`` raising :class:`~ckptcache.errors.TensorMutated`)
        leaves the previous file and the cached generations as they were."""
        import torch

        from ckptcache._atomic import atomic_write

        if self.fallback == "raise":
            raise reason
        self.fallbacks += 1
        # One message per event, never a warning and a log line for the same write: the
        # first of each cause is a CkptCacheWarning (aimed at the script's author: it names
        # their line, and -W error::ckptcache.CkptCacheWarning turns it into a failure); the
        # repeats, which a warning filter would hide, are counted in a log line.
        if type(reason).__name__ not in self._warned:  # once per client and cause
            self._warned.add(type(reason).__name__)
            warnings.warn(
                f"ckptcache: writing {path!r} straight to storage with torch.save ({reason}); "
                "set CKPTCACHE_REQUIRE=1 to fail instead",
                CkptCacheWarning,
                stacklevel=4,
            )
        else:
            self._log_fallback(path, reason)

        def write(f: Any) -> None:
            torch.save(obj, f)
            if check is not None:
                check.check()  # before the rename: a torn object never replaces a good one

        if _is_url(path):
            buf = io.BytesIO()
            write(buf)
            backend_for(path).write_bytes(path, buf.getbuffer())
        else:
            atomic_write(path, write)
        # Only now that the new file is in place may the older generations go.
        self._supersede(path)

    def _supersede(self, path: str) -> None:
        """The file just written is the newest save: the daemon must forget older generations
        (a load from memory, or a later persist, would otherwise bring them back)."""
        try:
            self._call("supersede", m.SupersedeRequest(self.namespace, path), m.DeleteReply)
        except DaemonUnavailable:
            pass  # a restarted daemon compares with storage itself (docs/guarantees.md)
        self._saved.discard(path)
        self._written_through.add(path)

    def _log_fallback(self, path: str, reason: errors.CkptCacheError) -> None:
        """Keep repeated fallbacks visible: a log line on every N-th one."""
        if self.fallbacks % fallback_log_every() == 0:
            log.warning(
                "ckptcache: %d save(s) written through to storage without the cache, last %r "
                "(%s); set CKPTCACHE_REQUIRE=1 to fail instead",
                self.fallbacks, path, reason,
            )  # fmt: skip

    # ----------------------------------------------------------------- load

    def load(
        self,
        path: Any,
        map_location: MapLocation = None,
        *,
        weights_only: bool = True,
        mmap: bool | None = None,
        verify: bool | None = None,
    ) -> Any:
        """Load the newest generation of ``path`` (see :func:`ckptcache.load`).

        ``verify``: None (the default) checks every byte that crosses a tier (a stored file
        read here; the daemon checks what it brings in from peers and storage as it lands)
        and trusts this node's memory; True checks this node's memory too; False checks no
        digest here (a stored file's structure still is)."""
        path = normalize_path(path)
        local = verify is True
        self._warm_on_first_contact()
        try:
            reply = self._call(
                "open",
                m.OpenRequest(
                    self.namespace, path, need_digests=local, timeout=self._server_wait()
                ),
                m.OpenReply,
            )
        except (CheckpointNotFound, DaemonUnavailable, CoordinatorUnavailable) as e:
            return self._load_file(path, map_location, weights_only, mmap, e, verify)
        log.debug("load of %s served from the %s tier", path, reply.tier)
        try:
            return self._load_segment(reply, map_location, weights_only, mmap, local)
        except CorruptCheckpoint as e:
            usable = self._file_not_older_than(path, reply.generation)
            try:
                self._call(
                    "report_corrupt",
                    m.ReportCorruptRequest(self.namespace, path, reply.generation, str(e)),
                )
            except errors.CkptCacheError:
                pass
            if not os.path.exists(path):
                raise
            if not usable:
                # An earlier save's file: returning it would silently go back in training.
                raise CorruptCheckpoint(
                    f"{e}; the file at {path!r} is older than this generation (an earlier "
                    "save), so it is not loaded in its place",
                    tensor=e.tensor, tier=e.tier,
                ) from e  # fmt: skip
            return self._load_file(path, map_location, weights_only, mmap, e, verify)

    def _file_not_older_than(self, path: str, generation: int) -> bool:
        """Whether the file at ``path`` holds generation ``generation`` or a later save, as
        far as the daemon's record shows: persisted (the daemon never replaces a newer file),
        or stamped no earlier than the commit (the daemon stamps what it persists with the
        generation's commit time, as mtime; any later write is newer still). Asked before the
        generation is reported corrupt (then dropped); unknown means no."""
        try:
            info = self._call("stat", m.StatRequest(self.namespace, path), m.ObjectInfo)
        except errors.CkptCacheError:
            return False
        if info.generation < generation:
            return False  # ours is gone already: its commit time is unknown
        if info.generation == generation and "persisted" in info.stages:
            return True
        # A newer generation committed since is a stricter bound, never a looser one.
        try:
            stamp = backend_for(path).commit_time_ns(path)
        except (OSError, ValueError, ImportError):
            return False
        # Commit times travel as float seconds (exact to about 0.2 us at today's dates).
        return stamp is not None and stamp >= round(info.committed * 1e9) - 1_000

    def _load_segment(
        self,
        reply: m.OpenReply,
        map_location: MapLocation,
        weights_only: bool,
        mmap: bool | None,
        verify: bool,
    ) -> Any:
        from ckptcache.format.objectio import read_object
        from ckptcache.format.shm import map_private

        mapping = map_private(
            self._seg_path(reply.segment), reply.size,
            self._release_later(self._epoch, reply.lease), hold_lock=True,
        )  # fmt: skip
        digests = None
        if verify:
            if not reply.digests_valid:
                raise CorruptCheckpoint("the daemon returned no digests to verify against")
            table = memoryview(mapping)[
                reply.digest_offset : reply.digest_offset + 8 * reply.n_storages
            ]
            digests = unpack_digests(table, reply.n_storages)
            table.release()
            self._verify_meta(mapping, reply)
        return read_object(
            mapping, reply.manifest_offset, reply.manifest_size, zero_copy=mmap is not False,
            weights_only=weights_only, map_location=map_location, digests=digests,
        )  # fmt: skip

    @staticmethod
    def _verify_meta(mapping: Mapping, reply: m.OpenReply) -> None:
        """Check the skeleton and manifest against the digests in the segment's header."""
        view = memoryview(mapping)
        try:
            header = SegmentHeader.unpack(view[:HEADER_SIZE])
            mo, ms = reply.manifest_offset, reply.manifest_size
            manifest = Manifest.from_json(view[mo : mo + ms], segment_size=len(view))
            verify_meta(view, manifest, mo, ms, (header.skeleton_digest, header.manifest_digest),
                        tier=Tier.LOCAL)  # fmt: skip
        except ValueError as e:
            if isinstance(e, CorruptCheckpoint):
                raise
            raise CorruptCheckpoint(f"unreadable segment header: {e}", tier=Tier.LOCAL) from e
        finally:
            view.release()

    def _load_file(
        self,
        path: str,
        map_location: MapLocation,
        weights_only: bool,
        mmap: bool | None,
        reason: errors.CkptCacheError,
        verify: bool | None = None,
    ) -> Any:
        """Read the stored file at ``path`` here, checked unless ``verify is False`` (see
        :meth:`load`); ``reason`` is why the daemon did not serve it."""
        if isinstance(reason, DaemonUnavailable) and self.fallback == "raise":
            raise reason
        if not self._in_storage(path):
            if isinstance(reason, CoordinatorUnavailable):
                raise reason  # other nodes may hold it: "not found" would be a wrong answer
            where = "the cache" if isinstance(reason, CheckpointNotFound) else "a reachable cache"
            raise CheckpointNotFound(
                f"{path!r} is neither in {where} nor in storage; check the path "
                "(and the namespace, if the job sets one)"
            ) from reason
        return load_from_storage(
            path, map_location, weights_only=weights_only, mmap=mmap, verify=verify is not False
        )

    @staticmethod
    def _in_storage(path: str) -> bool:
        try:
            return backend_for(path).exists(path)
        except (OSError, ValueError, ImportError):
            return False

    @staticmethod
    def _complete_in_storage(path: str) -> bool:
        """Whether storage holds a complete checkpoint at ``path`` (not empty, not cut short)."""
        try:
            return stored_archive_complete(backend_for(path), path)
        except (OSError, ValueError, ImportError):
            return False

    # ----------------------------------------------------------------- queries

    def status(self, path: Any) -> m.ObjectInfo:
        """What the cache (or storage) holds for ``path``."""
        path = normalize_path(path)
        try:
            return self._call("stat", m.StatRequest(self.namespace, path), m.ObjectInfo)
        except (CheckpointNotFound, DaemonUnavailable):
            if not self._complete_in_storage(path):
                raise
            size, mtime = (
                (os.path.getsize(path), os.path.getmtime(path)) if not _is_url(path) else (0, 0.0)
            )
            return m.ObjectInfo(
                self.namespace, path, 0, size, ("storage",), mtime, "", 0, False,
                persist_state=PersistState.PERSISTED,
            )  # fmt: skip

    def exists(self, path: Any) -> bool:
        """Whether ``path`` can be loaded from the cache or from storage."""
        self._warm_on_first_contact()
        try:
            self.status(path)
        except (CheckpointNotFound, DaemonUnavailable):
            return False
        return True

    def delete(self, path: Any) -> int:
        """Drop every cached generation of ``path`` (storage is untouched); returns the count."""
        path = normalize_path(path)
        return int(
            self._call("delete", m.DeleteRequest(self.namespace, path), m.DeleteReply).dropped
        )

    def list(self, prefix: str = "", *, all_namespaces: bool = False) -> list[m.ObjectInfo]:
        """Newest generation of every cached path starting with ``prefix``."""
        ns = None if all_namespaces else self.namespace
        reply = self._call("list", m.ListRequest(ns, prefix), m.ListReply)
        return list(reply.objects)

    def verify(self, path: Any) -> m.VerifyReply:
        """Have the daemon recompute and compare the digests of ``path``'s newest generation."""
        path = normalize_path(path)
        return self._call("verify", m.VerifyRequest(self.namespace, path), m.VerifyReply)

    def wait(self, path: Any = None, *, prefix: Any = None, timeout: float | None = None) -> None:
        """Block until ``path`` is persisted (or every object under ``prefix``, or with
        neither, everything this client saved); see :func:`ckptcache.wait`.

        This client's non-blocking saves of those paths still running are waited for first
        (their errors, e.g. :class:`~ckptcache.errors.TensorMutated`, are raised here)."""
        if path is not None and prefix is not None:
            raise ValueError("give path or prefix, not both")
        deadline = None if timeout is None else time.monotonic() + timeout
        path = None if path is None else normalize_path(path)
        prefix = None if prefix is None else normalize_path(prefix)
        self._wait_saves(path, prefix, deadline)
        self._wait_persisted(path, prefix, deadline)

    def _finish_saves(self) -> None:
        """Wait until every non-blocking save of this client has run (their errors stay with
        their handles: a failed save nobody waited on is logged when its handle goes)."""
        from ckptcache._async import pending_saves

        for handle in pending_saves(self):
            handle.wait_done()

    def _wait_saves(self, path: str | None, prefix: str | None, deadline: float | None) -> None:
        """Wait for this client's pending non-blocking saves of ``path`` (under ``prefix``,
        or all): a save still copying is not in the daemon yet, so it has nothing to wait on."""
        from concurrent.futures import TimeoutError as FutureTimeout

        from ckptcache._async import pending_saves

        def match(p: str) -> bool:
            return p == path if path is not None else prefix is None or p.startswith(prefix)

        for handle in pending_saves(self, match):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(left)
            except FutureTimeout:
                raise PersistTimeout(
                    f"the non-blocking save of {handle.path!r} did not finish within the timeout"
                ) from None

    def _wait_persisted(self, path: str | None, prefix: str | None, deadline: float | None) -> None:
        """The daemon side of :meth:`wait`."""
        if prefix is not None:
            self._wait_one(prefix, True, deadline)
            return
        paths = [path] if path is not None else sorted(self._saved)
        for p in paths:
            self._wait_one(p, False, deadline, strict=path is not None)

    def _wait_one(
        self, path: str, prefix: bool, deadline: float | None, strict: bool = True
    ) -> None:
        while True:
            # Wait in slices so no single request outlives the connection's timeout.
            left = 30.0 if deadline is None else deadline - time.monotonic()
            req = m.WaitRequest(
                self.namespace, path, prefix, max(0.0, min(left, 30.0, self._server_wait()))
            )
            if not prefix and path in self._written_through:
                return  # its file is complete on storage (fsynced, renamed): persisted
            try:
                reply = self._waiting_client()._call("wait", req, m.WaitReply)
            except CheckpointNotFound:
                if self._in_storage(path) or not strict:
                    return  # written through, or evicted after it was persisted
                raise
            if reply.state == WaitState.PERSISTED:
                return
            if reply.state == WaitState.FAILED:
                raise PersistError(f"persisting {path!r} failed: {reply.error}")
            if reply.state == WaitState.CONFLICT:
                raise PersistConflict(f"{path!r} was not persisted: {reply.error}")
            if reply.state == WaitState.SUPERSEDED:
                return  # storage holds a write made after this save: nothing left to wait for
            if reply.state == WaitState.DROPPED:
                if not strict:
                    return  # the user removed its directory: nothing left to wait for
                raise CheckpointDeleted(f"{path!r} will not be persisted: {reply.error}")
            if reply.state == WaitState.MEMORY_ONLY:
                if not strict:
                    return
                raise PathNotAllowed(
                    f"{path!r} is cached in memory only: it is under no --persist-root of the "
                    "daemon, so it will never be persisted"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise PersistTimeout(f"{path!r} was not persisted within the timeout")

    def prefetch(
        self, paths: Any, progress: Callable[[int, int, str, str], None] | None = None
    ) -> builtins.list[str]:
        """Warm this node's cache with ``paths`` (from peers or storage; a daemon without a
        cluster reads storage itself), every copy checked by the daemon as it lands; returns
        the tier each came from. ``progress(done, total, path, tier)`` is called after each
        path. Raises :class:`CorruptCheckpoint` for a damaged copy (tier and tensor named)
        and :class:`CoordinatorUnavailable` when etcd is unreachable."""
        items = [
            normalize_path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)
        ]
        tiers = []
        for i, path in enumerate(items):
            req = m.PrefetchRequest(self.namespace, path, self._server_wait())
            reply = self._waiting_client()._call("prefetch", req, m.PrefetchReply)
            tiers.append(reply.tier)
            if progress is not None:
                progress(i + 1, len(items), path, reply.tier)
        return tiers

    def daemon_status(self) -> m.DaemonStatus:
        """Daemon-wide counters."""
        return self._call("status", m.StatusRequest(), m.DaemonStatus)

    def map_local(self, path: Any) -> tuple[Mapping, m.OpenReply]:
        """Pin the newest generation of ``path`` and map its segment (read-only for the
        caller; copy-on-write). The pin lasts until the mapping is garbage. Raises
        :class:`CheckpointNotFound` when the daemon has no copy (for read-through views,
        :func:`ckptcache.open`; a loader wants :meth:`load`)."""
        from ckptcache.format.shm import map_private

        path = normalize_path(path)
        req = m.OpenRequest(self.namespace, path, timeout=self._server_wait())
        reply = self._call("open", req, m.OpenReply)
        mapping = map_private(
            self._seg_path(reply.segment), reply.size,
            self._release_later(self._epoch, reply.lease), hold_lock=True,
        )  # fmt: skip
        return mapping, reply


def _read_back(mapping: Mapping, plan: ObjectPlan) -> Any:
    """The object a save copied into ``mapping`` (per ``plan``), as private copies.

    A non-blocking save releases the trainer once its copy is done, before the commit, so
    that the commit's round trip (and any replication) overlaps training: if the commit then
    fails, the live tensors may hold the next step already, and only the segment still holds
    what was saved. Reading it back costs a second copy, on this rare path alone."""
    from ckptcache.format.objectio import read_object

    return read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes),
        zero_copy=False, weights_only=False,
    )  # fmt: skip


def _write_packed(mapping: Mapping, plan: ObjectPlan, packed: Packed) -> None:
    """``write_object`` for an object whose one storage is ``packed``'s blob: the archive's
    metadata and the manifest as usual, then the items straight into the storage's place."""
    import torch

    from ckptcache.format.objectio import write_metadata

    write_metadata(mapping, plan)
    (record,) = plan.manifest.storages
    if record.nbytes:
        packed.fill(torch.frombuffer(mapping, dtype=torch.uint8, count=record.nbytes,
                                     offset=record.offset))  # fmt: skip
