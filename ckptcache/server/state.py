"""The state owner: arena + index + pins + objects in flight, behind the daemon's one lock.

Every other part of the daemon reads or changes this state through :class:`CacheState`; none
of them sees its condition variable, only the narrow port ``state.lock``
(:class:`~ckptcache.server.lock.Locked`). A part that must change several things at once
holds ``state.lock.held()`` (re-entrant) and calls the ``*_locked`` methods inside; waits go
through ``lock.wait`` / ``lock.wait_for``, wake-ups through ``lock.notify_all``.

Life of a segment as this owner sees it::

    arena.create/take_free (reserved) -> index.add (committed) -> pin/unpin (loads, workers)
    -> retire_locked (out of the index; freed now, or when the last pin goes)
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Protocol

from ckptcache.errors import (
    BudgetExceeded,
    CheckpointNotFound,
    CkptCacheError,
    CorruptCheckpoint,
    InvalidPath,
)
from ckptcache.format.layout import HEADER_SIZE, SegmentState
from ckptcache.server import ownership
from ckptcache.server.config import DaemonConfig
from ckptcache.server.lock import Locked, StateLock
from ckptcache.server.memory import sealing
from ckptcache.server.memory.arena import Arena, Segment
from ckptcache.server.memory.index import Generation, Index, Key
from ckptcache.server.memory.superseded import SupersededSaves
from ckptcache.server.metrics import Metrics
from ckptcache.server.ownership import Saver
from ckptcache.server.persist.states import PersistStates
from ckptcache.server.quiet import SavesInFlight
from ckptcache.wire.states import PersistState, Tier

__all__ = [
    "CacheState",
    "Fill",
    "Incoming",
    "Inflight",
    "Landing",
    "NewerHeld",
    "Reservation",
    "Session",
    "bounded",
    "check_key",
]

log = logging.getLogger(__name__)

#: Longest wait for the relays of a failed copy to stop once hung up (seconds).
RELAY_STOP = 30.0


class NewerHeld(CkptCacheError):
    """A copy arriving from a peer or storage is older than a generation of the same path
    committed here meanwhile: it is not published (the newer one stays the newest).
    ``digests``: the copy's verified digest table, to tell whether the newer one holds the
    same content anyway."""

    def __init__(self, message: str, digests: list[int] | None = None):
        super().__init__(message)
        self.digests = digests


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
    #: The digests, by offset, of the storages the handed segment was checked to hold
    #: (``Segment.handed_digests``): what a storage the client kept there must still hash to.
    kept: dict[int, int] = field(default_factory=dict)
    #: A copy's flight: relays still sending from its segment pin the generation it becomes
    #: (:meth:`CacheState.hold_for_relays_locked`).
    relayed: Inflight | None = None
    #: Deepest ancestor directory that existed at save time (see ckptcache.server.persist.lineage).
    anchor: str = ""
    #: The object on storage when the save was made: its identity ("" none, None not known)
    #: and its stamp (ns; 0 none).
    base: str | None = None
    base_stamp: int = 0
    #: The stamp of the cluster's newest save of the path when this one began (-1: a copy,
    #: or no cluster), once ``seen`` (its read, begun at the reservation) is done.
    seen_ns: int = -1
    seen: Future[int] | None = None
    #: A copy from a peer or storage: the node it came from ("storage" for a storage read).
    origin: str = ""
    #: The copy's bytes are those stored at the path: committed as persisted, never written.
    stored: bool = False
    #: When the copy's content was saved (wall clock, s; 0: unknown). A copy older than a
    #: generation this node committed meanwhile is refused at commit (newest wins).
    saved_at: float = 0.0
    #: The same, the origin's exact stamp (ns; 0: unknown): the copy's commit stamp.
    saved_ns: int = 0


class Sending(Protocol):
    """A connection sending bytes of a segment (a data-plane channel): hung up through its
    socket."""

    sock: socket.socket


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
    #: When the content was saved (see :attr:`Reservation.saved_at`; 0: unknown).
    saved_at: float = 0.0
    saved_ns: int = 0
    #: Where each *lane* of the body starts (offsets from the end of the header, the first
    #: 0): the ranges that land side by side, each from its start on (the stripes of a striped
    #: transfer; one lane for bytes that land in order). A striped relay follows each lane on
    #: its own instead of the prefix, which waits for the slowest.
    lanes: tuple[int, ...] = (0,)
    #: How far each lane has landed (body offsets): ``[lanes[i], landed[i])`` is final.
    landed: list[int] = field(default_factory=lambda: [0])
    #: The connections relaying it from its segment now (see :meth:`CacheState.relaying`).
    senders: set[Sending] = field(default_factory=set)
    #: The generation it was committed as, pinned while relays still send from its segment.
    held: Generation | None = None
    #: The generation it was committed as (``None`` until then): a relay that starts sending
    #: after the commit pins it as it joins.
    committed: Generation | None = None

    @property
    def body(self) -> int:
        """Bytes after the header: what a relay sends."""
        return self.nbytes - HEADER_SIZE

    def lane_end(self, index: int) -> int:
        """Where lane ``index`` ends (body offset)."""
        return self.lanes[index + 1] if index + 1 < len(self.lanes) else self.body

    def landed_from(self, pos: int) -> int:
        """The end of the final run of bytes that starts at body offset ``pos`` (``pos``
        itself: nothing there yet)."""
        prefix = self.ready - HEADER_SIZE
        if pos < prefix:
            return prefix
        index = bisect.bisect_right(self.lanes, pos) - 1
        return max(pos, self.landed[index]) if index >= 0 else pos


class Landing:
    """What a copy's ``fill`` reports as its bytes land in an :class:`Inflight`: called with
    ``n``, the first ``n`` bytes of the body are final (a prefix); :meth:`lanes` and
    :meth:`lane` say the same of ranges that land side by side, so relays follow each."""

    def __init__(self, state: CacheState, flight: Inflight):
        self._state, self._flight = state, flight

    def __call__(self, n: int) -> None:
        self._state.advance(self._flight, HEADER_SIZE + n)

    def lanes(self, starts: Sequence[int]) -> None:
        """The body lands in lanes starting at ``starts`` (before any of it has landed)."""
        self._state.set_lanes(self._flight, starts)

    def lane(self, index: int, end: int) -> None:
        """Lane ``index`` has landed up to body offset ``end``."""
        self._state.land_lane(self._flight, index, end)


#: ``fill(view, advance)``: writes a copy's bytes (those after the segment header) into
#: ``view``, calling ``advance(n)`` whenever the first ``n`` bytes of ``view`` are final (a
#: :class:`Landing` in the daemon, which also takes ranges that land side by side).
Fill = Callable[[memoryview, Callable[[int], None]], None]


@dataclass(frozen=True)
class Incoming:
    """A copy arriving from a peer or from storage: what
    :meth:`ckptcache.server.ingest.Ingest.receive` takes into this node's memory."""

    namespace: str
    path: str
    #: The segment's size, and where its manifest lies in it.
    nbytes: int
    manifest_offset: int
    manifest_size: int
    #: Writes the bytes. Until the commit, peers asking for the same path are relayed them
    #: as they land (see :attr:`CacheState.inflight`), so a broadcast is pipelined hop by hop.
    fill: Fill
    #: The node it comes from ("storage" for a storage read).
    origin: str
    _: KW_ONLY
    #: Verify every digest against the table that came with the bytes (else compute the
    #: table: a copy read from storage).
    verify: bool = True
    #: The bytes are those stored at the path: committed as persisted, never written.
    persisted: bool = False
    #: The digests ``fill`` verified already, once it is done (the table is not read).
    digests: Callable[[], list[int]] | None = None
    #: The origin's commit time of a backup copy: refused if the path was deleted here since
    #: (checked before and after the transfer).
    saved_at: float | None = None
    #: When the sender says a fetched copy's content was saved (0: unknown). The copy keeps
    #: the origin's time as its commit time (what "newest wins" compares on storage and in
    #: memory), else the time its read began (an upper bound).
    content_time: float = 0.0
    #: The origin's exact stamp (0: unknown), which the copy keeps: a stamp that came through
    #: a float would be a few ns off, and no longer name the same save.
    content_ns: int = 0
    #: Who saved it on the origin; a root daemon holds and persists the copy as that user
    #: (else as itself: unknown saver).
    saver: Saver | None = None


