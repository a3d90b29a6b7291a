"""One truth across nodes: the newest save of each path, whichever node made it.

Every node may save a path (a job's rank 0 comes back on another node after a failure and
saves ``last.pt`` again), and every node may hold an older copy (a backup copy, a load's copy,
its own earlier save). Which one is the newest is one answer for the whole cluster: the
durable coordinator record ``latest/<path>`` (:class:`LatestRecord`), which only ever moves
forward (:meth:`Coordinator.advance`, a compare-and-swap on etcd).

Call order per save (the saves' hooks)::

    seen = truth.seen(namespace, path)   # reserve: the newest save's stamp (1 coordinator read)
    ... the stamp is made later than ``seen`` (a hybrid logical clock) ...
    truth.publish(gen)                   # commit, before the save returns (1 read, 1 put)

and per load of the newest generation::

    record = truth.newest(namespace, path)   # 1 coordinator read; a copy older is not served

Two saves *race* when neither saw the other at its reserve (``seen``): saves made on other
nodes at the same time with different content. Only then do contents of one path conflict
(:mod:`ckptcache.server.cluster.election`); a save made after every earlier one completed is the
newest, whatever its node held before, and storage gets it.

While the coordinator is unreachable a save still commits (a checkpoint error never stops
training): its record is put once the coordinator answers, and until then other nodes do not
know it (say so in Guarantees). Its persist is not reported until the record is in
(:meth:`Truth.stored`): ``persisted`` always means every node's load returns it. A load that
cannot read the record raises :class:`CoordinatorUnavailable` unless the client opted in to
possibly-stale bytes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ckptcache.format.manifest import object_digest
from ckptcache.server.backoff import Backoff
from ckptcache.server.cluster.coord import CoordinatorUnavailable, keys
from ckptcache.server.cluster.coord.records import HolderRecord, LatestRecord, parse_all, parse_one
from ckptcache.server.cluster.membership import Membership, path_hash

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation

__all__ = ["UNSEEN", "Truth", "races"]

log = logging.getLogger(__name__)

#: ``seen`` of a generation that is not a save of this node (a copy), or was made by a
#: version that did not record it: it races with nothing.
UNSEEN = -1

#: Putting a save's record while the coordinator is unreachable: tried again at this pace.
PUBLISH_RETRY = Backoff(0.2, 5.0)

#: How long a persist tries to put its generation's newest-save record before it says, once,
#: that it is waiting for the coordinator (it keeps trying: see :meth:`Truth.stored`).
STORED_PATIENCE = 2.0

#: Paths whose last read record is kept for their commit (the saves in flight at once).
_READ_MAX = 4096


def races(seen_a: int, stamp_a: int, seen_b: int, stamp_b: int) -> bool:
    """Whether two saves of one path overlapped: neither had seen the other when it began.
    A save whose ``seen`` is :data:`UNSEEN` races with nothing."""
    if seen_a == UNSEEN or seen_b == UNSEEN:
        return False
    return seen_a < stamp_b and seen_b < stamp_a


class Truth:
    """This node's view of, and part in, the cluster's newest save of each path."""

    def __init__(self, membership: Membership, stop: threading.Event):
        self.membership = membership
        self._stop = stop
        #: The record each path's last :meth:`seen` read, with its revision: the commit's
        #: compare-and-swap starts from it (one request, not a read and a put) while it is
        #: still current; a stale one only costs the read it saved.
        self._read: collections.OrderedDict[tuple[str, str], tuple[dict[str, Any] | None, int]]
        self._read = collections.OrderedDict()
        self._read_lock = threading.Lock()

    def newest(self, namespace: str, path: str) -> LatestRecord | None:
        """The cluster's newest save of ``path`` (None: no save recorded); raises
        :class:`CoordinatorUnavailable`."""
        key = keys.latest_key(path_hash(namespace, path))
        return parse_one(LatestRecord, key, self.membership.coord.get(key))

    def holds(self, gen: Generation, stamp: int) -> bool:
        """Whether the save stamped ``stamp`` has the same content as ``gen`` (whose digests
        are known), as its holders announce it: one scan of the path's holders."""
        ph = path_hash(gen.namespace, gen.path)
        digest = object_digest(gen.digests or [])
        scanned = self.membership.coord.scan(keys.group_prefix(ph, digest))
        return any(h.committed_ns == stamp for h in parse_all(HolderRecord, scanned).values())

    def seen(self, namespace: str, path: str) -> int:
        """The stamp of the newest save of ``path`` a save beginning now follows (0: none);
        raises :class:`CoordinatorUnavailable`."""
        key = keys.latest_key(path_hash(namespace, path))
        raw, revision = self.membership.coord.read(key)
        with self._read_lock:
            self._read[(namespace, path)] = (raw, revision)
            self._read.move_to_end((namespace, path))
            while len(self._read) > _READ_MAX:
                self._read.popitem(last=False)
        record = parse_one(LatestRecord, key, raw)
        return record.committed_ns if record is not None else 0

    def publish(self, gen: Generation, patience: float = 0.0) -> None:
        """Make ``gen``, a save just committed here, the cluster's newest save of its path
        (unless a newer one is recorded already), tried again for up to ``patience`` seconds
        (a request lost to one etcd member, a leader being elected). Past that, through an
        outage, it is put once the coordinator answers (in the background), and the persist
        tries again when the generation reaches storage (:meth:`stored`)."""
        record = self._record(gen)
        failed = self._advance_within(gen, record, patience)
        if failed is None:
            return
        log.warning("cannot record %s generation %d as the newest save yet (%s); retrying",
                    gen.path, gen.number, failed)  # fmt: skip
        threading.Thread(target=self._retry, args=(gen, record), name="latest-record",
                         daemon=True).start()  # fmt: skip

    def stored(self, gen: Generation) -> bool:
        """``gen`` (a save of this node or a backup copy) reached storage: put its newest-save
        record before the persist is reported, so that every node knows a save once
        ``wait()`` says it is persisted. A record lost, or still being retried since the
        commit, would otherwise leave other nodes serving their older copies of a save
        reported persisted. Tried until it is in, on the persist worker's time (never the
        trainer's): a persist needs the coordinator for its claim in any case. False when the
        daemon stops first (the persist is not reported; the next start finds the object)."""
        record = self._record(gen)
        failed = self._advance_within(gen, record, STORED_PATIENCE)
        if failed is None:
            return True
        log.warning("%s generation %d is on storage; waiting for the coordinator to record it "
                    "as the newest save before reporting it persisted (%s)",
                    gen.path, gen.number, failed)  # fmt: skip
        return self._retry(gen, record)

    def _advance_within(
        self, gen: Generation, record: LatestRecord, patience: float
    ) -> CoordinatorUnavailable | None:
        """:meth:`_advance`, tried again with backoff for up to ``patience`` seconds; the
        last failure when it never got through."""
        deadline = time.monotonic() + patience
        failures = 0
        while True:
            try:
                self._advance(gen, record)
                return None
            except CoordinatorUnavailable as e:
                delay = PUBLISH_RETRY.delay(failures)
                failures += 1
                if time.monotonic() + delay > deadline:
                    return e
                time.sleep(delay)

    def _record(self, gen: Generation) -> LatestRecord:
        saver = gen.origin if gen.origin and gen.origin != "storage" else ""
        return LatestRecord(saver or self.membership.node.node_id, gen.path, gen.number,
                            gen.committed_ns)  # fmt: skip

    def _advance(self, gen: Generation, record: LatestRecord) -> None:
        key = keys.latest_key(path_hash(gen.namespace, gen.path))
        coord = self.membership.coord
        with self._read_lock:
            expect = self._read.pop((gen.namespace, gen.path), None)
        put, before = coord.advance(key, record.to_dict(), "committed_ns", expect)
        found = parse_one(LatestRecord, key, before)
        if found is None or found.node == record.node:
            return
        if gen.seen_ns != UNSEEN and found.committed_ns > gen.seen_ns:
            # A save of another node landed after this one began: they overlapped. The newer
            # stamp is the newest either way; if their contents differ, the persist election
            # reports the conflict on both nodes (from the holders' ``seen``).
            log.warning(
                "%s generation %d was saved while node %s saved it too (%s is newer)",
                gen.path,
                gen.number,
                found.node,
                "this one" if put else "that one",
            )

    def _retry(self, gen: Generation, record: LatestRecord) -> bool:
        """:meth:`_advance` until it gets through (True) or the daemon stops (False)."""
        failures = 0
        while not self._stop.wait(PUBLISH_RETRY.delay(failures)):
            try:
                self._advance(gen, record)
            except CoordinatorUnavailable:
                failures += 1
                continue
            log.info("recorded %s generation %d as the newest save after a coordinator outage",
                     gen.path, gen.number)  # fmt: skip
            return True
        return False
