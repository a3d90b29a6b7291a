"""Saves: sessions, reservations, and commit (the room for a reservation is
:mod:`ckptcache.server.memory.budget`'s).

Call order (per client connection, see :mod:`ckptcache.wire.messages`)::

    session = saves.open_session(pid, uid)
    saves.reserve(session, ReserveRequest)  -> segment to copy into (Budget.room_locked)
    saves.commit(session, CommitRequest)    -> generation published (or saves.abort)
    saves.commit_pinned(session, CommitRequest) -> a staging copy, held by a lease
    saves.close_session(session)            -> everything the connection held is let go

A commit validates the manifest the client wrote, publishes the generation in the index,
queues it for digests and (under a root) for persistence, applies retention, then runs the
``on_commit`` hooks outside the lock (the cluster's replication; a hook may raise).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, replace

from ckptcache.errors import (
    BudgetExceeded,
    CkptCacheError,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    InvalidPath,
    PathNotAllowed,
    ReplicationError,
)
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState, align
from ckptcache.format.manifest import Manifest
from ckptcache.server import ownership
from ckptcache.server.config import DaemonConfig
from ckptcache.server.manifest_memo import ManifestMemo
from ckptcache.server.memory import records
from ckptcache.server.memory.arena import Segment
from ckptcache.server.memory.budget import Budget
from ckptcache.server.memory.eviction import EvictionPolicy
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.staging import drop_lease_locked
from ckptcache.server.persist.digester import Digester
from ckptcache.server.persist.lineage import anchor_of, check_persistable, observe_base
from ckptcache.server.persist.persister import Persister
from ckptcache.server.persist.provenance import Provenance, write_provenance
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.state import (
    CacheState,
    NewerHeld,
    Reservation,
    Session,
    bounded,
    check_key,
)
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState

__all__ = ["Saves", "persistable"]

_DURABILITIES = ("memory", "local", "backup", "persisted")

log = logging.getLogger(__name__)


def persistable(roots: PersistRoots, path: str) -> bool:
    """Whether ``path`` lies under a storage root (a path escaping one is kept in memory)."""
    try:
        return roots.root_for(path) is not None
    except PathNotAllowed as e:
        log.error("keeping %s in memory only: %s", path, e)
        return False


@dataclass(eq=False)
class Saves:
    """Reservations within the budget and the commit that publishes a generation."""

    config: DaemonConfig
    state: CacheState
    _: KW_ONLY
    pool: SegmentPool
    persister: Persister
    retention: Retention
    digester: Digester
    roots: PersistRoots
    #: What may be evicted for room, in which order (see server/memory/eviction.py).
    eviction: EvictionPolicy
    #: Whether backup copies can be made (a cluster with backup nodes configured).
    backup_ready: bool

    def __post_init__(self) -> None:
        self.metrics = self.state.metrics
        #: Called (outside the lock) with each newly committed generation and the durability
        #: the client asked for; the cluster hooks replication in (and may raise).
        self.on_commit: list[Callable[[Generation, str], None]] = []
        #: In a cluster: the stamp of the cluster's newest save of a path (0: none), read
        #: when a save begins (:meth:`ckptcache.server.cluster.truth.Truth.seen`; may raise
        #: CoordinatorUnavailable). None: this node's own saves are the only ones.
        self.newest_seen: Callable[[str, str], int] | None = None
        #: Where that read runs: beside the client's copy, so a large save's stall does not
        #: grow by a coordinator round trip (the commit waits for it).
        self._reads = ThreadPoolExecutor(4, thread_name_prefix="newest-seen")
        #: The daemon's own session: copies received from peers or storage.
        self.internal = Session(0, os.getpid(), os.getuid())
        #: Room for each reservation within the budget and its user's share.
        self.budget = Budget(
            self.config, self.state, pool=self.pool, retention=self.retention,
            eviction=self.eviction,
        )  # fmt: skip
        #: Manifests decoded in full, whose repeats a commit accepts from their bytes.
        self.manifests = ManifestMemo()

    # ----------------------------------------------------------------- sessions

    def open_session(self, pid: int, uid: int, gid: int = -1) -> Session:
        """Register a new client connection."""
        return Session(self.state.next_id(), pid, uid, gid=gid)

    def close_session(self, session: Session) -> None:
        """Abort the connection's reservations and drop its pins (a dead trainer holds nothing)."""
        state = self.state
        with state.lock.held():
            for res in session.reservations.values():
                log.info("aborting reservation %d of %s (client gone)", res.id, res.path)
                state.arena.release(res.segment)
            state.saves_in_flight.end(len(session.reservations))
            session.reservations.clear()
            for lease, gen in session.leases.items():
                drop_lease_locked(state, lease, gen)  # staging copies go with their leases
            session.leases.clear()
            state.update_gauges()
        state.lock.notify_all()
        self.pool.refill()

    # ----------------------------------------------------------------- reserve

    def _classify(self, path: str, durability: str) -> bool:
        """Whether a save of ``path`` will be persisted; refuses paths escaping a root, and
        paths under no root unless memory-only was chosen (per save, or by the daemon's
        ``--memory-only allow``): never a save that silently stays in memory."""
        if durability not in _DURABILITIES:
            raise InvalidPath(
                f"durability must be one of {', '.join(_DURABILITIES)}, not {durability!r}"
            )
        root = self.roots.root_for(path)
        if durability == "memory":
            return False
        if root is None and self.config.memory_only != "allow":
            raise PathNotAllowed(
                f"{path!r} is under no storage root of this daemon (roots: "
                f"{self.roots.describe()}), so it could never be persisted. Save under a "
                "root, start the daemon with --persist-root covering it, or choose memory "
                "only explicitly: durability='memory' for this save, or --memory-only allow "
                "on the daemon"
            )
        if root is not None and "://" not in path:
            check_persistable(path)
            if self.roots.implicit:  # this daemon is the user: the kernel's answer is theirs
                anchor = anchor_of(path)
                if not os.access(anchor, os.W_OK | os.X_OK):
                    raise PathNotAllowed(
                        f"cannot save {path!r}: uid {os.geteuid()} may not write in {anchor}"
                    )
        return root is not None

    def reserve(self, session: Session, req: m.ReserveRequest) -> m.ReserveReply:
        """Find room for ``req.nbytes``: reuse, create, evict, then wait up to the timeout."""
        check_key(req.namespace, req.path)
        if not isinstance(req.nbytes, int) or req.nbytes <= 0:
            raise InvalidPath(f"reserve needs a positive byte count, got {req.nbytes!r}")
        persist = self._classify(req.path, req.durability)
        saver = ownership.saver_for(session, req)
        anchor = anchor_of(req.path)  # which directories exist now (never resurrected later)
        base, base_stamp = observe_base(req.path) if persist else (None, 0)
        seen = None
        if self.newest_seen is not None and session is not self.internal:
            seen = self._reads.submit(self._seen, req)
        if req.durability == "backup" and not self.backup_ready:
            raise ReplicationError(
                "durability='backup' needs backup nodes: start the daemons with --backup auto "
                "(or a list of node ids), --listen and a shared --coordinator"
            )
        self.budget.check_whole(req.path, req.nbytes)
        deadline = time.monotonic() + bounded(self.config.reserve_timeout, req.timeout)
        state = self.state
        with state.lock.held():
            ownership.check_may_save(state, session, (req.namespace, req.path))
            segment = self.budget.room_locked(req.path, req.nbytes, saver, session, deadline)
            if segment.sealable and session is not self.internal:
                self._unseal_locked(segment)
            self._prepare_record_locked(segment, req)
            res = Reservation(
                state.next_id(), req.namespace, req.path, segment, req.nbytes, req.durability,
                persist, saver, anchor=anchor, base=base, base_stamp=base_stamp, seen=seen,
                kept=segment.handed_digests,
            )  # fmt: skip
            session.reservations[res.id] = res
            state.saves_in_flight.begin()
            session.note_mapped((segment.name,), state.arena.segments)  # the client maps it now
            state.update_gauges()
            handed = segment.handed
        return m.ReserveReply(res.id, segment.name, segment.capacity, handed)

    def _seen(self, req: m.ReserveRequest) -> int:
        """The stamp of the newest save of the path this save follows, cluster-wide. Through
        a coordinator outage, this node's own newest save of the path: the save still goes
        ahead, and may be reported as racing with a save made elsewhere meanwhile."""
        assert self.newest_seen is not None
        try:
            return self.newest_seen(req.namespace, req.path)
        except CoordinatorUnavailable as e:
            log.warning("cannot read the newest save of %s (%s): ordering it by this node's "
                        "own saves", req.path, e)  # fmt: skip
            with self.state.lock.held():
                newest = self.state.index.newest((req.namespace, req.path))
            return newest.committed_ns if newest is not None else 0

    def _prepare_record_locked(self, segment: Segment, req: m.ReserveRequest) -> None:
        """Allocate the daemon's record of the commit now (see :func:`records.prepare`): a
        full file system refuses the reservation, before the trainer copies a byte, rather
        than the commit after it."""
        try:
            records.prepare(segment, req.namespace, req.path)
        except OSError as e:
            self.state.arena.release(segment)
            self.metrics.budget_failures.inc()
            raise BudgetExceeded(_full(self.state.arena.directory, req.path, e)) from e

    def _unseal_locked(self, segment: Segment) -> None:
        """Let an admitted user's trainer open its segment for writing, until the commit."""
        try:
            segment.unseal()
        except OSError as e:
            self.state.arena.release(segment)
            raise CkptCacheError(f"cannot hand segment {segment.name} to its user: {e}") from e

    # ----------------------------------------------------------------- commit

    def commit(self, session: Session, req: m.CommitRequest) -> m.CommitReply:
        """Validate the manifest the client wrote and publish the next generation."""
        number, _, content = self._commit(session, req, pinned=False)
        return m.CommitReply(number, content)

    def commit_pinned(self, session: Session, req: m.CommitRequest) -> m.PinnedCommitReply:
        """Commit a ``memory`` reservation as a staging copy, pinned for ``session`` in the
        same step: no eviction or retention can drop it before the lease goes, and dropping
        the lease (a release, the connection's end) drops the copy. It is never announced,
        replicated, digested or persisted: nobody but its holder needs it."""
        number, lease, _ = self._commit(session, req, pinned=True)
        return m.PinnedCommitReply(number, lease)

    def _commit(
        self, session: Session, req: m.CommitRequest, *, pinned: bool
    ) -> tuple[int, int, int]:
        """The commit of ``req``: its generation number, with ``pinned`` its lease, and the
        token naming the bytes it left in the segment (``Segment.content``)."""
        state = self.state
        with state.lock.held():
            res = session.reservations.pop(req.reservation, None)
        if res is None:
            raise CkptCacheError(
                f"unknown reservation {req.reservation}: it was already committed or aborted"
            )
        state.saves_in_flight.end()  # its copy is done: background work may follow it
        if res.seen is not None:
            res.seen_ns = res.seen.result()  # read while the client copied
        segment = res.segment
        try:
            if pinned and (res.persist or res.durability != "memory" or res.origin):
                raise CkptCacheError(
                    f"a staging copy of {res.path!r} must be reserved with durability 'memory', "
                    f"not {res.durability!r}"
                )
            if segment.sealable and not segment.sealed:
                self._seal_for_commit(segment, res)
            manifest, header = self.validate(segment, res, req)
            expected = self._kept(res, req)
        except BaseException:
            # Any refusal (bad manifest, malformed field, a bug) gives the segment back:
            # a reservation that can never be committed must not hold memory for ever.
            with state.lock.held():
                self._give_back_locked(res)
            state.lock.notify_all()
            self.pool.refill()
            raise
        with state.lock.held():
            if res.origin:
                self._refuse_older_copy_locked(res)
            number = state.index.next_number((res.namespace, res.path))
            header = SegmentHeader(
                state=SegmentState.COMMITTED, generation=number,
                payload_offset=header.payload_offset, payload_size=header.payload_size,
                manifest_offset=header.manifest_offset, manifest_size=header.manifest_size,
                digest_offset=header.digest_offset, n_storages=header.n_storages,
                digest_state=DigestState.PENDING, created_ns=header.created_ns,
                # A copy keeps its content's time: a later persist of it must not look newer
                # than what was saved after it elsewhere.
                committed_ns=(res.saved_ns or int(res.saved_at * 1e9)) if res.origin
                else self._stamp_locked(res),
            )  # fmt: skip
            try:  # blocks allocated at the reservation: only a failing file system refuses
                records.write_key(segment, res.namespace, res.path, staging=pinned)
                if res.saver is not None:
                    ownership.write_record(segment, res.saver)
                write_provenance(
                    segment, Provenance(res.base, res.anchor, memory_only=not res.persist)
                )
                segment.write_header(header)
            except OSError as e:
                self._give_back_locked(res)  # its record with it: nothing is left behind
                state.lock.notify_all()
                raise BudgetExceeded(_full(state.arena.directory, res.path, e)) from e
            # Fresh at every commit: no token outlives the bytes it names. Only for a client
            # that watches its storages (no other can use one, and each costs a check).
            content = segment.content = secrets.randbits(62) + 1 if req.watched else 0
            if content:
                session.note_token(content, state.arena.segments.values())
            gen = Generation(
                res.namespace, res.path, number, segment, manifest, size=manifest.payload_size,
                needs_persist=res.persist, saver=res.saver, committed=header.committed_ns / 1e9,
                committed_ns=header.committed_ns, anchor=res.anchor, origin=res.origin,
                base=res.base, observe_base=res.persist and res.base is None and "://" in res.path,
                seen_ns=-1 if res.origin else res.seen_ns, expected=expected,
            )  # fmt: skip
            if res.stored:  # read back from its own storage path: already safe there
                state.persist_states.advance(gen, PersistState.PERSISTED, persisted=True)
                gen.needs_persist = persistable(self.roots, res.path)  # wait(): "persisted"
                segment.write_header(replace(header, persisted=1))
            if res.digests is not None:
                self.digester.record(gen, res.digests)
            state.index.add(gen)
            if res.relayed is not None:  # before anything can retire it
                state.hold_for_relays_locked(res.relayed, gen)
            if not res.stored:  # a newer save (a copy read back from storage is not one)
                state.superseded.forget(gen.key)
            lease = 0
            if pinned:  # held before anyone else can see it: nothing drops it meanwhile
                state.pin_locked(gen)
                lease = gen.staged_by = state.next_id()
                session.leases[lease] = gen
            if gen.needs_persist and not gen.persisted:
                self.retention.supersede_older_locked(gen.key)
                self.persister.submit(gen)
            self.retention.apply_locked(gen.key)
            self.metrics.saves.inc()
            self.metrics.bytes_saved.inc(manifest.payload_size)
            if expected:
                kept = (r.nbytes for r in manifest.storages if r.offset in expected)
                self.metrics.save_bytes_kept.inc(sum(kept))
            if req.stall_seconds > 0:
                self.metrics.save_latency.observe(req.stall_seconds)
            state.update_gauges()
        state.lock.notify_all()
        # Only now: a spare made during the client's copy would take a core from it.
        self.pool.refill()
        log.debug("committed %s generation %d", res.path, number)
        if pinned:
            return number, lease, 0
        self.digester.put(gen)
        for hook in self.on_commit:
            hook(gen, res.durability)
        return number, lease, content

    @staticmethod
    def _kept(res: Reservation, req: m.CommitRequest) -> dict[int, int] | None:
        """The digests the storages ``req`` kept in the segment must have (None: none kept);
        a storage kept where the segment was not checked to hold one is refused."""
        if not req.kept:
            return None
        missing = [offset for offset in req.kept if offset not in res.kept]
        if missing:
            raise CorruptCheckpoint(
                f"commit of {res.path!r}: a storage at offset {missing[0]} was not copied, but "
                "the segment was not handed out holding one there"
            )
        return {offset: res.kept[offset] for offset in req.kept}

    def _stamp_locked(self, res: Reservation) -> int:
        """The commit stamp of a save: the wall clock, but always after the object that was on
        storage when the save was made and after this node's last save of the path (a hybrid
        logical clock), so a node whose clock is behind still stamps its save as the newer
        one and a clock stepped back never reorders one node's saves."""
        newest = self.state.index.newest((res.namespace, res.path))
        last = newest.committed_ns if newest is not None else 0
        # ``seen_ns``: the cluster's newest save of the path, made on any node.
        return max(time.time_ns(), res.base_stamp + 1, last + 1, res.seen_ns + 1)

    def _give_back_locked(self, res: Reservation) -> None:
        """Release a reservation's segment that is not committed after all. A copy's relays
        (peers fed as it landed) are stopped first: none reads the segment once another
        save may take it."""
        if res.relayed is not None:
            self.state.stop_relays_locked(res.relayed)
        self.state.arena.release(res.segment)

    def _refuse_older_copy_locked(self, res: Reservation) -> None:
        """A copy from a peer or storage never becomes newer than a generation this node
        committed while it arrived (a trainer's save of the same path): newest wins."""
        newest = self.state.index.newest((res.namespace, res.path))
        # Exact stamps, never float seconds: a save made here after the copy's (stamped one
        # nanosecond after it, by a node whose clock is behind) is the same float.
        saved_ns = res.saved_ns or int(res.saved_at * 1e9)
        if newest is None or newest.committed_ns <= saved_ns:
            return
        self._give_back_locked(res)
        self.state.lock.notify_all()
        raise NewerHeld(
            f"copy of {res.path!r} from {res.origin} refused: node {self.config.node_id!r} "
            f"holds generation {newest.number}, saved after it",
            res.digests,
        )

    @staticmethod
    def _seal_for_commit(segment: Segment, res: Reservation) -> None:
        """Seal the segment its user wrote before reading a byte of it (see
        :mod:`ckptcache.server.memory.sealing`); a file cut meanwhile is refused."""
        try:
            size = segment.seal()
        except OSError as e:
            raise CorruptCheckpoint(
                f"commit of {res.path!r}: its segment {segment.name} cannot be sealed ({e})"
            ) from e
        if size < segment.capacity:
            raise CorruptCheckpoint(
                f"commit of {res.path!r}: its segment file was truncated to {size} of "
                f"{segment.capacity} bytes before the commit; save it again"
            )

    def validate(
        self, segment: Segment, res: Reservation, req: m.CommitRequest
    ) -> tuple[Manifest, SegmentHeader]:
        """Check the manifest written into ``segment`` against the reservation; returns it
        and the header the commit will write."""
        cap = segment.capacity
        if not (HEADER_SIZE <= req.manifest_offset <= cap - req.manifest_size):
            raise CorruptCheckpoint(f"commit of {res.path!r}: manifest outside the segment")
        view = segment.view()
        try:  # one copy of the bytes: the checks and the decode all see the same ones
            data = bytes(view[req.manifest_offset : req.manifest_offset + req.manifest_size])
        finally:
            del view
        manifest = self.manifests.decode(
            data, path=res.path, namespace=res.namespace, segment_size=cap
        )
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
        state = self.state
        with state.lock.held():
            res = session.reservations.pop(req.reservation, None)
            if res is not None:
                state.arena.release(res.segment)
                state.saves_in_flight.end()
        state.lock.notify_all()
        self.pool.refill()


def _full(directory: str, path: str, error: OSError) -> str:
    """The refusal of a save of ``path`` whose segment or record the shared-memory file
    system under ``directory`` has no room (or no will) for."""
    return (
        f"cannot record the save of {path!r} in {directory}: {error.strerror or error}. "
        "The shared-memory file system is fuller than the budget assumes (another process "
        "may have filled it); free it, lower --memory-limit or enlarge it"
    )
