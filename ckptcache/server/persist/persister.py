"""Phase 2: persist committed generations to storage, in the daemon, at low priority.

States of a generation (``Generation.persist_state``): ``queued -> persisting -> persisted``,
or ``failed``, ``conflict``, ``standby``, ``superseded``, ``dropped``; every change goes through
:class:`~ckptcache.server.persist.states.PersistStates`, whose table lists the allowed ones.

Call order: :meth:`Persister.submit` (a commit, a recovery, a standby taking over) ->
:meth:`Persister.start` (with the cluster's :class:`PersistElection`, or None for a node
alone) -> a worker claims the group's role, copies, and reports the result to the election
(:meth:`PersistElection.persisted`, :meth:`~PersistElection.failed`,
:meth:`~PersistElection.replace_corrupt`); :meth:`Persister.mark_persisted` when another member
of the group wrote identical content.

One persist per path at a time, oldest first, so an older generation can never overwrite a
newer one under the same name. The queue is bounded only by memory: a queued generation is
never evicted until it is persisted, which is what applies backpressure to saves. Only a
delete, a corruption report or a newer save takes one out of the queue (its retirement marks
it dropped or superseded); a worker pins a generation when it takes it and skips retired ones.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from ckptcache._units import format_bytes
from ckptcache.errors import CkptCacheError, CorruptCheckpoint, PathNotAllowed
from ckptcache.format.digest import digest_hex
from ckptcache.format.persisted import WrittenRecord, stream_archive
from ckptcache.server.backoff import Backoff
from ckptcache.server.config import DaemonConfig
from ckptcache.server.persist.incremental import Layouts, PersistedLayout, RecordReuse
from ckptcache.server.persist.lineage import DirectoryRemoved
from ckptcache.server.persist.object_reuse import ObjectReuse
from ckptcache.server.persist.provenance import Provenance, write_provenance
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.persist.safe_write import persist_write
from ckptcache.storage import StorageBackend, backend_for
from ckptcache.storage.base import (
    AlreadyStored,
    NewerObjectExists,
    Sink,
    StorageConflict,
    WriteGuard,
)
from ckptcache.storage.fs import FileBackend, file_version
from ckptcache.storage.s3 import S3Backend
from ckptcache.wire.states import ClaimRole, PersistState, Tier

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation
    from ckptcache.server.memory.retention import Retention
    from ckptcache.server.state import CacheState

__all__ = ["Deposed", "PersistElection", "Persister", "lower_thread_priority"]

log = logging.getLogger(__name__)

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())


def lower_thread_priority(nice: int = 10) -> None:
    """Make the calling thread compete little with training: CPU nice and best-effort I/O 7.

    Linux applies both per thread (``setpriority`` and ``ioprio_set`` on the thread id).
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass
    if _IOPRIO_SET is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ioprio = (2 << 13) | 7  # IOPRIO_CLASS_BE, lowest level
            libc.syscall(_IOPRIO_SET, 1, tid, ioprio)  # IOPRIO_WHO_PROCESS
        except OSError:
            pass


class PersistElection(Protocol):
    """Who writes a redundancy group's content (the cluster's persist election).

    Call order per generation: :meth:`claim`; then after a write :meth:`persisted` (success)
    or :meth:`failed`; :meth:`step_down` when a representative stops without writing
    (superseded, dropped, an internal error); :meth:`replace_corrupt` when the bytes no longer
    match their digests; :meth:`watch` for a standby.
    """

    def claim(self, gen: Generation) -> tuple[ClaimRole, str]:
        """This node's role for ``gen`` and the path to write."""

    def watch(self, gen: Generation) -> None:
        """Watch ``gen``'s group as a standby."""

    def persisted(self, gen: Generation, target: str) -> None:
        """Record the group's persist of ``gen`` at ``target``."""

    def failed(self, gen: Generation) -> None:
        """Step down after giving up on ``gen``."""

    def step_down(self, gen: Generation) -> None:
        """Give up the representative's role for ``gen`` without writing it."""

    def replace_corrupt(self, gen: Generation) -> bool:
        """Fetch a good copy of ``gen`` from the group; returns whether one was found."""

    def newer_saved(self, gen: Generation) -> bool:
        """Whether a newer save of ``gen``'s path was made anywhere in the cluster (False
        when that cannot be known now)."""

    def stored(self, gen: Generation) -> bool:
        """``gen`` reached storage: the cluster knows it as the newest save of its path (if
        it is) before the persist is reported; False when the daemon stops first."""

    def fence(self, gen: Generation, guard: WriteGuard) -> WriteGuard:
        """``guard``, also raising :class:`Deposed` whenever it is consulted (before the
        upload, again right before the object becomes visible) once this node no longer
        holds ``gen``'s writer role."""