@dataclass(eq=False)
class Session:
    """What one client connection holds; all of it is let go when the connection closes."""

    id: int
    pid: int
    uid: int
    reservations: dict[int, Reservation] = field(default_factory=dict)
    leases: dict[int, Generation] = field(default_factory=dict)
    gid: int = -1
    #: Segments this connection's client maps for writing (as far as the daemon can tell:
    #: the spares it was told about and the segments it reserved). A reserve hands these out
    #: first: any other segment costs the client a first mapping inside its save.
    mapped: set[str] = field(default_factory=set)
    #: The content tokens its commits were given (``Segment.content``): a segment holding
    #: one holds bytes this client knows, and a save into it copies only what changed.
    tokens: set[int] = field(default_factory=set)

    def note_mapped(self, names: Iterable[str], live: Collection[str]) -> None:
        """Record segments the client maps; forgets names no longer in ``live`` (the arena's
        segments) once the set outgrows it, so a long session holds no stale names."""
        self.mapped.update(names)
        if len(self.mapped) > 2 * len(live) + 64:
            self.mapped = {n for n in self.mapped if n in live}

    def note_token(self, token: int, live: Collection[Segment]) -> None:
        """Record a token a commit gave; forgets those no segment of ``live`` holds once the
        set outgrows them."""
        self.tokens.add(token)
        if len(self.tokens) > 2 * len(live) + 64:
            held = {s.content for s in live}
            self.tokens = {t for t in self.tokens if t in held}


