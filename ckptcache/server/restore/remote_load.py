"""Remote load as plan, then execute.

:func:`plan` decides, from one read of the coordinator (the path's ``holders/`` and the live
membership view), where the bytes come from: a peer holding a copy or relaying one as it
arrives (newest first, so joiners chain), or storage. :func:`execute` moves them. A failure in
execute (a dead peer, a corrupt copy, a lost election) re-plans, at most ``MAX_PLANS`` times
and within the caller's deadline.

Nothing sleeps on a fixed period between a load request and its bytes. A loader that lost the
storage-read election waits for the coordinator to change (:meth:`Coordinator.wait_change`:
woken at once by the embedded coordinator; an exponential backoff with full jitter, capped at
``BACKOFF_CAP`` seconds, on etcd, whose JSON gateway cannot hold a watch per waiter), and the
reader announces itself in flight as soon as its first range is requested, so waiters chain
behind it instead of waiting for the whole object.

A node alone in the cluster skips the election and the in-flight announcement: there is no one
to share the read with or to relay to (a node that joins mid-read finds no holder and reads
storage itself, as it would have without this node).

**The load is answered before the bookkeeping** (:class:`Settling`). Once the copy is verified
and committed here, the trainer has what it asked for; what is left tells the others about it:
announce the holding, leave the in-flight key, step down from the election: three coordinator
requests, slow on a loaded machine while the same daemon relays
(``benchmarks/cluster/README.md``). They run after the answer, in that order, on a thread of
their own. Why that is safe:

* *No acknowledged checkpoint is lost.* A remote load acknowledges no save, and the answer comes
  only after ``receive`` has checked every byte against its digests and committed the copy:
  the same copy, in the same state, as before. What the bookkeeping changes is only when
  others learn of it.
* *Storage is written once.* A copy read from storage or fetched is committed as stored or as
  another node's content (never queued for a persist here), and holder records play no part
  in the persist election (``writer/`` keys): deferring them moves no writer role.
* *A joiner never reads a half-written copy.* What a joiner is sent is decided by this node's
  data plane, not by the coordinator: a copy still arriving is relayed only up to its landed
  prefix and verified downstream, a committed one is sent whole. The order of the records is
  kept: the holding is announced before the in-flight key goes (a joiner always finds this
  node under one of them), and the election is released last (a member that wins it next
  finds the holding and fetches instead of reading storage again).
* *A deposed reader cannot make others wait forever.* The in-flight key and the election are
  released in a ``finally`` on the bookkeeping thread, whatever the announcement did; if the
  daemon dies first, or loses the coordinator, they end with its lease, as before; and every
  waiter's wait is bounded by its own deadline. A later remote load of the same path on this
  node waits for the earlier one's bookkeeping first, so the two never release each other's
  keys. A copy retired while it was being announced is withdrawn again (the withdrawal may
  have run before the announcement).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptcache.errors import (
    CheckpointNotFound,
    CkptCacheError,
    CorruptCheckpoint,
    NewestUnavailable,
)
from ckptcache.server.backoff import Backoff
from ckptcache.server.cluster.coord import NodeInfo, keys
from ckptcache.server.cluster.coord.counting import CountingCoordinator
from ckptcache.server.cluster.coord.records import LatestRecord, LoaderRecord, parse_one
from ckptcache.server.cluster.membership import Membership, path_hash
from ckptcache.server.metrics import Metrics
from ckptcache.server.restore.fetching import Fetching, PeerBusy
from ckptcache.server.restore.storage_read import StorageReader
from ckptcache.server.state import CacheState, NewerHeld

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation

__all__ = [
    "BACKOFF_CAP",
    "MAX_PLANS",
    "Plan",
    "Settling",
    "Sources",
    "execute",
    "load_remote",
    "plan",
]

log = logging.getLogger(__name__)

MAX_PLANS = 64  # re-plans after failed executions (waits for a reader are not failures)
MAX_ABSENT = 4  # "not here" answers after which a node's holder entry counts as stale
BACKOFF_BASE = 0.004  # first wait for a reader to start (seconds, before jitter)
BACKOFF_CAP = 0.1  # longest wait between two looks at the coordinator
#: Waiting for another member's storage read: full jitter, so the waiters look apart.
BACKOFF = Backoff(BACKOFF_BASE, BACKOFF_CAP, jitter=True)
#: How long a holder that answered "busy" is passed over for the others (seconds): long
#: enough for the peer it is sending to to announce itself in flight.
BUSY_FOR = 0.5


@dataclass(frozen=True)
class Plan:
    """Where this load's bytes come from.

    ``source``: ``"local"`` (another request of this daemon landed it), ``"peer"`` (``node``
    holds it or relays it while it arrives), ``"busy"`` (every holder is sending it to others
    already: wait for one of those to announce itself in flight), ``"storage"`` (read it,
    after winning the group's election unless ``alone``), or ``"none"`` (no peer holds it and
    storage does not have it).
    """

    source: str
    node: NodeInfo | None = None
    alone: bool = False


class Settling:
    """A remote load's bookkeeping, run after the load is answered (see the module's
    docstring for why that is safe): announce the copy, then close what the load held open
    (the in-flight key, then the election), on a thread per path.

    Call order: :meth:`wait` (before a remote load of the path plans) ->
    :meth:`start` (once its copy is committed here; it hands over what the load held open).
    """

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self._lock = threading.Lock()
        self._pending: dict[str, threading.Thread] = {}

    def wait(self, ph: str, timeout: float) -> None:
        """Until the bookkeeping of an earlier load of the path ``ph`` here has ended (or
        ``timeout`` seconds): a new load must not release keys the earlier one still holds,
        nor have its own released by it."""
        with self._lock:
            thread = self._pending.get(ph)
        if thread is not None:
            thread.join(max(0.0, timeout))

    def start(self, ph: str, gen: Generation, held: contextlib.ExitStack) -> None:
        """Announce ``gen`` in the background, then close ``held`` (last in, first out)."""
        thread = threading.Thread(target=self._settle, args=(ph, gen, held),
                                  name="remote-load-settle", daemon=True)  # fmt: skip
        with self._lock:
            self._pending[ph] = thread
        thread.start()

    def _settle(self, ph: str, gen: Generation, held: contextlib.ExitStack) -> None:
        try:
            with held:  # closed whatever the announcement does: nobody waits on a dead key
                self.membership.announce(gen)
                if gen.removed:  # retired meanwhile: its withdrawal may have come first
                    self.membership.withdraw_held(gen)
        except (CkptCacheError, OSError) as e:  # the copy is served; peers read storage
            log.warning("could not announce %s: %s", gen.path, e)
        finally:
            with self._lock:
                if self._pending.get(ph) is threading.current_thread():
                    del self._pending[ph]


@dataclass(frozen=True)
class Sources:
    """What a remote load draws on: this node's state, the membership (holders, elections,
    in-flight announcements), peer fetches and the group's storage read, and the bookkeeping
    that follows a load's answer."""

    state: CacheState
    membership: Membership
    fetching: Fetching
    storage: StorageReader
    metrics: Metrics
    settling: Settling