class Deposed(CkptCacheError):
    """This node lost the group's writer role while writing (cut off past its lease): the
    write is abandoned before it becomes visible, so it never lands after the successor's."""


class Persister:
    """Worker threads that move committed generations from the arena to storage."""

    def __init__(
        self,
        config: DaemonConfig,
        state: CacheState,
        roots: PersistRoots,
        ensure_digests: Callable[[Generation], list[int]],
        retention: Retention,
        record_digests: Callable[[Generation, list[int]], list[int]] | None = None,
    ):
        self.config = config
        self.state = state
        self.metrics = state.metrics
        self.roots = roots
        self.ensure_digests = ensure_digests
        #: Records digests the persist took itself (the digester's ``record``: a no-op that
        #: returns the recorded ones if the digester was first). None: wait for the digester.
        self.record_digests = record_digests
        self.retention = retention
        self.states = state.persist_states
        self.election: PersistElection | None = None
        cfg = config
        #: Waits between a failed persist's attempts (``persist_backoff``, ``persist_backoff_max``).
        self.retry_backoff = Backoff(cfg.persist_backoff, cfg.persist_backoff_max)
        self.options = cfg.storage_options()
        self.queue: collections.deque[Generation] = collections.deque()
        self._path_locks: dict[tuple[str, str], threading.Lock] = {}
        #: Stamps this daemon wrote per path (the last few): its own older writes, which a
        #: newer generation replaces whatever base it recorded.
        self._written: dict[tuple[str, str], collections.deque[int]] = {}
        #: The records of the file this daemon persisted last at each local path, which the
        #: next persist of the path copies unchanged records from (``incremental_persist``).
        self.layouts = Layouts()
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name=f"persist-{i}", daemon=True)
            for i in range(cfg.persist_workers)
        ]

    def start(self, election: PersistElection | None = None) -> None:
        """Start the workers (after the index has been recovered); ``election`` decides who
        writes each group's content (None: this node writes everything it holds)."""
        self.election = election
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop taking new work; a persist in flight finishes or is redone after restart."""
        with self.state.lock.held():
            self._stop = True
        self.state.lock.notify_all()

    def submit(self, gen: Generation) -> None:
        """Queue a generation that needs persisting (takes the state lock, re-entrant)."""
        with self.state.lock.held():
            self.states.advance(gen, PersistState.QUEUED)
            self.queue.append(gen)
            self.metrics.persist_queue.set(len(self.queue))
        self.state.lock.notify_all()

    def _next(self) -> Generation | None:
        state = self.state
        with state.lock.held():
            while not self._stop:
                while self.queue:
                    gen = self.queue.popleft()
                    self.metrics.persist_queue.set(len(self.queue))
                    # A generation retired while queued was marked dropped by its
                    # retirement; its segment may hold another object by now.
                    if gen.persist_state == PersistState.QUEUED and not gen.removed:
                        state.pin_locked(gen)
                        self.states.advance(gen, PersistState.PERSISTING)
                        return gen
                state.lock.wait(1.0)
        return None

    def _run(self) -> None:
        lower_thread_priority()
        while True:
            gen = self._next()
            if gen is None:
                return
            try:
                # Background work: after the saves in flight (the next files of a
                # checkpoint), whose copies and requests it would slow (server/quiet.py).
                self.state.saves_in_flight.wait_after(gen.committed)
                lock = self._path_locks.setdefault(gen.key, threading.Lock())
                with lock:
                    self._persist(gen)
            except Exception:  # a bug: never kill the worker
                log.exception("persist worker failed on %s", gen.path)
                with self.state.lock.held():
                    # A verdict reached before the bug (persisted, superseded, ...) stands.
                    if gen.persist_state in (PersistState.PERSISTING, PersistState.STANDBY):
                        self.states.advance(gen, PersistState.FAILED, error="internal error")
                self._step_down(gen)
            finally:
                self.state.unpin(gen)

    def _persist(self, gen: Generation) -> None:
        cfg = self.config
        cluster = self.election
        target = gen.path
        if cluster is not None:
            try:
                role, target = cluster.claim(gen)
            except CkptCacheError as e:  # coordinator down: try again later
                log.warning("cannot claim %s: %s", gen.path, e)
                role = ClaimRole.RETRY
            if role == ClaimRole.DONE:
                self.mark_persisted(gen)
                return
            if role == ClaimRole.STANDBY:
                with self.state.lock.held():
                    self.states.advance(gen, PersistState.STANDBY)
                cluster.watch(gen)
                return
            if role == ClaimRole.RETRY:
                self._retry_claim(gen)
                return
        backend = backend_for(target, self.options)
        if cluster is not None and self._on_storage(gen, backend, target):
            log.info("%s generation %d is on storage already (an earlier representative wrote "
                     "it): not written again", gen.path, gen.number)  # fmt: skip
            if target == gen.path and not cluster.stored(gen):
                return  # stopping: not reported; the next start finds the object
            self.mark_persisted(gen)
            cluster.persisted(gen, target)
            return
        t0 = time.perf_counter()
        error = ""
        for attempt in range(cfg.persist_retries + 1):
            with self.state.lock.held():
                newest = self.state.index.newest(gen.key)
                if newest is not None and newest.number > gen.number and newest.needs_persist:
                    self.states.advance(gen, PersistState.SUPERSEDED)
                if gen.removed and gen.persist_state == PersistState.PERSISTING:
                    self.states.advance(
                        gen, PersistState.DROPPED, needs_persist=False,
                        error="removed from memory before it was persisted",
                    )  # fmt: skip
                stop = gen.persist_state in (PersistState.SUPERSEDED, PersistState.DROPPED)
            if stop:  # superseded (also by a write-through), deleted or dropped
                self.state.lock.notify_all()
                self._step_down(gen)
                return
            try:
                guard = self._guard(gen, backend, target)
                if cluster is not None:
                    guard = cluster.fence(gen, guard)
                written: list[WrittenRecord] | None = self._copy(gen, backend, target, guard)
            except AlreadyStored as e:  # an attempt whose reply was lost wrote it: done
                log.info("%s generation %d is on storage already: not written again (%s)",
                         gen.path, gen.number, e)  # fmt: skip
                written = None  # what it holds, record by record, is not known here
            except Deposed as e:  # the group's record, or a new election, decides now
                log.warning("abandoned the persist of %s generation %d: %s",
                            gen.path, gen.number, e)  # fmt: skip
                self._retry_claim(gen)
                return
            except (DirectoryRemoved, NewerObjectExists) as e:
                self._give_up_stale(gen, e)
                return
            except StorageConflict as e:
                self._conflict(gen, e)
                return
            except CorruptCheckpoint as e:
                self._corrupt(gen, e)
                return
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
                self.metrics.persist_errors.inc()
                log.warning(
                    "persist of %s generation %d failed (attempt %d of %d): %s",
                    gen.path, gen.number, attempt + 1, cfg.persist_retries + 1, error,
                )  # fmt: skip
                with self.state.lock.held():
                    gen.persist_error = error
                if isinstance(e, PathNotAllowed):
                    break  # the tree under the root is not as allowed: retrying cannot help
                if attempt < cfg.persist_retries:
                    time.sleep(self.retry_backoff.delay(attempt))
                continue
            # The object is complete on storage: reported once its newest-save record is in
            # (every node loads it from then on); the group's persisted record follows
            # (retried in the background through an etcd outage).
            gen.stored = self._stored_identity(backend, target)
            if self._incremental(gen, backend, target):
                placed = not isinstance(backend, FileBackend)
                self.layouts.put(gen.key, PersistedLayout.of(
                    gen.stored, written, placed=placed
                ) if gen.stored and written is not None else None)  # fmt: skip
            if cluster is not None and target == gen.path and not cluster.stored(gen):
                return  # stopping: not reported; the next start finds the object
            self._done(gen, time.perf_counter() - t0)
            if cluster is not None:
                cluster.persisted(gen, target)
            return
        with self.state.lock.held():
            self.states.advance(gen, PersistState.FAILED, error=(
                f"gave up after {attempt + 1} attempts: {error}. The checkpoint "
                "stays in memory; fix the storage and save again"
            ))  # fmt: skip
        self.state.lock.notify_all()
        log.error("persist of %s generation %d failed for good: %s", gen.path, gen.number, error)
        if cluster is not None:
            cluster.failed(gen)

    @staticmethod
    def _on_storage(gen: Generation, backend: StorageBackend, target: str) -> bool:
        """Whether ``target`` holds ``gen`` already
        (:meth:`~ckptcache.storage.base.StoredVersion.holds`). A representative whose write
        landed while the coordinator refused it (its fence trusts the lease's remaining time)
        could not record the persist; the standby that takes the role once that lease lapses
        finds the object here instead of writing it a second time. One ``stat`` or ``HEAD``;
        unreachable storage: not known here, and the write's own guard finds it
        (:class:`~ckptcache.storage.base.AlreadyStored`)."""
        try:
            current = backend.version(target)
        except OSError:
            return False
        return current is not None and current.holds(gen.committed_ns)

    @staticmethod
    def _stored_identity(backend: StorageBackend, target: str) -> str:
        """The identity of the object just written (a ``stat``, an S3 HEAD; "" unknown): a
        load compares it with storage's to find the object replaced by another writer."""
        try:
            if isinstance(backend, FileBackend):
                version = file_version(target, inspect=False)
            else:
                version = backend.version(target)
        except (OSError, ValueError):
            return ""
        return "" if version is None else version.identity

    def _retry_claim(self, gen: Generation) -> None:
        """Claim ``gen`` again in a second."""
        retry = threading.Timer(1.0, self._resubmit, args=(gen,))
        retry.daemon = True  # a stop must not wait for it: the queue is not persisted
        retry.start()  # anyway, the next start recovers the generation and claims again

    def _step_down(self, gen: Generation) -> None:
        if self.election is not None:
            try:
                self.election.step_down(gen)
            except CkptCacheError as e:  # the keys go with the lease
                log.warning("could not step down for %s: %s", gen.path, e)

    def _give_up_stale(self, gen: Generation, why: OSError, *, peer_saved: bool = False) -> None:
        """Never write: the user removed the directory, or storage holds a newer object
        (``peer_saved``: a newer save of the path made on another node)."""
        state = (
            PersistState.DROPPED if isinstance(why, DirectoryRemoved) else PersistState.SUPERSEDED
        )
        log.warning("not persisting %s generation %d (%s): %s", gen.path, gen.number, state, why)
        with self.state.lock.held():
            if isinstance(why, DirectoryRemoved) and not gen.removed:
                # Durable before it is reported or acted on: a crash now must not bring
                # the deleted checkpoint back.
                write_provenance(gen.segment, Provenance(gen.base, gen.anchor, dropped=True))
            self.states.advance(gen, state, needs_persist=False, error=str(why))
            if isinstance(why, DirectoryRemoved):
                gen.orphaned = True  # evictable now, dropped by the next sweep
            else:  # storage holds the newest save: serving this copy would be stale
                self.retention.retire_older_than_locked(
                    gen.key, gen.committed_ns + 1, remember=not peer_saved
                )
        self.state.lock.notify_all()
        if self.election is not None:
            self.election.failed(gen)

    def _conflict(self, gen: Generation, why: StorageConflict) -> None:
        """Another ckptcache writer replaced the object after this save: neither is
        overwritten, the generation stays in memory and ``wait()`` raises. On a cluster whose
        newest save of the path is newer than this one, that save's object is the newer
        one: this generation is superseded and its memory freed, not held as a conflict."""
        if self.election is not None and self.election.newer_saved(gen):
            self._give_up_stale(gen, NewerObjectExists(
                f"{gen.path} holds a newer save of the path, made on another node"
            ), peer_saved=True)  # fmt: skip
            return
        log.error("not persisting %s generation %d: %s", gen.path, gen.number, why)
        with self.state.lock.held():
            self.states.advance(gen, PersistState.CONFLICT, error=str(why))
        self.state.lock.notify_all()
        if self.election is not None:
            self.election.failed(gen)

    def _guard(self, gen: Generation, backend: StorageBackend, target: str) -> WriteGuard:
        """What ``gen`` may replace on storage (see :class:`WriteGuard`); an object-store
        save takes its base now, on the first attempt (one HEAD)."""
        if target != gen.path:  # a group's sidecar for disagreeing content: stamps decide
            return WriteGuard(gen.committed_ns)
        if gen.observe_base:
            version = backend.version(target)
            if version is not None and version.holds(gen.committed_ns):
                # Another holder wrote it (the check before the write could not tell): taken
                # as a base, the object would be replaced by itself under a later stamp.
                raise AlreadyStored(f"{target} holds this generation already")
            with self.state.lock.held():
                gen.base, gen.observe_base = ("" if version is None else version.identity), False
                if version is not None and version.stamp_ns >= gen.committed_ns:
                    gen.committed_ns = version.stamp_ns + 1  # after what it replaces
                    header = gen.segment.read_header()
                    gen.segment.write_header(replace(header, committed_ns=gen.committed_ns))
                write_provenance(gen.segment, Provenance(gen.base, gen.anchor))
        with self.state.lock.held():
            return self.guard_locked(gen)

    def guard_locked(self, gen: Generation) -> WriteGuard:
        """What ``gen`` may replace on storage, from what it recorded (under the lock)."""
        gens = self.state.index.generations(gen.key)
        own = {g.committed_ns for g in gens if g.number < gen.number}
        newer = {g.committed_ns for g in gens if g.number > gen.number}
        own.update(self._written.get(gen.key, ()))
        return WriteGuard(gen.committed_ns, gen.base, frozenset(own), frozenset(newer),
                          gen.seen_ns)  # fmt: skip

    def _incremental(self, gen: Generation, backend: StorageBackend, target: str) -> bool:
        """Whether ``gen``'s persist may copy records from the file persisted before it:
        on (``incremental_persist``), a local file or an S3 object, at the generation's own
        path."""
        return (
            self.config.incremental_persist
            and target == gen.path
            and isinstance(backend, FileBackend | S3Backend)
        )

    def _copy(
        self, gen: Generation, backend: StorageBackend, target: str, guard: WriteGuard
    ) -> list[WrittenRecord]:
        """Stream the archive to storage, checking every tensor against its recorded digest
        and writing real zip CRC-32s and the digest record (see :mod:`ckptcache.format.persisted`)
        in the same pass; a mismatch raises :class:`CorruptCheckpoint` and nothing becomes
        visible under ``target``.

        A persist that starts before the digester has recorded the digests (right after the
        commit) does not wait for that pass: the stream hashes every record anyway. Once the
        records are written, and before the file is synced or named, the stream's digests are
        compared with the digester's if it finished meanwhile, or else recorded as the
        generation's: either way what is written is what the recorded digests describe.

        Records the previous persisted file of the path holds unchanged are copied from it
        where that is proven and the copy pays (:mod:`ckptcache.server.persist.incremental`);
        the digests are then needed first (taken then if the digester has not yet). Returns
        the records written."""
        base = gen.manifest.payload_offset
        layout = self.layouts.get(gen.key) if self._incremental(gen, backend, target) else None
        digests = gen.digests if self.record_digests is not None else self.ensure_digests(gen)
        expected = self._expected(gen, digests) if digests is not None else None
        found: dict[int, int] = {}
        written: list[WrittenRecord] = []
        view = gen.segment.view()
        payload = view[base : base + gen.size]
        reuse: RecordReuse | ObjectReuse | None = None
        if layout is not None and isinstance(backend, S3Backend):
            # Ranges are chosen by digest before the upload starts: taken now if not yet.
            expected = self._expected(gen, self.ensure_digests(gen))
            reuse = ObjectReuse(layout, expected, payload, gen.path,
                                part_size=self.config.s3_part_size)  # fmt: skip
        elif layout is not None:
            reuse = RecordReuse(layout, expected or {}, payload, gen.path)
            if expected is not None and not reuse.candidates():
                reuse = None

        def produce(sink: Sink) -> None:
            written.clear()
            stream_archive(payload, sink, path=gen.path, expected=expected, offsets=found,
                           written=written)  # fmt: skip
            if expected is None:
                self._settle_digests(gen, found)

        def produce_gapped(sink: Sink, skip: Callable[[int], None]) -> None:
            assert reuse is not None
            want = expected
            if want is None:  # what to copy is chosen by digest: taken now, once a copy pays
                want = reuse.expected = self._expected(gen, self.ensure_digests(gen))
            written.clear()
            stream_archive(payload, sink, path=gen.path, expected=want, offsets=found,
                           written=written, reuse=reuse.plan, skip=skip)  # fmt: skip

        try:
            persist_write(
                self.roots, backend, target, produce, gen.saver, guard=guard, anchor=gen.anchor,
                reuse=reuse, produce_gapped=produce_gapped if reuse is not None else None,
            )  # fmt: skip
        finally:
            if reuse is not None:
                reuse.view = memoryview(b"")
            payload.release()
            del view
        if isinstance(reuse, ObjectReuse) and reuse.token:
            self.metrics.persist_bytes_reused.inc(reuse.copied)
            log.debug("%s generation %d: %s copied from the previous object", gen.path,
                      gen.number, format_bytes(reuse.copied))  # fmt: skip
        elif isinstance(reuse, RecordReuse) and (reuse.copied or reuse.rewritten):
            self.metrics.persist_bytes_reused.inc(reuse.copied)
            log.debug("%s generation %d: %s copied from the previous file, %s of it written "
                      "from memory instead", gen.path, gen.number, format_bytes(reuse.copied),
                      format_bytes(reuse.rewritten))  # fmt: skip
        return written

    @staticmethod
    def _expected(gen: Generation, digests: list[int]) -> dict[int, tuple[int, str]]:
        """Recorded digests by record data offset in the payload, with the tensor's name."""
        base = gen.manifest.payload_offset
        expected = {
            record.offset - base: (digest, record.name)
            for record, digest in zip(gen.manifest.storages, digests, strict=True)
        }
        skeleton = gen.segment.read_header().skeleton_digest
        if skeleton:
            expected[gen.manifest.pickle_offset - base] = (skeleton, "<skeleton>")
        return expected

    def _settle_digests(self, gen: Generation, found: dict[int, int]) -> None:
        """Record the digests the stream took (by payload offset) as ``gen``'s, or, if the
        digester recorded its own meanwhile, check the stream's against them: a tensor whose
        bytes changed between the two passes raises :class:`CorruptCheckpoint`."""
        assert self.record_digests is not None
        base = gen.manifest.payload_offset
        mine = [found[record.offset - base] for record in gen.manifest.storages]
        recorded = self.record_digests(gen, mine)
        expected = self._expected(gen, recorded)
        for offset, (want, name) in expected.items():
            got = found.get(offset)
            if got is not None and got != want:
                raise CorruptCheckpoint(
                    f"checkpoint {gen.path!r} is corrupt in the local tier: tensor {name!r} "
                    f"changed while it was persisted (digest {digest_hex(got)}, recorded "
                    f"{digest_hex(want)}); it was not persisted",
                    tensor=name,
                    tier="local",
                )

    def _corrupt(self, gen: Generation, error: CorruptCheckpoint) -> None:
        """The bytes to persist no longer match their digests: never persist or serve them;
        in a cluster, step down and fetch the group's good copy from a peer."""
        self.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
        log.error("not persisting %s generation %d: %s", gen.path, gen.number, error)
        with self.state.lock.held():
            gen.corrupt = f"{error}. Save it again"
            self.states.advance(gen, PersistState.FAILED, error=gen.corrupt)
        self.state.lock.notify_all()
        if self.election is not None:
            self.election.replace_corrupt(gen)

    def _resubmit(self, gen: Generation) -> None:
        with self.state.lock.held():
            if gen.persist_state == PersistState.PERSISTING and not gen.removed:
                self.submit(gen)

    def mark_persisted(self, gen: Generation) -> None:
        """Another member of the redundancy group persisted identical content."""
        # Routine, one a save: DEBUG, as each persist in _done.
        log.debug("%s generation %d was persisted by its group", gen.path, gen.number)
        self._done(gen, 0.0, wrote=False)

    def _done(self, gen: Generation, seconds: float, *, wrote: bool = True) -> None:
        metrics = self.metrics
        if wrote:
            metrics.persist_bytes.inc(gen.size)
            metrics.persist_latency.observe(seconds)
        with self.state.lock.held():
            if wrote:  # storage holds this stamp now: newer generations may replace it
                written = self._written.setdefault(gen.key, collections.deque(maxlen=8))
                written.append(gen.committed_ns)
            self.states.advance(gen, PersistState.PERSISTED, persisted=True, error="")
            gen.persist_seconds = seconds
            if not gen.removed or gen.retired:  # a freed segment may hold another object now
                header = gen.segment.read_header()
                gen.segment.write_header(replace(header, persisted=1))
            self.retention.apply_locked(gen.key)
        self.state.lock.notify_all()
        if wrote:  # routine, one a save: DEBUG (INFO is for what an operator acts on; a
            # quick-start daemon logged one line a save into the user's terminal)
            log.debug(
                "persisted %s generation %d: %s in %.2fs (%.0f MB/s)",
                gen.path, gen.number, format_bytes(gen.size), seconds, gen.size / seconds / 1e6,
            )  # fmt: skip
