"""Mapping the daemon's spare segments ahead of use, so a save into one pays no page faults.

Filling this process's page tables for every page of a never-seen segment costs about as
much as the copy itself. The daemon keeps spares ready for saves of new paths
(:mod:`ckptcache.server.memory.pool`); this maps them in a background thread after each save and on
:meth:`Client.warmup`, so the save that gets one finds its mapping cached like a reused
segment's.

The page tables are made a step at a time (:func:`ckptcache.format.pagetables.populate_in_steps`),
not with ``MAP_POPULATE``, which holds the process's address-space lock for the whole spare:
the trainer's own ``mmap`` and ``munmap`` (a CPU tensor's allocation, its free) would wait
for all of it (``benchmarks/save_load/README.md``). A save that wants a spare still being
mapped stops the steps after the one under way and has its copy threads make the rest, instead
of waiting for this one thread to finish it.

The mapper sees the client through a narrow port (:class:`SparePort`: the lock, a ``pool``
request, where segments are, the cache of mappings), not the client itself.

The thread is a daemon thread (it never keeps a process from exiting) and ends a moment
(:data:`ckptcache._workers.LINGER_SECONDS`) after its work: the daemon's spares mapped, or the
daemon done making them. ``stop()`` on it ends it at once, as thread-leak checks expect:
the loop reads the stop flag before every wait, so a thread stopped right after a save ends
within a mapping step, not after its idle wait; ``Client.close()`` stops and joins it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from ckptcache import errors
from ckptcache._signals import signals_deferred
from ckptcache._workers import LINGER_SECONDS, StoppableThread, join_started

if TYPE_CHECKING:
    from ckptcache.codec.shm import Mapping
    from ckptcache.wire.messages import PoolReply

__all__ = ["SpareMapper", "SparePort"]

log = logging.getLogger(__name__)

#: How long the background thread follows a spare the daemon is still creating.
_FOLLOW_SECONDS = 60.0
#: After a save, the spares are asked for once no save has ended for this long. The files of
#: one checkpoint are saved one after another (DeepSpeed's model and optimizer files, a
#: Megatron rank's shards): a ``pool`` request sent right after a commit would hold the
#: connection (the daemon busy with that commit, the reply waiting for the interpreter lock
#: the trainer holds) while the next file's save waits for it, and its mapping would run
#: beside that save's copy.
_SETTLE_SECONDS = 0.05
#: How long the thread waits for the next save's request before it ends: a moment, so the
#: files of one checkpoint saved one after the other share the thread, and no idle thread of
#: ours outlives its work in the training process.
_IDLE_SECONDS = LINGER_SECONDS


class SparePort(Protocol):
    """What the mapper needs of its client (:class:`ckptcache.client._segments.WriteMaps`)."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The client's (re-entrant) connection lock: saves hold it, ``close`` stops us
        under it."""

    @property
    def pid(self) -> int:
        """The process the client's mappings belong to."""

    def pool(self) -> PoolReply:
        """The daemon's spares (a request)."""

    def seg_path(self, name: str) -> str:
        """The file of segment ``name``."""

    def __contains__(self, name: object) -> bool:
        """Whether the client has mapped segment ``name`` already."""

    def keep(self, name: str, mapping: Mapping, *, populated: bool = True) -> None:
        """Cache ``mapping`` of ``name`` (or close it if one is cached already);
        ``populated``: whether all its page tables were made."""


class _InProgress:
    """A spare being mapped: set once it is (or failed); ``stop`` ends its steps early."""

    def __init__(self) -> None:
        from ckptcache.format.pagetables import Stop

        self.done = threading.Event()
        self.stop = Stop()


