"""The daemon process: lock the shm directory, build the parts, recover, serve, shut down.

:func:`build_core` is the one place where the daemon's parts meet: each gets the narrow
interface it needs (the state owner, a few callables, a Protocol), none holds a reference back
to whoever built it.

Shutdown on SIGTERM/SIGINT stops accepting connections, stops workers and leaves every
committed segment in place for the next start (a restart loses nothing).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import select
import signal
import socket
import stat
import sys
import threading
import time
from typing import IO

from rpyc.utils.helpers import classpartial

from ckptcache._secure_fs import ensure_private_dir, open_private_file
from ckptcache._units import format_bytes
from ckptcache.errors import ConfigError
from ckptcache.hugepages import HUGE, huge_policy
from ckptcache.server import logsafe
from ckptcache.server.backoff import ACCEPT
from ckptcache.server.config import DaemonConfig
from ckptcache.server.core import CacheCore
from ckptcache.server.ingest import Ingest
from ckptcache.server.memory.eviction import EvictionPolicy
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.sharer import Sharer
from ckptcache.server.memory.shares import Shares
from ckptcache.server.metrics import Metrics
from ckptcache.server.persist.digester import Digester
from ckptcache.server.persist.persister import Persister
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.reindex import recover
from ckptcache.server.restore.loads import Loads
from ckptcache.server.restore.queries import Queries
from ckptcache.server.restore.storage_read import StorageReader
from ckptcache.server.saves import Saves
from ckptcache.server.service import (
    RPC_CONFIG,
    CacheService,
    CappedThreadedServer,
    peer_credentials_authenticator,
)

__all__ = ["Daemon", "build_core", "run_daemon"]

log = logging.getLogger("ckptcache.daemon")


def _shm_mode(config: DaemonConfig) -> int:
    """0700, or 0711 when other users are admitted (they reach their own segment directory
    by name; they can neither list nor change ours)."""
    others = set(config.allowed_uids) - {0, os.geteuid()}
    return 0o711 if others else 0o700


def _check_allowed_uids(config: DaemonConfig) -> None:
    others = set(config.allowed_uids) - {0, os.geteuid()}
    if others and os.geteuid() != 0:
        raise ConfigError(
            f"allowed_uids {sorted(others)} need a daemon running as root: only root can give "
            "each admitted user segment files that user alone can read"
        )


def _lock_shm_dir(config: DaemonConfig) -> IO[bytes]:
    """One daemon per shm directory: a second one would corrupt the first one's segments.

    The directory and its lock file are checked (ours, no group/other write, no symlinks)
    before anything in them is trusted.
    """
    shm_dir = config.shm_dir
    dir_fd = ensure_private_dir(shm_dir, _shm_mode(config), "shm dir")
    try:
        fd = open_private_file(dir_fd, "daemon.lock", os.O_RDWR | os.O_CREAT, "lock file")
    finally:
        os.close(dir_fd)
    lock = os.fdopen(fd, "r+b")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(
                f"another daemon already uses {shm_dir}; stop it or pick another --shm-dir"
            ) from e
        raise
    return lock


def _prepare_socket_dir(path: str) -> None:
    """Create or check the socket's directory: ours, not writable by others (0755 so that
    admitted users' clients can reach the socket)."""
    os.close(ensure_private_dir(os.path.dirname(os.path.abspath(path)), 0o755, "socket dir"))


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (systemd's default soft limit of
    1024 is easily reached by peers, clients and segments); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft


class ControlServer(CappedThreadedServer):
    """rpyc's threaded server, minus its habit of terminating on the first failed ``accept``
    (``EMFILE`` under a descriptor flood would drop the control socket for good): errors are
    logged at most every few seconds, the loop backs off and goes on until :meth:`close`."""

    _failures = 0
    _last_log = float("-inf")

    def accept(self) -> None:
        """Accept one client; a failed accept is logged and retried, never fatal."""
        try:
            super().accept()
            self._failures = 0
        except EOFError as e:
            if not self.active:
                raise  # closed by stop(): end the serve loop
            backoff = ACCEPT.delay(self._failures)
            self._failures += 1
            now = time.monotonic()
            if now - self._last_log > 5.0:
                self._last_log = now
                log.error("control socket accept failed (%s); backing off %.2fs",
                          e.__context__, backoff)  # fmt: skip
            time.sleep(backoff)


