"""The daemon's service logic, independent of the transport.

Call order (per client connection, see :mod:`ckptcache.wire.messages`)::

    session = core.open_session(pid, uid)
    core.reserve(session, ReserveRequest)  -> segment to copy into
    core.commit(session, CommitRequest)    -> generation published (or core.abort)
    core.open(session, OpenRequest)        -> generation pinned for a load
    core.release(session, ReleaseRequest)  -> pin dropped
    core.close_session(session)            -> everything the connection held is let go

Pipeline of one generation: ``reserved -> committed -> digested -> (persisted) -> retired ->
free``. All state lives under one condition variable; bulk work (digests, persistence) runs
outside it on pinned generations, so a generation can never be freed while a worker reads it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptcache._units import format_bytes
from ckptcache._version import __version__
from ckptcache.errors import (
    BudgetExceeded,
    CheckpointNotFound,
    CkptCacheError,
    CorruptCheckpoint,
    InvalidPath,
    ObjectTooLarge,
    PathNotAllowed,
    ReplicationError,
)
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState, align
from ckptcache.format.manifest import (
    Manifest,
    compute_digests,
    meta_digests,
    pack_digests,
    unpack_digests,
    verify_digests,
    verify_meta,
)
from ckptcache.server import ownership
from ckptcache.server.arena import Arena, Segment
from ckptcache.server.config import DaemonConfig
from ckptcache.server.index import Generation, Index, Key
from ckptcache.server.lineage import anchor_of, is_orphaned, removed_reason
from ckptcache.server.metrics import Metrics
from ckptcache.server.ownership import Saver
from ckptcache.server.persist import Persister, lower_thread_priority
from ckptcache.server.pool import SegmentPool
from ckptcache.server.roots import PersistRoots
from ckptcache.storage import backend_for
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState, Tier, WaitState

__all__ = ["CacheCore", "Session"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    """A segment handed to one connection for one save."""

    id: int
    namespace: str
    path: str
    segment: Segment
    nbytes: int
    durability: str
    persist: bool = False
    saver: Saver | None = None
    #: Digests already known (a copy received and verified): recorded at commit.
    digests: list[int] | None = None
    #: Deepest ancestor directory that existed at save time (see ckptcache.server.lineage).
    anchor: str = ""


@dataclass(eq=False)
class Inflight:
    """An object still arriving (from a peer or storage): peers may relay it as it lands."""

    segment: Segment
    nbytes: int
    manifest_offset: int
    manifest_size: int
    #: Bytes ``[0, ready)`` of the segment are final (the header page counts as ready).
    ready: int = HEADER_SIZE
    failed: bool = False
    #: The bytes are those stored at the path (read from storage, or from a copy that was):
    #: whoever receives them by relay has a persisted copy too.
    persisted: bool = False


@dataclass(eq=False)
class Session:
    """What one client connection holds; all of it is let go when the connection closes."""

    id: int
    pid: int
    uid: int
    reservations: dict[int, Reservation] = field(default_factory=dict)
    leases: dict[int, Generation] = field(default_factory=dict)
    gid: int = -1


def _bounded(wait: float, client_timeout: float | None) -> float:
    """A daemon-side wait, never longer than the client waits for the reply: a client that
    gives up drops its connection (and with it everything the connection held)."""
    return wait if client_timeout is None else max(0.0, min(wait, client_timeout))


def _check_key(namespace: str, path: str) -> None:
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise InvalidPath(f"invalid checkpoint path {path!r}: give a non-empty path string")
    if not isinstance(namespace, str) or not namespace or len(namespace) > 256:
        raise InvalidPath(f"invalid namespace {namespace!r}: give a non-empty string")


class CacheCore:
    """Arena + index + the rules that tie them together (budget, retention, pins, digests)."""

    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        others = set(config.allowed_uids) - {0, os.geteuid()}
        self.arena = Arena(config.segments_dir, config.memory_limit, 0o711 if others else 0o700)
        self.index = Index()
        self.cond = threading.Condition()
        self.started = time.time()
        self._ids = itertools.count(1)
        self._digest_queue: queue.Queue[Generation | None] = queue.Queue()
        #: Called (outside the lock) with each newly committed generation and the durability
        #: the client asked for; the cluster hooks replication in (and may raise).
        self.on_commit: list[Callable[[Generation, str], None]] = []
        #: Called (under the lock) with each generation leaving the index.
        self.on_retire: list[Callable[[Generation], None]] = []
        self.internal = Session(0, os.getpid(), os.getuid())
        #: Objects arriving right now, by (namespace, path): relayed to peers as they land.
        self.inflight: dict[Key, Inflight] = {}
        #: When each path was last deleted here (wall clock): backup copies of generations
        #: saved before that are refused, so a delete is not undone by a copy in transit.
        self.deleted: dict[Key, float] = {}
        self.cluster: Any = None
        self.roots = PersistRoots(config.persist_roots)
        self.persister = Persister(self)
        self._recover()
        self.pool = SegmentPool(self.arena, self.cond, config.pool_segments, config.pool_size)
        self.pool.start()
        if config.listen or not config.coordinator.startswith("embedded"):
            from ckptcache.server.cluster import Cluster

            Cluster(self).start()  # sets self.cluster; before persisting: elections apply
        self.persister.start()
        self._digester = threading.Thread(target=self._digest_loop, name="digester", daemon=True)
        self._digester.start()
        self._stopping = threading.Event()
        if config.orphan_sweep > 0:
            threading.Thread(target=self._sweep_loop, name="orphan-sweep", daemon=True).start()
        self.metrics.memory_limit.set(config.memory_limit)
        self._update_gauges()

    # ----------------------------------------------------------------- lifecycle

    def _recover(self) -> None:
        """Rebuild the index from committed segments; reclaim everything else."""
        for segment, header in self.arena.scan():
            if header is None or header.state != SegmentState.COMMITTED:
                log.info("reclaiming uncommitted segment %s", segment.name)
                self.arena.destroy(segment)
                continue
            view = segment.view()
            try:
                manifest = Manifest.from_json(
                    view[header.manifest_offset : header.manifest_offset + header.manifest_size],
                    segment_size=segment.capacity,
                )
            except CorruptCheckpoint as e:
                log.error("dropping segment %s: %s", segment.name, e)
                del view
                self.arena.destroy(segment)
                continue
            gen = Generation(
                manifest.namespace, manifest.path, header.generation, segment, manifest,
                size=header.payload_size, committed=header.committed_ns / 1e9,
                saver=ownership.read_record(segment, self.arena.uid),
                committed_ns=header.committed_ns, anchor=anchor_of(manifest.path),
            )  # fmt: skip
            # Persisted or not, a path under a root is a persisted kind of object (wait()
            # answers "persisted", never "memory-only", for it after a restart).
            gen.needs_persist = self._persistable(gen.path)
            if header.persisted:
                gen.persisted, gen.persist_state = True, PersistState.PERSISTED
            if header.digest_state == DigestState.VALID:
                table = view[header.digest_offset : header.digest_offset + 8 * header.n_storages]
                gen.digests = unpack_digests(table, header.n_storages)
            del view
            self.index.add(gen)
            log.info(
                "recovered %s generation %d (%s)", gen.path, gen.number, format_bytes(gen.size)
            )
        remote = [k for k in self.index.paths() if "://" in k[1]]
        for key in self.index.paths():
            if key not in remote:  # a stat each: before anything is served
                self._retire_older_than_storage(key)
        if remote:  # object stores may be slow or down: compare in the background
            threading.Thread(
                target=self._compare_remote, args=(remote,), name="stale-check", daemon=True
            ).start()
        for key in self.index.paths():
            self._supersede_older(key)
            self.apply_retention(key)
        for gen in self.index:
            if gen.digests is None:
                self._digest_queue.put(gen)
            if gen.needs_persist and not gen.persisted:
                log.info("re-queueing unpersisted %s generation %d", gen.path, gen.number)
                with self.cond:
                    self.persister.submit(gen)

    def _compare_remote(self, keys: list[Key]) -> None:
        for key in keys:
            self._retire_older_than_storage(key)

    def _retire_older_than_storage(self, key: Key) -> None:
        """After a restart, drop recovered generations older than the object on storage.

        A save written through while this daemon was down (or a newer persist by another
        node) is the last completed save: an older generation must neither be served nor
        persisted over it. Commit times are wall-clock ns of the saving node.
        """
        path = key[1]
        try:
            if self.roots.root_for(path) is None and "://" in path:
                return  # a URL under no root: storage is none of our business
            stored = backend_for(path, self.persister.options).commit_time_ns(path)
        except (OSError, ValueError, ImportError, PathNotAllowed) as e:
            log.warning("cannot compare %s with storage: %s", path, e)
            return
        if stored is not None:
            with self.cond:
                self.retire_older_than(key, stored)

    def retire_older_than(self, key: Key, stored_ns: int) -> None:
        """Retire the generations of ``key`` committed before the object on storage (call
        under the lock): neither served nor persisted, storage holds a newer save."""
        for gen in self.index.generations(key):
            if gen.committed_ns < stored_ns:
                log.warning(
                    "dropping %s generation %d: storage holds a newer object (written "
                    "through or persisted after it)", gen.path, gen.number,
                )  # fmt: skip
                if not gen.persisted:
                    gen.needs_persist, gen.persist_state = False, PersistState.SUPERSEDED
                self._retire(gen)

    def _persistable(self, path: str) -> bool:
        try:
            return self.roots.root_for(path) is not None
        except PathNotAllowed as e:
            log.error("keeping %s in memory only: %s", path, e)
            return False

    def _classify(self, path: str) -> bool:
        """Whether a save of ``path`` will be persisted; refuses paths escaping a root."""
        root = self.roots.root_for(path)
        if root is None and self.roots and self.config.memory_only == "refuse":
            raise PathNotAllowed(
                f"{path!r} is outside every storage root ({', '.join(self.roots)}) and this "
                "daemon refuses memory-only objects; save under a root or add --persist-root"
            )
        return root is not None

    def shutdown(self) -> None:
        """Stop background workers (segments stay on disk for the next incarnation)."""
        self._stopping.set()
        self.pool.stop()
        self.persister.stop()
        if self.cluster is not None:
            self.cluster.stop()
        self._digest_queue.put(None)
        self._digester.join(timeout=5)

    def open_session(self, pid: int, uid: int, gid: int = -1) -> Session:
        """Register a new client connection."""
        return Session(next(self._ids), pid, uid, gid=gid)

    def close_session(self, session: Session) -> None:
        """Abort the connection's reservations and drop its pins (a dead trainer holds nothing)."""
        with self.cond:
            for res in session.reservations.values():
                log.info("aborting reservation %d of %s (client gone)", res.id, res.path)
                self.arena.release(res.segment)
            session.reservations.clear()
            for gen in session.leases.values():
                self._unpin(gen)
            session.leases.clear()
            self.cond.notify_all()
            self._update_gauges()

    # ----------------------------------------------------------------- save

    def reserve(self, session: Session, req: m.ReserveRequest) -> m.ReserveReply:
        """Find room for ``req.nbytes``: reuse, create, evict, then wait up to the timeout."""
        _check_key(req.namespace, req.path)
        if not isinstance(req.nbytes, int) or req.nbytes <= 0:
            raise InvalidPath(f"reserve needs a positive byte count, got {req.nbytes!r}")
        persist = self._classify(req.path)
        saver = ownership.saver_for(session, req)
        anchor = anchor_of(req.path)  # which directories exist now (never resurrected later)
        if req.durability == "backup" and (self.cluster is None or self.config.backup == "none"):
            raise ReplicationError(
                "durability='backup' needs backup nodes: start the daemons with --backup auto "
                "(or a list of node ids), --listen and a shared --coordinator"
            )
        limit = self.config.memory_limit
        if Arena.capacity_for(req.nbytes) > limit:
            raise ObjectTooLarge(
                f"{req.path!r} needs {format_bytes(req.nbytes)}, more than the daemon's whole "
                f"memory budget of {format_bytes(limit)}; raise --memory-limit or save this "
                "object without the cache"
            )
        deadline = time.monotonic() + _bounded(self.config.reserve_timeout, req.timeout)
        with self.cond:
            ownership.check_may_save(self, session, (req.namespace, req.path))
            while True:
                segment = self._try_allocate(req.nbytes, saver)
                if segment is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.budget_failures.inc()
                    raise BudgetExceeded(
                        f"no room for {format_bytes(req.nbytes)} of {req.path!r} within "
                        f"{self.config.reserve_timeout:g}s: {format_bytes(self.arena.used)} of "
                        f"{format_bytes(limit)} hold checkpoints that are pinned or not yet "
                        "safe to drop. Raise --memory-limit, keep fewer generations, or wait "
                        "for persistence"
                    )
                self.cond.wait(min(remaining, 0.5))
            res = Reservation(
                next(self._ids), req.namespace, req.path, segment, req.nbytes, req.durability,
                persist, saver, anchor=anchor,
            )  # fmt: skip
            session.reservations[res.id] = res
            self._update_gauges()
        return m.ReserveReply(res.id, segment.name, segment.capacity)

    def _try_allocate(self, nbytes: int, saver: Saver | None = None) -> Segment | None:
        arena = self.arena
        capacity = Arena.capacity_for(nbytes)
        owner = saver.uid if saver is not None else None
        segment = arena.take_free(nbytes, tight=arena.used + capacity > arena.limit, owner=owner)
        if segment is None:
            segment = self.pool.take(nbytes, arena.uid if owner is None else owner)
        if segment is not None:
            return segment
        arena.shrink_free(capacity)
        while arena.used + capacity > arena.limit:
            victims = self.index.eviction_candidates()
            if not victims and self.mark_orphans():
                victims = self.index.eviction_candidates()
            if not victims:
                return None
            log.info("evicting %s generation %d", victims[0].path, victims[0].number)
            self.metrics.evictions.inc()
            self._retire(victims[0])
            segment = arena.take_free(nbytes, tight=True, owner=owner)
            if segment is not None:
                return segment
            arena.shrink_free(capacity)
        try:
            return arena.create(nbytes, None if saver is None else (saver.uid, saver.gid))
        except OSError as e:
            raise BudgetExceeded(
                f"cannot allocate {format_bytes(capacity)} in {arena.directory}: {e.strerror}. "
                "The shared-memory file system is fuller than the budget assumes; lower "
                "--memory-limit or enlarge /dev/shm"
            ) from e

    def commit(self, session: Session, req: m.CommitRequest) -> m.CommitReply:
        """Validate the manifest the client wrote and publish the next generation."""
        with self.cond:
            res = session.reservations.pop(req.reservation, None)
        if res is None:
            raise CkptCacheError(
                f"unknown reservation {req.reservation}: it was already committed or aborted"
            )
        segment = res.segment
        try:
            manifest, header = self._validate(segment, res, req)
        except BaseException:
            # Any refusal (bad manifest, malformed field, a bug) gives the segment back:
            # a reservation that can never be committed must not hold memory for ever.
            with self.cond:
                self.arena.release(segment)
                self.cond.notify_all()
            raise
        with self.cond:
            number = self.index.next_number((res.namespace, res.path))
            header = SegmentHeader(
                state=SegmentState.COMMITTED, generation=number,
                payload_offset=header.payload_offset, payload_size=header.payload_size,
                manifest_offset=header.manifest_offset, manifest_size=header.manifest_size,
                digest_offset=header.digest_offset, n_storages=header.n_storages,
                digest_state=DigestState.PENDING, created_ns=header.created_ns,
                committed_ns=time.time_ns(),
            )  # fmt: skip
            if res.saver is not None:
                ownership.write_record(segment, res.saver)
            segment.write_header(header)
            gen = Generation(
                res.namespace, res.path, number, segment, manifest, size=manifest.payload_size,
                needs_persist=res.persist, saver=res.saver, committed=header.committed_ns / 1e9,
                committed_ns=header.committed_ns, anchor=res.anchor,
            )  # fmt: skip
            if res.digests is not None:
                self._record_digests(gen, res.digests)
            self.index.add(gen)
            if gen.needs_persist:
                self._supersede_older(gen.key)
                self.persister.submit(gen)
            self.apply_retention(gen.key)
            self.metrics.saves.inc()
            self.metrics.bytes_saved.inc(manifest.payload_size)
            if req.stall_seconds > 0:
                self.metrics.save_latency.observe(req.stall_seconds)
            self._update_gauges()
            self.cond.notify_all()
        log.debug("committed %s generation %d", res.path, number)
        self._digest_queue.put(gen)
        for hook in self.on_commit:
            hook(gen, res.durability)
        return m.CommitReply(number)

    def receive(
        self,
        namespace: str,
        path: str,
        nbytes: int,
        manifest_offset: int,
        manifest_size: int,
        fill: Callable[[memoryview, Callable[[int], None]], None],
        origin: str,
        *,
        verify: bool = True,
        persisted: bool = False,
        digests: Callable[[], list[int]] | None = None,
        saved_at: float | None = None,
    ) -> Generation:
        """Take a copy from a peer or storage: reserve, ``fill`` the bytes after the header,
        verify every digest against the table that came with them (``verify``) or compute the
        table (a copy read from storage), and commit it as this node's generation.
        ``digests()``, when given, returns the digests ``fill`` already verified.

        ``fill(view, advance)`` calls ``advance(n)`` whenever the first ``n`` bytes of ``view``
        are final: until the commit, peers asking for the same path are relayed those bytes
        as they land (see :attr:`inflight`), so a broadcast is pipelined hop by hop.
        ``saved_at``: the origin's commit time of a backup copy; refused if the path was
        deleted here since (checked before and after the transfer).
        """
        self._refuse_deleted(namespace, path, saved_at)
        reply = self.reserve(self.internal, m.ReserveRequest(namespace, path, nbytes))
        key = (namespace, path)
        with self.cond:
            segment = self.internal.reservations[reply.reservation].segment
            flight = Inflight(segment, nbytes, manifest_offset, manifest_size, persisted=persisted)
            self.inflight.setdefault(key, flight)

        def advance(n: int) -> None:
            with self.cond:
                flight.ready = HEADER_SIZE + n
                self.cond.notify_all()

        try:
            view = segment.view()
            try:
                fill(view[HEADER_SIZE:nbytes], advance)
            finally:
                del view
            manifest, header = self._validate(
                segment, self.internal.reservations[reply.reservation],
                m.CommitRequest(reply.reservation, manifest_offset, manifest_size),
            )  # fmt: skip
            view = segment.view()
            try:
                start, n = header.digest_offset, header.n_storages
                if digests is not None:
                    table = digests()
                elif verify:
                    table = unpack_digests(view[start : start + 8 * n], n)
                    verify_digests(view, manifest, table, tier=Tier.PEER)
                else:
                    table = compute_digests(view, manifest)
                    view[start : start + 8 * n] = pack_digests(table)
            finally:
                del view
        except BaseException:
            with self.cond:
                flight.failed = True
                if self.inflight.get(key) is flight:
                    del self.inflight[key]
                self.cond.notify_all()
            self.abort(self.internal, m.AbortRequest(reply.reservation))
            raise
        try:
            self._refuse_deleted(namespace, path, saved_at)
        except CheckpointNotFound:
            with self.cond:
                if self.inflight.get(key) is flight:
                    del self.inflight[key]
            self.abort(self.internal, m.AbortRequest(reply.reservation))
            raise
        with self.cond:
            if self.inflight.get(key) is flight:
                del self.inflight[key]  # committed below: later fetches use the index
            res = self.internal.reservations[reply.reservation]
            res.digests = table  # published with the generation: nobody hashes it again
            if persisted:
                res.persist = False
        self.commit(
            self.internal, m.CommitRequest(reply.reservation, manifest_offset, manifest_size)
        )
        with self.cond:
            gen = self.index.newest((namespace, path))
            assert gen is not None
            gen.origin = origin
            header = gen.segment.read_header()
            if persisted:  # read back from its own storage path: already safe there
                gen.persisted, gen.persist_state = True, PersistState.PERSISTED
                gen.needs_persist = self._persistable(path)  # wait() answers "persisted"
            gen.segment.write_header(
                replace(header, digest_state=DigestState.VALID, persisted=int(persisted))
            )
        return gen

    def _refuse_deleted(self, namespace: str, path: str, saved_at: float | None) -> None:
        with self.cond:
            deleted = self.deleted.get((namespace, path))
        if saved_at is not None and deleted is not None and deleted >= saved_at:
            raise CheckpointNotFound(
                f"{path!r} was deleted on node {self.config.node_id!r} after this copy was "
                "saved: backup copy refused"
            )

    def ensure_digests(self, gen: Generation) -> list[int]:
        """Digests of ``gen``, computed now if the background worker has not yet."""
        if gen.digests is not None:
            return gen.digests
        with self.cond:
            self.pin(gen)
        try:
            return self._compute_digests(gen)
        finally:
            self.unpin(gen)

    def _validate(
        self, segment: Segment, res: Reservation, req: m.CommitRequest
    ) -> tuple[Manifest, SegmentHeader]:
        cap = segment.capacity
        if not (HEADER_SIZE <= req.manifest_offset <= cap - req.manifest_size):
            raise CorruptCheckpoint(f"commit of {res.path!r}: manifest outside the segment")
        view = segment.view()
        try:
            manifest = Manifest.from_json(
                view[req.manifest_offset : req.manifest_offset + req.manifest_size],
                segment_size=cap,
            )
        finally:
            del view
        if (manifest.namespace, manifest.path) != (res.namespace, res.path):
            raise CorruptCheckpoint(
                f"commit of {res.path!r}: manifest names {manifest.path!r} instead"
            )
        if manifest.payload_offset + manifest.payload_size > req.manifest_offset:
            raise CorruptCheckpoint(f"commit of {res.path!r}: manifest overlaps the payload")
        digest_offset = align(req.manifest_offset + req.manifest_size, 64)
        n = len(manifest.storages)
        if digest_offset + 8 * n > cap:
            raise CorruptCheckpoint(f"commit of {res.path!r}: digest table outside the segment")
        header = SegmentHeader(
            state=SegmentState.WRITING, generation=0, payload_offset=manifest.payload_offset,
            payload_size=manifest.payload_size, manifest_offset=req.manifest_offset,
            manifest_size=req.manifest_size, digest_offset=digest_offset, n_storages=n,
            digest_state=DigestState.PENDING, created_ns=time.time_ns(), committed_ns=0,
        )  # fmt: skip
        return manifest, header

    def abort(self, session: Session, req: m.AbortRequest) -> None:
        """Give a reservation back."""
        with self.cond:
            res = session.reservations.pop(req.reservation, None)
            if res is not None:
                self.arena.release(res.segment)
                self.cond.notify_all()

    # ----------------------------------------------------------------- retention and pins

    def _supersede_older(self, key: Key) -> None:
        """Older unpersisted generations need not reach storage: the newest will."""
        gens = self.index.generations(key)
        for old in gens[:-1]:
            if old.needs_persist and not old.persisted:
                old.needs_persist = False
                if old.persist_state in (PersistState.QUEUED, PersistState.FAILED):
                    old.persist_state = PersistState.SUPERSEDED

    def apply_retention(self, key: Key) -> None:
        """Retire generations beyond the configured ``keep`` (never an unpersisted one)."""
        for old in self.index.superseded(key, self.config.keep_for(key[1])):
            if old.needs_persist and not old.persisted:
                continue  # never drop a generation storage has not received yet
            self._retire(old)

    def _retire(self, gen: Generation) -> None:
        self.index.remove(gen)
        for hook in self.on_retire:
            hook(gen)
        if gen.pins:
            gen.retired = True
        else:
            self.arena.release(gen.segment)
        self.cond.notify_all()

    def supersede(self, session: Session, req: m.SupersedeRequest) -> m.DeleteReply:
        """A client wrote ``path`` through to storage: every generation in memory is older.

        They are retired (freed once unpinned) and never persisted, so neither a load nor a
        later persist can bring the older bytes back.
        """
        _check_key(req.namespace, req.path)
        with self.cond:
            gens = self.index.generations((req.namespace, req.path))
            for gen in gens:
                if not gen.persisted:
                    gen.needs_persist, gen.persist_state = False, PersistState.SUPERSEDED
                self._retire(gen)
            self._update_gauges()
        if gens:
            log.info("%s written through: %d older generation(s) retired", req.path, len(gens))
        return m.DeleteReply(len(gens))

    def mark_orphans(self) -> int:
        """Flag generations whose save directory was removed (call under the lock).

        They become evictable and are never persisted (see :mod:`ckptcache.server.lineage`);
        returns how many were newly flagged.
        """
        found = 0
        gone: dict[str, bool] = {}
        for gen in list(self.index):
            if gen.orphaned or not gen.anchor:
                continue
            if gen.anchor not in gone:
                gone[gen.anchor] = is_orphaned(gen.anchor)
            if gone[gen.anchor]:
                gen.orphaned, found = True, found + 1
                if gen.needs_persist and not gen.persisted:
                    gen.needs_persist, gen.persist_state = False, PersistState.DROPPED
                    gen.persist_error = removed_reason(gen.anchor)
        return found

    def sweep_orphans(self) -> int:
        """Drop unpinned generations whose directory was removed; returns how many."""
        with self.cond:
            self.mark_orphans()
            victims = [g for g in self.index if g.orphaned and g.pins == 0]
            for gen in victims:
                log.info("dropping %s generation %d: %s", gen.path, gen.number,
                         "its directory was removed")  # fmt: skip
                self._retire(gen)
            if victims:
                self._update_gauges()
        return len(victims)

    def _sweep_loop(self) -> None:
        interval = self.config.orphan_sweep
        while not self._stopping.wait(interval):
            try:
                self.sweep_orphans()
            except Exception:
                log.exception("orphan sweep failed")

    def pin(self, gen: Generation) -> None:
        """Keep ``gen``'s segment alive (call under the lock)."""
        gen.pins += 1

    def _unpin(self, gen: Generation) -> None:
        gen.pins -= 1
        if gen.pins == 0 and gen.retired:
            gen.retired = False
            self.arena.release(gen.segment)
            self.cond.notify_all()

    def unpin(self, gen: Generation) -> None:
        """Drop a pin taken with :meth:`pin`."""
        with self.cond:
            self._unpin(gen)

    # ----------------------------------------------------------------- load

    def _lookup(
        self,
        namespace: str,
        path: str,
        number: int | None = None,
        session: Session | None = None,
        *,
        load: bool = False,
    ) -> Generation:
        """The newest (or ``number``) generation; one ``session`` may not see or load counts
        as absent for it."""
        _check_key(namespace, path)
        key = (namespace, path)
        gen = self.index.newest(key) if number is None else self.index.get(key, number)
        if gen is not None and session is not None and not self._visible(session, gen, load):
            gen = None
        if gen is None:
            what = "is" if number is None else f"generation {number} is"
            raise CheckpointNotFound(
                f"{path!r} {what} not in the memory of node {self.config.node_id!r} "
                f"(namespace {namespace!r}); load it from storage or check the path"
            )
        return gen

    def check_not_corrupt(self, gen: Generation) -> None:
        """Refuse to serve a generation whose bytes were found corrupt (call under the lock)."""
        if gen.corrupt:
            raise CorruptCheckpoint(
                f"{gen.path!r} generation {gen.number} in the memory of node "
                f"{self.config.node_id!r} is corrupt and is not served: {gen.corrupt}",
                tier=Tier.LOCAL,
            )

    def open(self, session: Session, req: m.OpenRequest) -> m.OpenReply:
        """Pin a generation for a load and say where it lies."""
        t0 = time.perf_counter()
        tier = Tier.LOCAL
        try:
            with self.cond:
                gen = self._lookup(req.namespace, req.path, req.generation, session, load=True)
                self.check_not_corrupt(gen)
                self.pin(gen)
        except CheckpointNotFound:
            if self.cluster is None or req.generation is not None:
                raise
            if self.index.generations((req.namespace, req.path)):
                raise  # held by another user: never replaced by a remote copy for this one
            gen = self._load_remote(req.namespace, req.path, _bounded(120.0, req.timeout))
            tier = Tier.STORAGE if gen.origin == "storage" else Tier.PEER
            with self.cond:
                if not self._visible(session, gen, True):
                    self._lookup(req.namespace, req.path, None, session, load=True)  # raises
                self.pin(gen)
        try:
            if req.need_digests and gen.digests is None:
                self._compute_digests(gen)
        except BaseException:
            self.unpin(gen)
            raise
        with self.cond:
            lease = next(self._ids)
            session.leases[lease] = gen
            header = gen.segment.read_header()
            gen.last_load_tier = tier
            self.metrics.loads.labels(tier=tier).inc()
            self.metrics.bytes_loaded.labels(tier=tier).inc(gen.size)
        self.metrics.load_latency.observe(time.perf_counter() - t0)
        log.debug("load of %s served from the %s tier", gen.path, tier)
        return m.OpenReply(
            lease, gen.segment.name, gen.segment.capacity, gen.number, header.manifest_offset,
            header.manifest_size, header.digest_offset, header.n_storages, gen.digests is not None,
            tier,
        )  # fmt: skip

    def _load_remote(self, namespace: str, path: str, timeout: float) -> Generation:
        """A peer's copy or the group's storage read; without a coordinator neither can be
        found, and the client reads storage itself (CheckpointNotFound says so)."""
        from ckptcache.server.coord import CoordinatorUnavailable

        try:
            gen: Generation = self.cluster.load_remote(namespace, path, timeout=timeout)
        except CoordinatorUnavailable as e:
            raise CheckpointNotFound(
                f"{path!r} is not in the memory of node {self.config.node_id!r} and the "
                f"coordinator is unreachable ({e}): read it from storage"
            ) from e
        return gen

    def prefetch(self, session: Session, req: m.PrefetchRequest) -> m.PrefetchReply:
        """Warm this node's memory with ``path`` (peer or storage) without pinning it."""
        reply = self.open(session, m.OpenRequest(req.namespace, req.path, timeout=req.timeout))
        self.release(session, m.ReleaseRequest((reply.lease,)))
        with self.cond:
            gen = self._lookup(req.namespace, req.path, None, session)
            return m.PrefetchReply(reply.tier, gen.size, gen.number)

    def release(self, session: Session, req: m.ReleaseRequest) -> None:
        """Drop leases (unknown ones are ignored: a release may race a reconnect)."""
        with self.cond:
            for lease in req.leases:
                gen = session.leases.pop(lease, None)
                if gen is not None:
                    self._unpin(gen)

    def report_corrupt(self, session: Session, req: m.ReportCorruptRequest) -> None:
        """A client found bad bytes: drop that generation so nobody loads it again."""
        self.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
        log.error("corrupt copy of %s generation %d: %s", req.path, req.generation, req.detail)
        with self.cond:
            gen = self.index.get((req.namespace, req.path), req.generation)
            if gen is not None:
                self._retire(gen)
                self._update_gauges()

    # ----------------------------------------------------------------- digests

    def _compute_digests(self, gen: Generation) -> list[int]:
        """Compute and record ``gen``'s digests; the caller holds a pin.

        Single flight: the background digester and a caller that needs the digests now
        (a backup push, a verified load) never hash the same generation twice.
        """
        with gen.digest_lock:
            if gen.digests is not None:
                return gen.digests
            view = gen.segment.view()
            try:
                digests = compute_digests(view, gen.manifest)
            finally:
                del view
            return self._record_digests(gen, digests)

    def _record_digests(self, gen: Generation, digests: list[int]) -> list[int]:
        with self.cond:
            if gen.digests is None:
                gen.digests = digests
                header = gen.segment.read_header()
                table = pack_digests(digests)
                mapping = gen.segment.mapping
                mapping[header.digest_offset : header.digest_offset + len(table)] = table
                view = gen.segment.view()
                try:  # the skeleton and manifest are small: hashed here, with the table
                    skeleton, manifest = meta_digests(
                        view, gen.manifest, header.manifest_offset, header.manifest_size
                    )
                finally:
                    del view
                gen.segment.write_header(replace(
                    header, digest_state=DigestState.VALID, skeleton_digest=skeleton,
                    manifest_digest=manifest,
                ))  # fmt: skip
            return gen.digests

    def _digest_loop(self) -> None:
        # Digests are off the trainer's critical path; keep them from competing with training.
        lower_thread_priority()
        while True:
            gen = self._digest_queue.get()
            if gen is None:
                return
            with self.cond:
                if gen.digests is not None or (gen.retired or gen.pins < 0):
                    continue
                if self.index.get(gen.key, gen.number) is not gen:
                    continue  # retired before we got to it
                self.pin(gen)
            try:
                self._compute_digests(gen)
            except Exception:
                log.exception("digest of %s generation %d failed", gen.path, gen.number)
            finally:
                self.unpin(gen)

    def verify(self, session: Session, req: m.VerifyRequest) -> m.VerifyReply:
        """Recompute digests of the newest generation and compare with the recorded ones."""
        with self.cond:
            gen = self._lookup(req.namespace, req.path, None, session)
            self.pin(gen)
        try:
            recorded = gen.digests if gen.digests is not None else self._compute_digests(gen)
            header = gen.segment.read_header()
            view = gen.segment.view()
            try:
                verify_meta(
                    view, gen.manifest, header.manifest_offset, header.manifest_size,
                    (header.skeleton_digest, header.manifest_digest), tier=Tier.LOCAL,
                )  # fmt: skip
                verify_digests(view, gen.manifest, recorded, tier=Tier.LOCAL)
            finally:
                del view
        except CorruptCheckpoint as e:
            self.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
            return m.VerifyReply(False, gen.number, len(gen.manifest.storages), str(e))
        finally:
            self.unpin(gen)
        return m.VerifyReply(True, gen.number, len(gen.manifest.storages))

    # ----------------------------------------------------------------- inspection

    def info(self, gen: Generation) -> m.ObjectInfo:
        """Describe one generation (call under the lock)."""
        stages = ["local"]
        if gen.persisted:
            stages.append("persisted")

        return m.ObjectInfo(
            namespace=gen.namespace, path=gen.path, generation=gen.number, size=gen.size,
            stages=tuple(stages), committed=gen.committed, segment=gen.segment.name,
            pins=gen.pins, digests_valid=gen.digests is not None,
            generations=len(self.index.generations(gen.key)), persist_state=gen.persist_state,
            persist_error=gen.persist_error, persist_seconds=gen.persist_seconds,
            replicas=tuple(sorted(gen.replicas)), origin=gen.origin, conflict=gen.conflict,
            last_load_tier=gen.last_load_tier,
        )  # fmt: skip

    def stat(self, session: Session, req: m.StatRequest) -> m.ObjectInfo:
        """Status of a path's newest generation."""
        with self.cond:
            return self.info(self._lookup(req.namespace, req.path, None, session))

    def list(self, session: Session, req: m.ListRequest) -> m.ListReply:
        """Newest generation of every path under a prefix."""
        with self.cond:
            out = []
            for ns, path in self.index.paths():
                if (req.namespace is None or ns == req.namespace) and path.startswith(req.prefix):
                    gen = self.index.newest((ns, path))
                    assert gen is not None
                    if self._visible(session, gen, False):
                        out.append(self.info(gen))
        return m.ListReply(tuple(out))

    def delete(self, session: Session, req: m.DeleteRequest) -> m.DeleteReply:
        """Drop every generation of a path from memory, own and backup copies (storage is
        untouched); backup copies of earlier saves still in transit are refused."""
        with self.cond:
            self.deleted[(req.namespace, req.path)] = time.time()
            gens = [
                g
                for g in self.index.generations((req.namespace, req.path))
                if self._visible(session, g, False)
            ]
            if not gens:
                self._lookup(req.namespace, req.path, None, session)  # CheckpointNotFound
            for gen in gens:
                self._retire(gen)
            self._update_gauges()
        return m.DeleteReply(len(gens))

    def pool_info(self, session: Session, req: m.PoolRequest) -> m.PoolReply:
        """The spare segments this session's user may map ahead of a save."""
        with self.cond:
            return self.pool.describe(session.uid)

    def status(self, session: Session, req: m.StatusRequest) -> m.DaemonStatus:
        """Daemon-wide counters."""
        with self.cond:
            gens = list(self.index)
            return m.DaemonStatus(
                node_id=self.config.node_id, pid=os.getpid(), version=__version__,
                uptime=time.time() - self.started, memory_limit=self.config.memory_limit,
                memory_used=self.arena.used, memory_free_pool=self.arena.free_bytes,
                segments=len(self.arena.segments), free_segments=len(self.arena.free),
                objects=len(self.index.paths()), generations=len(gens),
                pinned=sum(1 for g in gens if g.pins), reservations=0,
                shm_dir=self.config.shm_dir, socket=self.config.socket,
                persist_queue=len(self.persister.queue), persist_roots=tuple(self.roots),
                cluster_nodes=self.cluster.node_ids() if self.cluster else (),
                coordinator=self.config.coordinator,
                memory_stored=sum(g.size for g in gens),
                spare_segments=len(self.pool.describe(self.arena.uid).segments),
            )  # fmt: skip

    def wait(self, session: Session, req: m.WaitRequest) -> m.WaitReply:
        """Block until ``path`` (or everything under a prefix) is persisted, failed, or timed out.

        The reply's state is ``persisted``, ``memory-only``, ``failed`` (with the error),
        ``dropped`` (its directory was removed: deleted by the user) or ``timeout``; a prefix
        wait ignores memory-only objects.
        """
        deadline = time.monotonic() + max(0.0, req.timeout)
        with self.cond:
            while True:
                if req.prefix:
                    gens = [self.index.newest(k) for k in self.index.paths()
                            if k[0] == req.namespace and k[1].startswith(req.path)]  # fmt: skip
                    pending = [g for g in gens if g is not None and g.needs_persist
                               and self._visible(session, g, False)]  # fmt: skip
                else:
                    pending = [self._lookup(req.namespace, req.path, None, session)]
                if not req.prefix and pending[0].persist_state == PersistState.DROPPED:
                    return m.WaitReply(
                        pending[0].number, WaitState.DROPPED, pending[0].persist_error
                    )
                failed = [g for g in pending if g.persist_state == PersistState.FAILED]
                if failed:
                    return m.WaitReply(failed[0].number, WaitState.FAILED, failed[0].persist_error)
                if all(g.persisted or not g.needs_persist for g in pending):
                    if len(pending) == 1 and not pending[0].needs_persist:
                        return m.WaitReply(pending[0].number, WaitState.MEMORY_ONLY)
                    return m.WaitReply(
                        max((g.number for g in pending), default=0), WaitState.PERSISTED
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return m.WaitReply(pending[0].number, WaitState.TIMEOUT)
                self.cond.wait(min(remaining, 1.0))

    def _visible(self, session: Session, gen: Generation, load: bool) -> bool:
        check = ownership.may_load if load else ownership.may_see
        return check(self, session, gen)

    def _update_gauges(self) -> None:
        self.metrics.segments.set(len(self.arena.segments))
        self.metrics.memory_used.set(self.arena.used)