@dataclass
class _Load:
    """State of one remote load across its plans."""

    namespace: str
    path: str
    ph: str
    deadline: float
    tried: set[str] = field(default_factory=set)
    in_storage: bool | None = None  # asked once per load (a storage request, not the coordinator)
    waits: int = 0
    failures: int = 0
    #: "Not here" answers per node: a holder entry can outlive its copy (retired meanwhile).
    absent: dict[str, int] = field(default_factory=dict)
    #: When each holder last answered "busy" (monotonic): passed over for :data:`BUSY_FOR`.
    busy: dict[str, float] = field(default_factory=dict)
    #: The last corrupt copy a peer sent: what the load reports if no other tier has it.
    corrupt: CorruptCheckpoint | None = None
    #: The stamp of the cluster's newest save of the path: no older copy will do (0: any).
    newer_than: int = 0
    #: The node that made that save (``None``: not read yet; empty: unknown).
    maker: str | None = None

    def missing(self, what: str) -> CkptCacheError:
        """The error of a load that found no sound copy: the corrupt one it met, if any
        ("not found" would hide that a copy exists and is damaged), else not found; when
        a newer save than an older copy is known, :class:`NewestUnavailable` (the client must
        not read the older stored file in its place)."""
        if self.corrupt is not None:
            e = self.corrupt
            return CorruptCheckpoint(f"{e}; {what}", tensor=e.tensor, tier=e.tier)
        if self.newer_than:
            return NewestUnavailable(
                f"the newest save of {self.path!r} (stamped {self.newer_than} ns, made on "
                f"another node) {what}; an older copy exists and is not returned in its place"
            )
        return CheckpointNotFound(f"{self.path!r} {what}")

    def fits(self, gen: Generation | None) -> Generation | None:
        """``gen`` if it is a copy of the newest save (or any, without a floor)."""
        return gen if gen is not None and gen.committed_ns >= self.newer_than else None