def bounded(wait: float, client_timeout: float | None) -> float:
    """A daemon-side wait, never longer than the client waits for the reply: a client that
    gives up drops its connection (and with it everything the connection held)."""
    return wait if client_timeout is None else max(0.0, min(wait, client_timeout))


def check_key(namespace: str, path: str) -> None:
    """Refuse a malformed (namespace, path) with :class:`InvalidPath`."""
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise InvalidPath(f"invalid checkpoint path {path!r}: give a non-empty path string")
    if not isinstance(namespace, str) or not namespace or len(namespace) > 256:
        raise InvalidPath(f"invalid namespace {namespace!r}: give a non-empty string")


class CacheState:
    """Owner of the arena, the index, pins, objects in flight and the one lock.

    Methods ending in ``_locked`` expect the caller to hold ``lock.held()``; the others take
    the lock themselves.
    """

    def __init__(self, config: DaemonConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        others = set(config.allowed_uids) - {0, os.geteuid()}
        self.arena = Arena(config.segments_dir, config.memory_limit, 0o711 if others else 0o700)
        metrics.memory_shared.set_function(lambda: self.arena.sharing.shared)
        if others:  # their segments are their files: sealed, or the daemon could be killed
            sealing.check_sealing(config.segments_dir)
        self.index = Index()
        #: The only way a generation's ``persist_state`` changes (see its module).
        self.persist_states = PersistStates(metrics)
        #: The one lock, as a narrow port (see server/lock.py): the condition stays private.
        self.lock: Locked = StateLock()
        self.started = time.time()
        #: Objects arriving right now, by (namespace, path): relayed to peers as they land.
        self.inflight: dict[Key, Inflight] = {}
        #: Reservations open now: background work waits for saves to pause (server/quiet.py).
        self.saves_in_flight = SavesInFlight()
        #: The stamp (ns) of the newest save of each path known when it was last deleted
        #: here: backup copies of saves stamped no later are refused, so a delete is not
        #: undone by a copy in transit (``Retention.delete``).
        self.deleted: dict[Key, int] = {}
        #: The last save of each path that storage superseded after it left memory: what
        #: ``status`` and ``wait`` say of the path until a newer save (server/memory/superseded.py).
        self.superseded = SupersededSaves()
        #: Called (under the lock) with each generation leaving the index.
        self.on_retire: list[Callable[[Generation], None]] = []
        #: Called (under the lock) with each generation whose segment is freed, before it is.
        self.on_free: list[Callable[[Generation], None]] = []
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """A fresh id for a session, reservation or lease."""
        return next(self._ids)

    # ----------------------------------------------------------------- pins and retirement

    def pin_locked(self, gen: Generation) -> None:
        """Keep ``gen``'s segment alive; :class:`CheckpointNotFound` once ``gen`` has left the
        index and its segment was freed (it may already hold another object). A generation
        retired while pinned keeps its segment until the last pin goes: the holder of a pin
        (a persist in flight) may take another.

        A generation whose pages lie in a newer one's segment is made whole first: nothing
        reads a hole (:mod:`ckptcache.server.memory.sharing`). :class:`BudgetExceeded` when
        there is no room for its pages, :class:`CorruptCheckpoint` when they changed there."""
        if gen.removed and not gen.retired:
            raise self.not_found(gen.namespace, gen.path, gen.number)
        self._whole_locked(gen)
        gen.pins += 1

    def pin(self, gen: Generation) -> None:
        """As :meth:`pin_locked` (takes the lock)."""
        with self.lock.held():
            self.pin_locked(gen)

    def unpin_locked(self, gen: Generation) -> None:
        """Drop a pin; frees a retired generation's segment with its last pin."""
        gen.pins -= 1
        if gen.pins == 0:
            if gen.retired:
                gen.retired = False
                self._free_locked(gen)
            # Either way the generation may now be freed or evicted: a reserve waiting for
            # room looks again at once rather than at its next periodic check.
            self.lock.notify_all()

    def unpin(self, gen: Generation) -> None:
        """Drop a pin taken with :meth:`pin` (takes the lock)."""
        with self.lock.held():
            self.unpin_locked(gen)

    def pin_if_current(self, gen: Generation) -> bool:
        """Pin ``gen`` if it is still in the index; returns whether it was pinned."""
        with self.lock.held():
            if gen.removed or self.index.get(gen.key, gen.number) is not gen:
                return False
            self._whole_locked(gen)  # raises: the caller says why it cannot read it
            if gen.removed:  # retired while another reader's copy back ran (lock released)
                return False
            gen.pins += 1
            return True

    def make_whole(self, gen: Generation) -> None:
        """What :meth:`pin_locked` does for a generation whose pages lie in a newer save's
        segment, with the copy and the hash outside the lock (a load of an older checkpoint
        must not hold up every save for them); a pin after it finds little or nothing left."""
        sharing = self.arena.sharing
        with self.lock.held():
            segment = gen.segment
            self._wait_for_copy_back_locked(segment)
            if not segment.runs or gen.removed:
                return
            what = f"{gen.path!r} generation {gen.number}"
            with self._no_room_as_not_found(gen):
                runs = sharing.begin_whole(segment, what)
            gen.pins += 1  # neither freed nor punched again meanwhile
        changed: str | None = None
        try:
            with self._no_room_as_not_found(gen):
                changed = sharing.copy_whole(
                    segment, runs, self._storages(gen), gen.digests or [], what
                )
        finally:
            with self.lock.held():
                try:
                    changed = sharing.end_whole(segment, runs, changed)
                finally:
                    self.unpin_locked(gen)
                if changed:
                    self._refuse_locked(gen, changed, what)

    def _wait_for_copy_back_locked(self, segment: Segment) -> None:
        """Until no copy back of ``segment``'s pages runs outside the lock (the wait releases
        it): two at once could each write pages the other has checked."""
        while segment.copying and segment.runs:
            self.lock.wait(0.1)

    @staticmethod
    def _storages(gen: Generation) -> list[tuple[int, int]]:
        return [(r.offset, r.nbytes) for r in gen.manifest.storages]

    @contextlib.contextmanager
    def _no_room_as_not_found(self, gen: Generation) -> Iterator[None]:
        """No room to make ``gen`` whole: :class:`CheckpointNotFound` for a generation
        storage holds (a load reads it there), else :class:`BudgetExceeded` as it is."""
        try:
            yield
        except BudgetExceeded as e:
            if not gen.persisted:
                raise
            raise CheckpointNotFound(f"{e}; it is read from storage") from e

    def drop_corrupt_locked(self, gen: Generation, detail: str) -> None:
        """Bad bytes were found in ``gen`` here: it is never served again and leaves memory
        (its segment stays while it is pinned)."""
        gen.corrupt = gen.corrupt or detail
        self.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
        log.error("dropping %r generation %d: %s", gen.path, gen.number, detail)
        if not gen.removed:
            self.retire_locked(gen)  # its header freed before its runs' record goes
            self.update_gauges()

    def _refuse_locked(self, gen: Generation, changed: str, what: str) -> None:
        self.drop_corrupt_locked(gen, f"{changed} (read back from a newer save's memory)")
        raise CorruptCheckpoint(f"{what} is corrupt: {gen.corrupt}", tier=Tier.LOCAL)

    def _whole_locked(self, gen: Generation) -> None:
        """Copy back the pages of ``gen`` that lie in a newer save's segment, checked against
        its digests (``sharing.py``). Pages changed there: the generation is dropped from
        memory (its header freed before its runs' record goes: a restart never serves those
        bytes) and :class:`CorruptCheckpoint` raised. No room: see
        :meth:`_no_room_as_not_found`."""
        segment = gen.segment
        if not segment.runs:
            return
        self._wait_for_copy_back_locked(segment)
        if gen.removed and not gen.retired:
            raise self.not_found(gen.namespace, gen.path, gen.number)
        self.check_not_corrupt(gen)
        if not segment.runs:
            return
        what = f"{gen.path!r} generation {gen.number}"
        with self._no_room_as_not_found(gen):
            changed = self.arena.sharing.whole(
                segment, self._storages(gen), gen.digests or [], what
            )
        if changed:
            self._refuse_locked(gen, changed, what)

    def is_current(self, gen: Generation) -> bool:
        """Whether ``gen`` is still in the index (not retired meanwhile)."""
        with self.lock.held():
            return self.index.get(gen.key, gen.number) is gen

    def retire_locked(self, gen: Generation) -> None:
        """Take ``gen`` out of the index for good; its segment is freed now or with its last
        pin.

        A generation still waiting for its persist is dropped from the queue (its segment is
        about to be reused: persisting it later would write another object's bytes), and a
        pinned segment's header says FREE at once, so a daemon restarted before the last pin
        goes does not bring a deleted or corrupt generation back.
        """
        self.index.remove(gen)
        gen.removed = True
        if gen.persist_state in (PersistState.QUEUED, PersistState.STANDBY):
            self.persist_states.advance(
                gen, PersistState.DROPPED, needs_persist=False, error=gen.persist_error or (
                    "removed from memory (deleted, found corrupt or evicted) before it was "
                    "persisted"
                ),
            )  # fmt: skip
        for hook in self.on_retire:
            hook(gen)
        if gen.pins:
            gen.retired = True
            header = gen.segment.read_header()
            gen.segment.write_header(replace(header, state=SegmentState.FREE))
        else:
            self._free_locked(gen)
        self.lock.notify_all()

    def _free_locked(self, gen: Generation) -> None:
        for hook in self.on_free:
            hook(gen)
        self.arena.release(gen.segment)

    def remember_superseded_locked(self, key: Key, retired: list[Generation]) -> None:
        """Keep the newest of ``retired`` (saves of ``key`` that storage superseded, just out
        of memory) as what ``status`` says of the path, unless this node committed a newer
        generation of it (still held, or persisted and gone since)."""
        if not retired:
            return
        newest = max(retired, key=lambda g: g.number)
        if self.index.newest(key) is None and self.index.next_number(key) == newest.number + 1:
            self.superseded.remember(newest)

    # ----------------------------------------------------------------- lookups

    def lookup_locked(self, namespace: str, path: str, number: int | None = None) -> Generation:
        """The newest (or ``number``) generation, or :class:`CheckpointNotFound`."""
        check_key(namespace, path)
        key = (namespace, path)
        gen = self.index.newest(key) if number is None else self.index.get(key, number)
        if gen is None:
            raise self.not_found(namespace, path, number)
        return gen

    def visible(self, session: Session, gen: Generation, load: bool) -> bool:
        """Whether ``session`` may see (or, with ``load``, map) ``gen``."""
        check = ownership.may_load if load else ownership.may_see
        return check(self, session, gen)

    def lookup_visible_locked(
        self,
        namespace: str,
        path: str,
        number: int | None,
        session: Session | None,
        *,
        load: bool = False,
    ) -> Generation:
        """As :meth:`lookup_locked`; a generation ``session`` may not see (or load) counts
        as absent for it."""
        gen = self.lookup_locked(namespace, path, number)
        if session is not None and not self.visible(session, gen, load):
            raise self.not_found(namespace, path, number)
        return gen

    def not_found(self, namespace: str, path: str, number: int | None) -> CheckpointNotFound:
        """The error for a generation this node does not hold."""
        what = "is" if number is None else f"generation {number} is"
        return CheckpointNotFound(
            f"{path!r} {what} not in the memory of node {self.config.node_id!r} "
            f"(namespace {namespace!r}); load it from storage or check the path"
        )

    def find(self, namespace: str, path: str) -> Generation | None:
        """The newest generation of a path, or None (takes the lock)."""
        with self.lock.held():
            try:
                return self.lookup_locked(namespace, path)
            except (CheckpointNotFound, InvalidPath):
                return None

    def check_not_corrupt(self, gen: Generation) -> None:
        """Refuse to serve a generation whose bytes were found corrupt."""
        if gen.corrupt:
            raise CorruptCheckpoint(
                f"{gen.path!r} generation {gen.number} in the memory of node "
                f"{self.config.node_id!r} is corrupt and is not served: {gen.corrupt}",
                tier=Tier.LOCAL,
            )

    def lookup_pinned(self, namespace: str, path: str) -> Generation:
        """The newest sound generation of a path, pinned for the caller (who unpins it)."""
        with self.lock.held():
            gen = self.lookup_locked(namespace, path)
            self.check_not_corrupt(gen)
            self.pin_locked(gen)
            return gen

    def flight_or_pinned(self, key: Key) -> Inflight | Generation:
        """What a peer asking for ``key`` is served: the copy still arriving here, or the
        newest sound generation, pinned (the caller unpins it)."""
        with self.lock.held():
            flight = self.inflight.get(key)
            if flight is not None:
                return flight
            return self.lookup_pinned(*key)

    def generations(self) -> list[Generation]:
        """A snapshot of every generation in the index."""
        with self.lock.held():
            return list(self.index)

    # ----------------------------------------------------------------- objects in flight

    def wait_ready(self, flight: Inflight, sent: int) -> int:
        """Wait until ``flight`` has more than ``sent`` bytes final; returns how many are.
        Raises :class:`ConnectionError` when the copy being received failed."""
        with self.lock.held():
            while flight.ready <= sent and not flight.failed:
                self.lock.wait(1.0)
            if flight.failed:
                raise ConnectionError("the upstream copy failed mid-transfer")
            return flight.ready

    def wait_landed(self, flight: Inflight, pos: int) -> int:
        """Wait until the bytes of ``flight`` from body offset ``pos`` on have begun to land;
        returns the end of the final run from ``pos`` (see :meth:`Inflight.landed_from`).
        Raises :class:`ConnectionError` when the copy being received failed."""
        with self.lock.held():
            while flight.landed_from(pos) <= pos and not flight.failed:
                self.lock.wait(1.0)
            if flight.failed:
                raise ConnectionError("the upstream copy failed mid-transfer")
            return flight.landed_from(pos)

    def advance(self, flight: Inflight, ready: int) -> None:
        """Bytes ``[0, ready)`` of ``flight`` are final: relays may send them."""
        with self.lock.held():
            flight.ready = max(flight.ready, ready)
            done = flight.ready - HEADER_SIZE
            for i, lo in enumerate(flight.lanes):  # each lane's share of the prefix
                flight.landed[i] = max(flight.landed[i], min(flight.lane_end(i), max(lo, done)))
            self.lock.notify_all()

    def set_lanes(self, flight: Inflight, starts: Sequence[int]) -> None:
        """``flight``'s body lands in lanes starting at ``starts`` (see
        :attr:`Inflight.lanes`); what landed before stays final as a prefix."""
        with self.lock.held():
            done = flight.ready - HEADER_SIZE
            flight.lanes = tuple(starts)
            flight.landed = [max(lo, min(flight.lane_end(i), done))
                             for i, lo in enumerate(flight.lanes)]  # fmt: skip
            self.lock.notify_all()

    def land_lane(self, flight: Inflight, index: int, end: int) -> None:
        """Lane ``index`` of ``flight`` is final up to body offset ``end``; the prefix
        follows the lanes that are whole."""
        with self.lock.held():
            flight.landed[index] = max(flight.landed[index], min(end, flight.lane_end(index)))
            prefix = 0
            for i in range(len(flight.lanes)):
                prefix = flight.landed[i]
                if prefix < flight.lane_end(i):
                    break
            flight.ready = max(flight.ready, HEADER_SIZE + prefix)
            self.lock.notify_all()

    def landing(self, flight: Inflight) -> Landing:
        """How a copy's ``fill`` reports the bytes of ``flight`` that landed."""
        return Landing(self, flight)

    @contextlib.contextmanager
    def relaying(self, flight: Inflight, channel: Sending) -> Iterator[None]:
        """``channel`` (a data-plane connection) sends bytes of ``flight``'s segment for the
        block: a failure of the copy hangs it up and waits until it has stopped, so that no
        relay reads the segment once its reservation is given back. Raises
        :class:`ConnectionError` when the copy has failed already."""
        with self.lock.held():
            if flight.failed:
                raise ConnectionError("the upstream copy failed mid-transfer")
            if flight.held is None and flight.committed is not None:
                # Committed before this relay joined (or after the others left): nothing
                # holds the segment for it yet.
                try:
                    self.pin_locked(flight.committed)
                except CkptCacheError as e:
                    raise ConnectionError(f"the copy is no longer held here: {e}") from e
                if flight.held is None and not flight.failed:
                    flight.held = flight.committed
                else:  # another relay pinned it while this pin waited (the lock released)
                    self.unpin_locked(flight.committed)
                    if flight.failed:
                        raise ConnectionError("the upstream copy failed mid-transfer")
            flight.senders.add(channel)
        try:
            yield
        finally:
            with self.lock.held():
                flight.senders.discard(channel)
                if not flight.senders and flight.held is not None:
                    held, flight.held = flight.held, None
                    self.unpin_locked(held)  # frees it now if it was retired meanwhile
                self.lock.notify_all()

    def hold_for_relays_locked(self, flight: Inflight, gen: Generation) -> None:
        """``flight`` is committed as ``gen``: the relays still sending from its segment keep
        it (a pin, dropped with the last of them), so eviction or a delete cannot give the
        segment to another save while they read it (and those that join later, see
        :meth:`relaying`)."""
        flight.committed = gen
        if flight.senders and flight.held is None:
            self.pin_locked(gen)
            flight.held = gen

    def end_flight(self, key: Key, flight: Inflight, *, failed: bool = False) -> None:
        """``flight`` is over (committed, or ``failed``): later fetches use the index. A
        failed one returns once no relay sends from its segment (the caller gives it back)."""
        with self.lock.held():
            flight.failed = flight.failed or failed
            if self.inflight.get(key) is flight:
                del self.inflight[key]
            self.lock.notify_all()
            if failed:
                self.stop_relays_locked(flight)

    def stop_relays_locked(self, flight: Inflight) -> None:
        """Fail ``flight`` and return once no relay sends from its segment (which the caller
        gives back): each is hung up (the wait releases the lock)."""
        flight.failed = True
        self.lock.notify_all()
        for channel in list(flight.senders):  # a send blocked on a slow peer ends now
            with contextlib.suppress(OSError):
                channel.sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + RELAY_STOP
        while flight.senders and time.monotonic() < deadline:
            self.lock.wait(0.1)
        if flight.senders:  # never expected: a hung-up socket fails its send at once
            log.error("%d relay(s) of a failed copy still sending after %.0f s",
                      len(flight.senders), RELAY_STOP)  # fmt: skip

    # ----------------------------------------------------------------- gauges

    def update_gauges(self) -> None:
        """Publish the arena's size to the metrics."""
        self.metrics.segments.set(len(self.arena.segments))
        self.metrics.memory_used.set(self.arena.used)