class _ConnectionLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The rpc server's logger with its per-connection INFO lines ("accepted", "authenticated
    successfully", two for every client) at DEBUG: a daemon serving many short clients (each
    ``ckptcache`` command, each trainer) would otherwise log little else. Warnings and errors
    keep their level; a refused client is logged at WARNING by the authenticator itself."""

    def info(self, msg: object, *args: object, **kwargs: object) -> None:
        self.debug(msg, *args, **kwargs)  # type: ignore[arg-type]


def _clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"refusing socket {path}: something that is not a socket is there")
    if st.st_uid != os.geteuid():  # its 0666 mode only grants connecting, not replacing
        raise ConfigError(f"refusing socket {path}: it is owned by uid {st.st_uid}, not us")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # left behind by a daemon that was killed
        return
    finally:
        probe.close()
    raise ConfigError(f"a daemon is already listening on {path}; stop it or pick another --socket")


def build_core(config: DaemonConfig, metrics: Metrics | None = None) -> CacheCore:
    """Build and start the daemon's parts in dependency order.

    state -> retention, digester -> persister -> pool -> saves -> ingest -> recovery ->
    (cluster: joins, announces what recovery found) -> persister workers (with the cluster's
    election) -> digester, orphan sweep -> loads (with the cluster as remote tier), queries.
    """
    from ckptcache.server.state import CacheState

    state = CacheState(config, metrics or Metrics())
    roots = PersistRoots.for_daemon(config.persist_roots, os.geteuid())
    log.info("persisting under: %s", roots.describe())
    if config.memory_only == "allow":
        log.warning(
            "memory-only saves allowed (--memory-only allow): a save under no storage root "
            "is kept in memory only and never persisted"
        )
    # One policy decides what may leave memory: retention and saves act on it.
    eviction = EvictionPolicy(Shares(state.arena, config.user_share, config.allowed_uids))
    retention = Retention(config, state, eviction)
    digester = Digester(state)
    state.on_free.append(digester.check_free)
    persister = Persister(
        config, state, roots, digester.ensure, retention, record_digests=digester.record
    )
    pool = SegmentPool(
        state.arena, state.lock, config.pool_segments, config.pool_size,
        quiet=state.saves_in_flight.wait_quiet,
    )  # fmt: skip
    clustered = bool(config.listen) or not config.coordinator.startswith("embedded")
    saves = Saves(
        config, state, pool=pool, persister=persister, retention=retention, digester=digester,
        roots=roots, eviction=eviction, backup_ready=clustered and config.backup != "none",
    )  # fmt: skip
    ingest = Ingest(state, saves)
    recover(state, roots, retention, digester, persister)
    with state.lock.held():
        pool.seed(state.index)  # what earlier saves here were: spares before a save asks
    pool.start()
    pool.refill()
    cluster = None
    if clustered:
        from ckptcache.server.cluster.cluster import Cluster, ClusterPorts

        cluster = Cluster(config, state, ClusterPorts(
            receive=ingest.receive, ensure_digests=digester.ensure,
            drop_corrupt=retention.drop_corrupt, mark_persisted=persister.mark_persisted,
            resubmit=persister.submit, roots=roots, options=persister.options,
        ))  # fmt: skip
        saves.on_commit.append(cluster.on_commit)
        saves.newest_seen = cluster.truth.seen
        retention.newest = cluster.newest_if_known
        state.on_retire.append(cluster.on_retire)
        cluster.start()  # before persisting: elections apply
    persister.start(cluster.election if cluster is not None else None)
    digester.start()
    retention.start()
    sharer = Sharer(state, enabled=config.share_pages)
    digester.on_record.append(sharer.nudge)
    state.persist_states.on_settled.append(sharer.nudge)
    sharer.start()
    state.metrics.memory_limit.set(config.memory_limit)
    state.update_gauges()
    # Without a cluster, a prefetch this node misses is read from storage by the daemon itself.
    alone = None if cluster is not None else StorageReader(
        config, state.metrics, roots=roots, options=persister.options, receive=ingest.receive
    )  # fmt: skip
    loads = Loads(
        config, state, digester=digester, retention=retention, remote=cluster, storage=alone
    )
    queries = Queries(
        config, state, persister=persister, roots=roots, pool=pool,
        node_ids=cluster.node_ids if cluster is not None else tuple,
        clock_offsets=cluster.clocks.offsets if cluster is not None else tuple,
        digest_queue=lambda: digester.backlog,
    )  # fmt: skip
    return CacheCore(
        config, state, retention, digester, persister, pool, saves, ingest, loads, queries,
        sharer, cluster,
    )  # fmt: skip


class Daemon:
    """A running daemon: core + rpyc server + metrics + process title."""

    def __init__(self, config: DaemonConfig):
        self.config = config
        _check_allowed_uids(config)
        self.open_files = raise_open_file_limit()
        self._lock = _lock_shm_dir(config)
        self.metrics = Metrics()
        self.core = build_core(config, self.metrics)
        self.metrics_port: int | None = None
        if config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(config.metrics_port, config.metrics_addr)
        _prepare_socket_dir(config.socket)
        _clear_stale_socket(config.socket)
        self.server = ControlServer(
            classpartial(CacheService, self.core),
            socket_path=config.socket,
            authenticator=peer_credentials_authenticator(config.allowed_uids),
            protocol_config=RPC_CONFIG,
            logger=_ConnectionLog(logging.getLogger("ckptcache.rpc"), {}),
        )
        # Access is decided by peer credentials, not file modes, so other allowed users can
        # connect; the credentials check refuses everyone else.
        os.chmod(config.socket, 0o666)
        self._stop = threading.Event()
        #: Set by a signal handler (see :meth:`signalled`).
        self._signalled = False
        #: A byte written here wakes :meth:`serve_forever` at once: by :meth:`stop`, and by
        #: the interpreter's C-level signal handler (:func:`run_daemon` makes it the signal
        #: wake-up fd), whichever thread the kernel delivers the signal to.
        self._wake_r, self.wake_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _title(self) -> None:
        try:
            from setproctitle import setproctitle
        except ImportError:  # pragma: no cover - dependency missing
            return
        while not self._stop.is_set():
            state = self.core.state
            with state.lock.held():
                used = state.arena.used
                objects = len(state.index.paths())
            setproctitle(
                f"ckptcache-daemon node={self.config.node_id} objects={objects} "
                f"mem={format_bytes(used)}/{format_bytes(self.config.memory_limit)}"
            )
            self._stop.wait(2.0)

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT when run by :func:`run_daemon`)."""
        threading.Thread(target=self._title, name="title", daemon=True).start()
        server_thread = threading.Thread(target=self.server.start, name="rpc", daemon=True)
        server_thread.start()
        log.info(
            "ckptcache daemon ready: node=%s socket=%s shm=%s budget=%s open-files=%d%s",
            self.config.node_id, self.config.socket, self.config.shm_dir,
            format_bytes(self.config.memory_limit), self.open_files,
            f" metrics=:{self.metrics_port}" if self.metrics_port is not None else "",
        )  # fmt: skip
        if huge_policy(self.config.shm_dir) not in (*HUGE, "unknown"):
            log.info(
                "segments in %s use 4 KiB pages; a tmpfs mounted with huge=within_size makes "
                "first saves and storage reads several times faster (docs/tuning.md, Huge pages)",
                self.config.shm_dir,
            )
        # Python runs signal handlers only in the main thread, between bytecodes, and a
        # handler may not take the event's lock (it may interrupt this thread while it holds
        # it), so it only raises a flag; the byte on the wake-up pipe makes this wait return
        # for it at once. The half-second timeout is a safety net, not the mechanism.
        while not self._stop.is_set() and not self._signalled:
            readable, _, _ = select.select([self._wake_r], [], [], 0.5)
            if readable:  # drained, so a byte for another signal cannot make this spin
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
        self._stop.set()  # for the other loops that watch it
        log.info("shutting down")
        try:
            self.server.close()
            self.core.shutdown()  # bounded: never waits long on the coordinator
        finally:
            # Whatever a part did on its way out, the socket and the lock go: the next start
            # (or an operator) must not find a socket nobody answers on.
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass
            self._lock.close()
        log.info("stopped")

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return."""
        self._stop.set()
        self._wake()

    def signalled(self) -> None:
        """:meth:`stop` for a signal handler: takes no lock, acted on at once."""
        self._signalled = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_fd, b"\0")
        except BlockingIOError:  # the pipe is full: serve_forever is woken already
            pass


def run_daemon(config: DaemonConfig) -> int:
    """Run a daemon in this process until SIGTERM/SIGINT; returns the exit code."""
    # Paths and peers' strings reach the log: the formatter escapes line breaks and other
    # control characters in every record, so no record can forge another line.
    logsafe.install(config.log_level, sys.stderr)
    try:
        daemon = Daemon(config)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.signalled())
    signal.set_wakeup_fd(daemon.wake_fd, warn_on_full_buffer=False)
    daemon.serve_forever()
    return 0