def plan(src: Sources, load: _Load) -> Plan:
    """Choose the source of ``load`` from one read of the path's holders."""
    local = _held_here(src, load)
    if local is not None:
        return Plan("local")
    holders = _untried_holders(src, load) or _maker(src, load)
    if holders:
        now = time.monotonic()
        free = [n for n in holders if load.busy.get(n.node_id, 0.0) <= now - BUSY_FOR]
        return Plan("peer", free[0]) if free else Plan("busy")
    if load.in_storage is None:
        load.in_storage = src.storage.in_storage(load.path, load.newer_than)
    if not load.in_storage:
        return Plan("none")
    me = src.membership.node.node_id
    alone = all(n.node_id == me for n in src.membership.live_nodes())
    return Plan("storage", alone=alone)


def _untried_holders(src: Sources, load: _Load) -> list[NodeInfo]:
    """The other nodes holding a copy ``load`` may take (of the newest save, when it asks for
    that) that it has not tried yet. Planning and the storage reader's last look ask the same
    question: a holder only one of them counted (an older copy) made the reader step back for
    a peer that the plan never asks, until the deadline."""
    me = src.membership.node.node_id
    return [n for n in src.membership.holders(load.namespace, load.path, load.newer_than)
            if n.node_id != me and n.node_id not in load.tried]  # fmt: skip


def _maker(src: Sources, load: _Load) -> list[NodeInfo]:
    """The node that made the newest save, live and not tried yet, where no holder of it is
    announced: a save's newest-save record is put at its commit, its holding a moment later
    (behind the backup push of the save before), and a load in between must not take the
    missing announcement for a missing copy. One coordinator read per load."""
    if not load.newer_than:
        return []
    if load.maker is None:
        key = keys.latest_key(load.ph)
        record = parse_one(LatestRecord, key, src.membership.coord.get(key))
        fits = record is not None and record.committed_ns >= load.newer_than
        load.maker = record.node if record is not None and fits else ""
    if load.maker in ("", src.membership.node.node_id) or load.maker in load.tried:
        return []
    # A member without a data plane (no --listen) saves and records, but serves no copy.
    return [n for n in src.membership.live_nodes() if n.node_id == load.maker and n.data_addr]


def execute(src: Sources, load: _Load, chosen: Plan) -> Generation | None:
    """Move the bytes as ``chosen`` says; None when the plan must be made again."""
    if chosen.source == "local":
        return _held_here(src, load)
    if chosen.source == "peer":
        assert chosen.node is not None
        return _from_peer(src, load, chosen.node)
    if chosen.source == "busy":
        _wait(src, load)
        return None
    if chosen.source == "storage":
        return _from_storage(src, load, chosen.alone)
    raise load.missing("is in no peer's memory and could not be read from storage")


def load_remote(
    src: Sources, namespace: str, path: str, timeout: float, newer_than: int = 0
) -> Generation:
    """Plan, execute, re-plan on failure (bounded); logs the coordinator round trips.
    ``newer_than``: only a copy of a save stamped at least that (ns) will do."""
    load = _Load(namespace, path, path_hash(namespace, path), time.monotonic() + timeout,
                 newer_than=newer_than)  # fmt: skip
    src.settling.wait(load.ph, timeout)
    with _tally(src) as counts:
        chosen = Plan("none")
        try:
            while time.monotonic() < load.deadline and load.failures <= MAX_PLANS:
                chosen = plan(src, load)
                try:
                    gen = execute(src, load, chosen)
                except NewerHeld:  # a save here committed while the copy arrived: it wins
                    gen = _held_here(src, load)
                if gen is not None and load.fits(gen) is None:
                    # An older save than the newest (a holder's record ran ahead of its
                    # copy, a stored file not yet replaced): try the others.
                    log.warning("%s: the %s copy is older than the newest save; not served",
                                path, chosen.source)  # fmt: skip
                    load.tried.add(chosen.node.node_id if chosen.node else chosen.source)
                    load.failures += 1
                    if chosen.source == "storage":
                        load.in_storage = False
                    continue
                if gen is not None:
                    return gen
        finally:
            log.info("remote load of %s: %s, %d coordinator round trips", path,
                     chosen.source, sum(counts.values()))  # fmt: skip
    raise load.missing("is in no peer's memory and could not be read from storage in time")


