"""Saves: a plan of the object, a reservation in the daemon, one copy into the mapped segment,
a commit. Non-blocking saves run the same steps on one background thread per client.

The order, with the lock of the connection held from the reservation to the commit:

1. ``prepare``: flatten the object and plan its segment (cached by structure; a structure
   the client meets for the first time takes the plan the daemon keeps for it, where one
   checks out: ``find_plan``, :meth:`Saves.stored_plan`);
2. ``reserve``: the daemon names a segment of the planned size (gone or full: the
   write-through fallback, :mod:`ckptcache.client._fallback`);
3. map it (cached, or mapped ahead by the spare thread) and copy the storages in;
4. ``commit``: the daemon takes the bytes; any failure before it is an ``abort``; the
   first save of a structure then tells the daemon where its plan lies (``keep_plan``);
5. ``durability="persisted"``: wait for the persist (:mod:`ckptcache.client._waits`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptcache import errors
from ckptcache._defaults import skip_unchanged
from ckptcache._secure_fs import current_umask
from ckptcache._signals import signals_deferred
from ckptcache._workers import LingeringPool, StoppableThread, join_started
from ckptcache.client._connection import Connection
from ckptcache.client._fallback import WriteThrough
from ckptcache.client._ledger import Ledger
from ckptcache.client._segments import WriteMaps, read_back, write_packed
from ckptcache.client._settings import Settings
from ckptcache.client._spares import SpareMapper
from ckptcache.client._unchanged import Unchanged
from ckptcache.client._waits import Waits
from ckptcache.errors import BudgetExceeded, DaemonUnavailable
from ckptcache.wire import messages as m

# torch and the modules built on it are imported where a save needs them, so that the
# control-plane commands (ckptcache ls, status, ...) start without torch.
if TYPE_CHECKING:
    from ckptcache.client._async import SaveHandle, VersionCheck
    from ckptcache.codec.flatten import Flattened
    from ckptcache.codec.gpu.copy import Ready
    from ckptcache.codec.packing import Packed
    from ckptcache.codec.plan.cache import PlanCache
    from ckptcache.codec.plan.stored import SegmentPlan, StoredPlan
    from ckptcache.codec.shm import Mapping
    from ckptcache.format.manifest import ObjectPlan

__all__ = ["DURABILITY_LEVELS", "Saves", "check_durability"]

log = logging.getLogger(__name__)

#: What ``save`` may wait for before it returns.
#: ``memory``: kept in the daemon's memory only, never persisted (an explicit choice; a
#: path under no storage root is otherwise refused). The others: where the save is when it
#: returns (this node's memory, also a backup node's, also storage); all are persisted.
DURABILITY_LEVELS = ("memory", "local", "backup", "persisted")

#: Saves with a save thread in this process: their pending non-blocking saves are finished
#: at interpreter exit (the thread is a daemon thread, which exit would otherwise stop).
_SAVERS: weakref.WeakSet[Saves] = weakref.WeakSet()


@atexit.register
def _finish_pending_saves() -> None:
    for saves in list(_SAVERS):
        if saves.thread_pid == os.getpid():
            saves.finish()


def check_durability(durability: str) -> None:
    """Raise ``ValueError`` unless ``durability`` is one of :data:`DURABILITY_LEVELS`."""
    if durability not in DURABILITY_LEVELS:
        raise ValueError(
            f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}"
        )


class _Job:
    """One save on its way: what was asked, and how a non-blocking one reports back."""

    def __init__(self, obj: Any, flat: Flattened, plan: ObjectPlan, path: str, durability: str):
        self.obj, self.flat, self.plan, self.path, self.durability = (
            obj, flat, plan, path, durability
        )  # fmt: skip
        self.t0 = time.perf_counter()
        self.check: VersionCheck | None = None
        self.copied: Callable[[], None] | None = None
        self.packed: Packed | None = None
        self.ready: Ready | None = None


class Saves:
    """Runs a client's saves (see the module docstring for the order of a save)."""

    def __init__(
        self,
        settings: Settings,
        connection: Connection,
        maps: WriteMaps,
        spares: SpareMapper,
        fallback: WriteThrough,
        ledger: Ledger,
        waits: Waits,
    ):
        self._settings, self._connection, self._maps = settings, connection, maps
        self._spares, self._fallback, self._ledger, self._waits = spares, fallback, ledger, waits
        self._executor: LingeringPool | None = None
        #: The process whose save thread :attr:`_executor` is.
        self.thread_pid = 0
        self._executor_lock = threading.Lock()
        #: Save plans by structure (made at the first save: it needs torch).
        self._plans: PlanCache | None = None
        #: The structures whose plan was asked of the daemon (once each).
        self._asked: set[str] = set()
        #: Plans the daemon keeps, read before the first save (:meth:`read_ahead`), by
        #: structure digest, each with what was kept with it; checked when a save uses one.
        self._ahead: dict[str, tuple[SegmentPlan, m.KeptPlan]] = {}
        self._ahead_thread: StoppableThread | None = None
        self._ahead_stop = threading.Event()
        #: What this client's segments hold, and which storages were written since.
        self.unchanged = Unchanged(skip_unchanged())

    def save(self, obj: Any, path: str, durability: str, blocking: bool) -> SaveHandle | None:
        """Save ``obj`` under ``path`` (normalized, ``durability`` checked).

        The cyclic garbage collector is held off until the save is committed (for a
        non-blocking save, until it returns): the plan's thousands of short-lived tuples set
        off collections, now and then of the trainer's whole heap, inside the stall. Made and
        gone within the call, they never reach one. Not during ``durability="persisted"``'s
        wait for storage, which may last minutes."""
        from ckptcache.format.gcpause import gc_paused

        with gc_paused():
            handle, wait = self._save(obj, path, durability, blocking)
        if wait:
            self._waits.persisted(path, None, None)
        return handle

    def _save(
        self, obj: Any, path: str, durability: str, blocking: bool
    ) -> tuple[SaveHandle | None, bool]:
        """:meth:`save` up to the commit: its handle, and whether it waits for storage now."""
        from ckptcache.client._async import VersionCheck, submit
        from ckptcache.codec.gpu.copy import record_ready

        t0 = time.perf_counter()
        # No plans read ahead from now on: a save reads the one it needs itself, and reading
        # the others beside it would slow it down (the thread stops after the one in hand).
        self._ahead_stop.set()
        # Only a non-blocking save checks version counters: a blocking one reads none.
        # A blocking save may wait for the connection to ask for the daemon's plan: it takes
        # the connection next anyway (see stored_plan).
        stored = functools.partial(self.stored_plan, wait=blocking)
        flat, plan = self.plan(obj, path, versions=not blocking, stored=stored)
        job = _Job(obj, flat, plan, path, durability)
        job.t0 = t0
        if blocking:
            return None, self._copy_in(job) and durability == "persisted"
        job.check = VersionCheck(obj, path, flat)
        job.flat = job.check.flat  # private copies of the storages no version counter watches
        # The copy runs on the save thread, whose current CUDA stream is not the trainer's.
        # A CPU-only save (decided when it was flattened) makes no CUDA call.
        job.ready = {} if job.flat.on_cpu else record_ready(job.flat.storages)

        def run(copied: Callable[[], None]) -> None:
            job.copied = copied
            self._run(job)

        return submit(run, path, self.background(), owner=self._ledger), False

    def save_packed(self, packed: Packed, path: str, durability: str) -> int:
        """Save the blob ``packed`` lays out, its items copied straight into the segment;
        returns where the blob's bytes start in the archive persisted at ``path``."""
        import torch

        from ckptcache.codec.encode import encode

        t0 = time.perf_counter()
        # Never written nor read: its storage gives the archive the blob's layout.
        placeholder = torch.empty(packed.nbytes, dtype=torch.uint8)
        flat, plan = encode(placeholder, path, self._settings.namespace)
        job = _Job(placeholder, flat, plan, path, durability)
        job.t0, job.packed = t0, packed
        self._run(job)
        return plan.manifest.storages[0].offset - plan.manifest.payload_offset

    def plan(
        self,
        obj: Any,
        path: str,
        *,
        versions: bool = True,
        stored: Callable[[bytes, str], StoredPlan | None] | None = None,
    ) -> tuple[Flattened, ObjectPlan]:
        """``obj`` flattened and its segment planned (:func:`~ckptcache.codec.encode.encode`),
        with this client's save plans by structure (made at the first save: they need torch);
        ``versions``: record the tensors' version counters (a non-blocking save's check);
        ``stored``: where a structure met for the first time may find its plan
        (:meth:`stored_plan`; none for a staging copy, whose name is new every time)."""
        from ckptcache.codec.encode import encode
        from ckptcache.codec.plan.cache import PlanCache

        if self._plans is None:
            self._plans = PlanCache()
        return encode(
            obj, path, self._settings.namespace, plans=self._plans, versions=versions,
            stored=stored,
        )  # fmt: skip

    def stored_plan(self, key: bytes, path: str, *, wait: bool = True) -> StoredPlan | None:
        """The plan the daemon keeps for the structure whose compiled walk's key is ``key``
        (asked once per structure), read from the segment that holds it and checked against
        ``key`` (:mod:`ckptcache.codec.plan.stored`); ``None`` where there is none.

        Asked on the connection the client has made: never an attempt of its own to reach a
        daemon that is gone or hung (the save's ``reserve`` makes that one, as before).
        ``wait=False`` (the caller of a non-blocking save, who must not wait behind a save in
        flight: it holds the connection to its commit): only where the connection is free."""
        lock = self._connection.lock
        if wait:
            # On a first contact the spare thread is making the connection (the reserve
            # would wait for it too).
            self._spares.wait_contact(min(self._settings.timeout, 10.0))
            with lock:
                if self._connection.rpc is None:
                    return None
            # Not under the lock: the spare thread maps the spare meanwhile.
            return self._read_stored(key)
        held = False
        try:
            # A signal's exception right after the acquire (before a try could see it held)
            # would leave the connection's lock held for good.
            with signals_deferred():
                held = lock.acquire(blocking=False)
            if not held:
                return None  # planned afresh, as before
            return None if self._connection.rpc is None else self._read_stored(key)
        finally:
            if held:
                lock.release()

    def _read_stored(self, key: bytes) -> StoredPlan | None:
        from ckptcache.codec.plan.stored import checked, plan_from_segment, structure_digest

        digest = structure_digest(key)
        with self._executor_lock:
            if digest in self._asked:
                return None
            self._asked.add(digest)
            ahead = self._ahead.pop(digest, None)
        if ahead is not None:  # read before this save: only its check is left
            read, kept = ahead
            return checked(read, key, kept.ints, kept.check)
        try:
            request = m.FindPlanRequest(self._settings.namespace, digest)
            kept = self._connection.call("find_plan", request, m.FindPlanReply)
        except errors.CkptCacheError:  # gone meanwhile, an older daemon: plan afresh
            return None
        if not kept.segment:  # none kept, or its path no longer here
            return None
        return plan_from_segment(
            self._maps.seg_path(kept.segment), kept.manifest_offset, kept.manifest_size, key,
            kept.ints, kept.check,
        )  # fmt: skip

    def read_ahead(self) -> None:
        """Read, on a thread of its own, the newest plans the daemon keeps for this user
        (:meth:`stored_plan` then only checks the one a first save's key names): started as a
        trainer's client is made, seconds before its first save. The thread waits for the
        spare thread's contact, reads at most four, and ends; a save never waits for it, and
        stops it after the plan in hand."""
        with self._executor_lock:
            if self._ahead_thread is not None:
                return
            self._ahead_thread = StoppableThread(
                self._read_ahead, "ckptcache-plans-ahead", self._ahead_stop.set
            )
        self._ahead_thread.start()

    def _read_ahead(self) -> None:
        from ckptcache.codec.plan.stored import read_ahead

        if not self._spares.wait_contact(min(self._settings.timeout, 10.0), self._ahead_stop):
            return
        if self._ahead_stop.is_set() or self._connection.rpc is None:
            return  # closing, or no daemon reached: no attempt of our own
        try:
            request = m.ListPlansRequest(self._settings.namespace)
            kept = self._connection.call("list_plans", request, m.ListPlansReply).plans
        except errors.CkptCacheError:  # an older daemon, or gone: the saves ask themselves
            return
        for plan in kept:
            if self._ahead_stop.is_set():
                return
            if not plan.segment:  # its path no longer here
                continue
            try:
                segment = self._maps.seg_path(plan.segment)
                read = read_ahead(segment, plan.manifest_offset, plan.manifest_size)
            except Exception as e:  # reading ahead only saves time: the save asks itself
                log.debug("plan of %s not read ahead: %s", plan.path, e)
                continue
            if read is not None:
                with self._executor_lock:
                    if plan.structure not in self._asked:
                        self._ahead[plan.structure] = (read, plan)

    def keep_plan(self, path: str) -> None:
        """Tell the daemon where the plan made or taken for ``path``'s save lies, now that
        the save is committed (once per structure and client; call under the lock)."""
        keep = self._plans.to_keep(path) if self._plans is not None else None
        if keep is None:
            return
        structure, check, ints = keep
        request = m.KeepPlanRequest(self._settings.namespace, path, structure, check, ints)
        try:
            self._connection.call("keep_plan", request)
        except errors.CkptCacheError:  # an older daemon, or gone: the next job plans afresh
            pass

    def warm_plan(self, obj: Any, path: str) -> None:
        """Plan ``obj``'s structure into this client's save plans, ahead of a save of a state
        of that structure (:mod:`ckptcache.client._plans`); nothing is saved."""
        from ckptcache.codec.plan.cache import PlanCache

        if self._plans is None:
            self._plans = PlanCache()
        self._plans.prepare(
            obj, path, self._settings.namespace, versions=False, stored=self.stored_plan
        )

    def background(self) -> LingeringPool:
        """The one thread that runs this client's non-blocking saves, in submission order.

        It ends a moment after its last save (a thread idling until ``close()`` would outlive
        its work, and frameworks' thread-leak checks fail on it) and is a daemon thread, so
        it never keeps the process from exiting: saves still pending at exit are finished
        first by :func:`_finish_pending_saves`, an ``atexit`` hook."""
        with self._executor_lock:  # not the connection's lock: a save in flight holds that
            if self._executor is None or self.thread_pid != os.getpid():
                self._executor = LingeringPool(1, "ckptcache-save")
                self.thread_pid = os.getpid()
                _SAVERS.add(self)
            return self._executor

    def mapping(self, segment: str, capacity: int) -> Mapping:
        """The shared mapping of a reserved segment (cached; made once, reused by every later
        save), after the spare thread finished mapping it if it is at it now."""
        # The spare thread adds to the cache under this (re-entrant) lock; saves hold it too.
        with self._connection.lock:
            self._maps.drop_stale()
            self._spares.wait_for(segment)
            return self._maps.get(segment, capacity)

    def _run(self, job: _Job) -> None:
        if self._copy_in(job) and job.durability == "persisted":
            # Not Client.wait: on the save thread that would wait for this very save.
            self._waits.persisted(job.path, None, None)

    def _copy_in(self, job: _Job) -> bool:
        """Reserve, copy and commit ``job``; whether the daemon committed it (``False``: it
        was written through instead)."""
        with self._connection.lock:
            try:
                reply = self._reserve(job)
                return reply is not None and self._copy_and_commit(job, reply)
            except BaseException as e:
                if not isinstance(e, Exception):
                    # A signal's (Ctrl-C), anywhere from the reservation to the commit: the
                    # connection ends, and the daemon aborts the reservation with it.
                    self._connection.drop()
                raise

    def reserve_request(self, path: str, nbytes: int, durability: str) -> m.ReserveRequest:
        """The request for a segment of ``nbytes`` to save ``path`` in, for this user."""
        return m.ReserveRequest(
            self._settings.namespace, path, nbytes, durability,
            uid=os.geteuid(), gid=os.getegid(), umask=current_umask(),
            timeout=self._settings.server_wait(),
        )  # fmt: skip

    def _reserve(self, job: _Job) -> m.ReserveReply | None:
        """The daemon's reservation for ``job``; ``None`` when the job was written through."""
        request = self.reserve_request(job.path, job.plan.layout.nbytes, job.durability)
        try:
            return self._connection.call("reserve", request, m.ReserveReply)  # type: ignore[no-any-return]
        except (DaemonUnavailable, BudgetExceeded) as e:
            # The trainer is still held (``copied`` not called): torch.save reads the live
            # object (over the copies ``check`` took), and ``check`` decides before the file
            # replaces the previous one.
            obj = job.obj
            if job.packed is not None:
                obj = job.packed.materialize()
            elif job.check is not None:
                obj = job.check.source(obj)
            self._fallback.write(obj, job.path, e, check=job.check)
            return None

    def _copy_and_commit(self, job: _Job, reply: m.ReserveReply) -> bool:
        """Copy ``job`` into its reserved segment and commit it; ``False`` when the daemon
        went away meanwhile and the job was written through instead."""
        from ckptcache.codec.objectio import write_object
        from ckptcache.codec.plan.walk import release

        released = False
        try:
            mapping = self.mapping(reply.segment, reply.capacity)
            skipping = (
                self.unchanged.begin(reply.segment, reply.content, mapping)
                if job.packed is None and job.flat.on_cpu else None
            )  # fmt: skip
            if job.packed is None:
                runs = None if skipping is None else skipping.runs
                write_object(mapping, job.plan, job.flat, job.ready, runs)
            else:
                write_packed(mapping, job.plan, job.packed)
            if job.check is not None:
                job.check.check()  # torn bytes are never committed: abort below instead
            else:
                release(job.flat.storages)  # copied: what held them may go, off this thread
            if job.copied is not None:
                job.copied()
                released = True
            commit = m.CommitRequest(
                reply.reservation, job.plan.layout.manifest_offset,
                len(job.plan.manifest_bytes), time.perf_counter() - job.t0,
                skipping is not None and skipping.watched,
                () if skipping is None else tuple(skipping.kept),
            )  # fmt: skip
            committed = self._connection.call("commit", commit, m.CommitReply)
            if skipping is not None:
                skipping.committed(committed.content)
            self._ledger.committed(job.path)
            self.keep_plan(job.path)
            # Map the spare the daemon makes for the next new path, once saves pause.
            self._spares.refresh(after_save=True)
            return True
        except DaemonUnavailable as e:
            obj = job.obj
            if released:  # the trainer may have stepped: write what the segment holds
                obj = read_back(mapping, job.plan)
            elif job.packed is not None:
                obj = job.packed.materialize()
            self._fallback.write(obj, job.path, e)
            return False
        except Exception:
            self.abort(reply)
            raise

    def abort(self, reply: m.ReserveReply) -> None:
        """Give a reservation back after a failed copy or commit (best effort: a connection
        that is gone took its reservations with it)."""
        if self._connection.rpc is not None:
            try:
                self._connection.request("abort", m.AbortRequest(reply.reservation))
            except errors.CkptCacheError:
                pass

    def finish(self) -> None:
        """Wait until every non-blocking save of this client has run (their errors stay with
        their handles: a failed save nobody waited on is logged when its handle goes)."""
        from ckptcache.client._async import pending_saves

        for handle in pending_saves(self._ledger):
            handle.wait_done()

    def close(self) -> None:
        """Finish the pending non-blocking saves and end their thread, and the thread that
        reads plans ahead (ended when this returns)."""
        self._ahead_stop.set()
        join_started(self._ahead_thread)  # a forked child's is None (after_fork)
        if self._executor is not None and self.thread_pid == os.getpid():
            self.finish()
            self._executor.stop()
            self._executor.join()
            self._executor = None
        self.unchanged.close()  # after the last save: none is using it

    def after_fork(self) -> None:
        """In a forked child: none of the parent's save thread, nor of its locks (the plan
        cache's may have been held at the fork)."""
        self._executor_lock = threading.Lock()
        self.unchanged.after_fork()
        self._executor, self.thread_pid = None, 0
        self._plans = None
        self._asked, self._ahead = set(), {}
        self._ahead_thread, self._ahead_stop = None, threading.Event()