class SpareMapper:
    """Maps the spares of ``port``'s daemon into ``port``'s cache of write mappings."""

    def __init__(self, port: SparePort):
        self._port = port
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._thread: StoppableThread | None = None  # cleared as the thread decides to end
        self._last: StoppableThread | None = None  # the thread started last, for join()
        self._again = False
        self._not_before = 0.0  # no ``pool`` request before this (monotonic; see settle)
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._done = threading.Event()
        self._done.set()
        #: Segments being mapped right now: a save that needs one stops the steps and waits
        #: for the one under way, instead of mapping it twice.
        self.mapping_now: dict[str, _InProgress] = {}
        #: Mappings made, not yet moved into the client's cache, each with whether all its
        #: page tables were made (not where a save stopped the steps).
        self.ready: dict[str, tuple[Mapping, bool]] = {}
        #: Whether the spares were asked for already (:meth:`warmup`, or a first contact).
        self.warmed = False
        #: Set once a round has asked the daemon for its spares (or failed to reach it): on
        #: a first contact, the connection this client's requests share is made by then.
        self.contacted = threading.Event()
        #: Whether the spares mapped now are registered for CUDA copies as well.
        self._register = True
        #: Spares mapped in a round that did not register them (a first contact's), each
        #: registered by the next round that does (:meth:`Client.warmup`, after a save).
        self.unregistered: dict[str, Mapping] = {}

    def disown(self) -> None:
        """In a forked child: the parent's thread, locks and mappings are not ours."""
        self._reset()

    def first_contact(self) -> None:
        """What :meth:`Client.warmup` does, started by the first save, load or ``exists`` of a
        client that never called it: a trainer that checks for a checkpoint to resume from,
        or loads one, then finds its first save's segment mapped. (Control-plane calls do not
        start it: a short-lived ``ckptcache ls`` has no use for mapped segments.)"""
        if self.warmed:
            return
        self.warmed = True
        # On the spare thread, which connects by itself: never on the caller's, which a
        # non-blocking save must not hold up behind a save in flight (it holds the lock).
        # Not registered for CUDA in this round: the save that made the contact may be
        # copying into the spare right now, and its copies would wait for the registration;
        # that save registers its mapping once done.
        self.refresh(register=False)

    def refresh(self, *, register: bool = True, after_save: bool = False) -> threading.Event:
        """Map new spares in the background; returns an event set once that is done.
        ``register``: also register them for CUDA copies, where this process uses CUDA
        (:mod:`ckptcache.codec.gpu.pinning`). ``after_save``: a save just ended, so wait
        until none has ended for :data:`_SETTLE_SECONDS` (the next file of the checkpoint
        must not wait for this thread's request on the connection).

        The thread stays a moment after its work (``_IDLE_SECONDS``): a save in that moment
        wakes it with an event instead of starting a thread, whose start waits for the new
        thread to be scheduled (milliseconds on a busy node, on the save's blocking path).

        Under deferred signals: it runs in the trainer's thread after every save, and a
        signal's exception inside an ``Event``'s condition would leave its lock held, and the
        next save waiting for it for ever (``ckptcache._signals``)."""
        with signals_deferred(), self._lock:
            self._stopped.clear()
            self._done.clear()
            self._again = True
            if after_save:
                self._not_before = time.monotonic() + _SETTLE_SECONDS
            self._register = register
            if self._thread is None or not self._thread.is_alive():
                self._thread = StoppableThread(self._run, "ckptcache-spares", self.stop)
                self._last = self._thread
                self._thread.start()
            else:
                self._wake.set()
            return self._done

    def stop(self) -> None:
        """No further requests (the client is closing: a request would reconnect it); the
        thread ends after the mapping in hand. The next :meth:`refresh` starts again."""
        self._stopped.set()
        self._wake.set()
        for work in list(self.mapping_now.values()):
            work.stop.set()  # no need to finish a spare nobody will use

    def join(self, timeout: float | None = None) -> None:
        """Wait until the thread has ended after :meth:`stop` (a few milliseconds: the step
        of a mapping under way). Not under the client's lock, which the thread's round takes."""
        join_started(self._last, timeout)

    def wait_contact(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Wait until a round has asked the daemon for its spares (:attr:`contacted`), for at
        most ``timeout`` seconds; sooner where no round is to come (no thread running) or
        ``stop`` is set. Whether the contact was made."""
        deadline = time.monotonic() + timeout
        while not self.contacted.wait(0.01):
            with self._lock:
                running = self._thread is not None and self._thread.is_alive()
            if not running or time.monotonic() > deadline or (stop is not None and stop.is_set()):
                return self.contacted.is_set()
        return True

    def wait_for(self, segment: str) -> None:
        """If ``segment`` is being mapped now, stop its steps after the one under way and wait
        for that, then cache its mapping (the cache makes the rest of its page tables, on
        the save's copy threads)."""
        work = self.mapping_now.get(segment)
        if work is not None:
            work.stop.set()
            work.done.wait()
        self.adopt(segment)

    def adopt(self, segment: str) -> None:
        """Move a finished mapping into the client's cache (call under the client lock)."""
        made = self.ready.pop(segment, None)
        if made is not None:
            mapping, populated = made
            self._port.keep(segment, mapping, populated=populated)

    def _run(self) -> None:
        idle_over = False  # the last idle wait ran out with nothing asked
        while True:
            with self._lock:
                # The stop flag first, on every pass: a stop() that came during a round, a
                # settle or a wait ends the thread now, not after one more idle wait.
                stopped = self._stopped.is_set()
                work = self._again and not stopped
                if not work and (stopped or idle_over):
                    # Decided under the lock that refresh() takes: a refresh from now on
                    # starts a new thread instead of waking this one.
                    self._thread = None
                    self._done.set()
                    return
                settle = self._not_before - time.monotonic()
                if not work:  # nothing asked since the last round: done until woken
                    self._done.set()
                    self._wake.clear()
            if not work:
                # stop() sets the stop flag before the wake event: a stop the clear above
                # undid was seen by the check above it, and a later one sets the event again.
                idle_over = not self._wake.wait(_IDLE_SECONDS)
                continue
            idle_over = False
            if settle > 0:  # a save ended a moment ago: look again once the time is up
                self._stopped.wait(settle)
                continue
            try:
                self._round()
            except Exception:  # a failed round only costs page faults on a later save
                log.exception("mapping spare segments failed")

    def _round(self) -> None:
        """Map the daemon's spares until it has none in the making (or asked again)."""
        deadline = time.monotonic() + _FOLLOW_SECONDS
        if self._register:
            self._register_earlier()
        while True:
            with self._lock:
                self._again = False
            try:
                with self._port.lock:  # close() stops us under this lock
                    if self._stopped.is_set():
                        return
                    reply = self._port.pool()
            except errors.CkptCacheError as e:
                log.debug("no spare segments to map: %s", e)
                return
            finally:
                self.contacted.set()
            for name, capacity in zip(reply.segments, reply.capacities, strict=True):
                self._map(name, capacity)
            with self._lock:
                again = self._again
            if again:
                continue
            if not reply.growing or time.monotonic() > deadline:
                return
            if self._stopped.wait(0.05):  # the daemon is still making a spare
                return

    def _register_earlier(self) -> None:
        """Register for CUDA copies the spares an earlier round mapped without (where this
        process uses CUDA), those still in the client's cache."""
        from ckptcache.codec.gpu.pinning import reserve_if_cuda

        port = self._port
        for name in list(self.unregistered):
            with port.lock:  # close() iterates the cache under this lock
                mapping = self.unregistered.pop(name, None)
                if mapping is None or name not in port or self._stopped.is_set():
                    continue
                register = reserve_if_cuda(mapping)
            if register is not None:
                register()

    def _map(self, name: str, capacity: int) -> None:
        from ckptcache.codec.shm import map_shared  # torch: only where spares are mapped
        from ckptcache.format.pagetables import POPULATE_IN_PARALLEL, populate_in_steps

        port = self._port
        with port.lock:
            if self._stopped.is_set():  # stopped meanwhile: no further spare is mapped
                return
            if name in port or name in self.mapping_now or name in self.ready:
                return
            work = self.mapping_now[name] = _InProgress()
        mapping: Mapping | None = None
        whole = True
        try:
            # A step at a time (the module docstring), where the kernel can: MAP_POPULATE
            # otherwise, which no save can stop.
            mapping = map_shared(port.seg_path(name), capacity, populate=not POPULATE_IN_PARALLEL)
            if POPULATE_IN_PARALLEL:
                whole = populate_in_steps(mapping, stop=work.stop)
        except (OSError, ValueError) as e:
            # Taken meanwhile, and dropped (OSError) or trimmed below ``capacity`` (ValueError:
            # mmap refuses a length past the end of the file): nothing to warm.
            log.debug("spare %s went away: %s", name, e)
        finally:
            # Whatever happened, the event is set: a save waiting for this spare goes on.
            # Handed over without the client lock: a save holding it may be waiting for this.
            if mapping is not None and os.getpid() == port.pid:
                self.ready[name] = (mapping, whole)
            self.mapping_now.pop(name, None)
            work.done.set()
        from ckptcache.codec.gpu.pinning import reserve_if_cuda

        register = None
        with port.lock:  # close() iterates the cache under this lock
            if self._stopped.is_set():  # closed while we mapped: nobody would unmap it
                stale = self.ready.pop(name, None)
                if stale is not None:
                    stale[0].close()
                return
            self.adopt(name)
            # Registered for DMA here, off the save's path; reserved under the lock, so a
            # close() that unmaps it waits for the registration.
            if mapping is not None and name in port:
                if self._register:
                    register = reserve_if_cuda(mapping)
                else:
                    self.unregistered[name] = mapping
        if register is not None:
            register()