# ---------------------------------------------------------------------------- execution


def _held_here(src: Sources, load: _Load) -> Generation | None:
    """The copy another request of this daemon brought in meanwhile, if any (a copy of the
    newest save, when the load asks for that)."""
    return load.fits(src.state.find(load.namespace, load.path))


def _from_peer(src: Sources, load: _Load, node: NodeInfo) -> Generation | None:
    try:
        with contextlib.ExitStack() as held:
            announce = held.enter_context(src.membership.in_flight(load.ph))
            gen = src.fetching.fetch_from(node, load.namespace, load.path, announce)
            # Answered now; announced before the in-flight key goes (always findable).
            src.settling.start(load.ph, gen, held.pop_all())
        return gen
    except CheckpointNotFound:
        # Between a copy's arrival and its commit a node answers "not here" for a moment;
        # an entry that keeps answering it is stale (its copy was retired), and planning it
        # again would spin until the deadline instead of trying others or storage.
        load.absent[node.node_id] = load.absent.get(node.node_id, 0) + 1
        if load.absent[node.node_id] < MAX_ABSENT:
            _wait(src, load)
            return None
        log.warning("%s announces %s but does not hold it: not asking it again", node.node_id,
                    load.path)  # fmt: skip
    except PeerBusy:
        # Sending it to others already: one of them relays it soon (not a failure).
        load.busy[node.node_id] = time.monotonic()
        _wait(src, load)
        return None
    except NewerHeld:
        raise
    except CorruptCheckpoint as e:
        log.error("corrupt copy of %s on %s: %s", load.path, node.node_id, e)  # reported to it
        src.metrics.corrupt.labels(tier="peer").inc()
        load.corrupt = e
    except (OSError, CkptCacheError) as e:
        log.warning("fetch of %s from %s failed: %s", load.path, node.node_id, e)
    load.tried.add(node.node_id)
    load.failures += 1
    return None


def _from_storage(src: Sources, load: _Load, alone: bool) -> Generation | None:
    if alone:
        gen = src.storage.load(load.namespace, load.path, lambda: None)
        src.membership.announce(gen)
        return gen
    key = keys.load_key(load.ph)
    if not src.membership.coord.elect(key, LoaderRecord(src.membership.node.node_id).to_dict()):
        _wait(src, load)  # another member reads storage for the group
        return None
    with contextlib.ExitStack() as held:
        held.callback(src.membership.release, key)  # closed last: the election
        if _untried_holders(src, load):
            return None  # the previous reader finished (and stepped down) while we planned
        announce = held.enter_context(src.membership.in_flight(load.ph))
        gen = src.storage.load(load.namespace, load.path, announce, relayed=True)
        # Answered now; announced before stepping down (joiners find a holder), then the
        # in-flight key goes, then the election (see the module's docstring).
        src.settling.start(load.ph, gen, held.pop_all())
        return gen


def _wait(src: Sources, load: _Load) -> None:
    """Until the coordinator may have changed: full-jitter exponential backoff, capped."""
    delay = BACKOFF.delay(load.waits)
    load.waits += 1
    remaining = load.deadline - time.monotonic()
    src.membership.coord.wait_change(min(remaining, delay))


@contextlib.contextmanager
def _tally(src: Sources) -> Iterator[dict[str, int]]:
    coord = src.membership.coord
    if isinstance(coord, CountingCoordinator):
        with coord.tally() as counts:
            yield counts
    else:
        yield {}
