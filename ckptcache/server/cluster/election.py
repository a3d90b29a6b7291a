"""Persist election: which member of a redundancy group writes its content to storage.

Lifecycle of a committed generation on a cluster node (called by the persister, see
:class:`~ckptcache.server.persist.persister.PersistElection`)::

    claim -> persisted record exists  -> done, nothing written
          -> won the group election   -> representative: persist, then :meth:`persisted`
          -> lost                     -> standby: :meth:`watch` the group
    standby -> record appears     -> persisted (nothing written)
            -> representative gone (lease expired / failed) -> claim again (takeover)

A redundancy group is (path, object digest): the nodes holding identical content of a path.
Representatives are preferred by rendezvous hash (so groups spread over nodes) and made
unique by the coordinator's create-if-absent under the node lease. Different contents of one
path saved by different nodes at the same time (the saves *raced*: neither had seen the
other when it began, :func:`ckptcache.server.cluster.truth.races`) are a digest disagreement: the
newer save (by stamp, the cluster's newest) takes the path and every other one is persisted
beside it as ``<path>.conflict-<digest>``, and both are reported. A save made after another
completed is never a disagreement, whatever its node held before: it is the newest, and
replaces the older content on storage. A ``persisted/`` record counts only while no newer
content of the path was persisted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ckptcache.errors import CkptCacheError
from ckptcache.format.digest import digest_bytes
from ckptcache.format.manifest import object_digest
from ckptcache.server.backoff import Backoff
from ckptcache.server.cluster.coord import CoordinatorUnavailable, NodeInfo, keys
from ckptcache.server.cluster.coord.records import (
    HolderRecord,
    PersistedRecord,
    RepRecord,
    WriterRecord,
    parse_all,
)
from ckptcache.server.cluster.membership import Membership, path_hash
from ckptcache.server.cluster.truth import Truth, races
from ckptcache.server.cluster.writer_fence import WriterFence
from ckptcache.server.config import DaemonConfig
from ckptcache.server.memory.index import Generation
from ckptcache.server.metrics import Metrics
from ckptcache.server.restore.fetching import Fetching, PeerBusy
from ckptcache.server.state import CacheState
from ckptcache.storage.base import StoredVersion, WriteGuard
from ckptcache.wire.states import ClaimRole, Tier

__all__ = ["Election", "FencedGuard"]

log = logging.getLogger(__name__)


#: Recording a persist while the coordinator is unreachable: tried again at this pace.
RECORD_RETRY = Backoff(0.2, 5.0)

#: How long a good copy is asked for again from a peer busy sending it to others (seconds).
BUSY_PATIENCE = 10.0


def _no_fence() -> None:
    return None


@dataclass(frozen=True)
class FencedGuard(WriteGuard):
    """A :class:`WriteGuard` that first runs ``still_writer`` (raising :class:`Deposed`) each
    time the backend consults it: before the upload and right before the object becomes
    visible. A representative cut off mid-write past its lease thus abandons its upload when
    the link heals instead of landing it after its successor's."""

    still_writer: Callable[[], None] = _no_fence

    def check(self, path: str, current: StoredVersion | None) -> None:
        self.still_writer()
        super().check(path, current)


def _stamp(record: PersistedRecord) -> int:
    """A persisted content's save stamp (ns); from the float for a record without it."""
    return record.committed_ns or round(record.committed * 1e9)


class Election:
    """The cluster side of :class:`~ckptcache.server.persist.persister.PersistElection`."""

    def __init__(
        self,
        config: DaemonConfig,
        state: CacheState,
        membership: Membership,
        fetching: Fetching,
        *,
        metrics: Metrics,
        protect: Callable[[Generation], None],
        mark_persisted: Callable[[Generation], None],
        truth: Truth,
        resubmit: Callable[[Generation], None],
        stop: threading.Event,
    ):
        self.config = config
        self.state = state
        self.membership = membership
        self.fetching = fetching
        self.metrics = metrics
        #: Announce and protect a good copy fetched to replace a corrupt one.
        self.protect = protect
        #: The persister's: the group persisted a standby's content / take over its persist.
        self.mark_persisted = mark_persisted
        #: The cluster's newest save of each path (read when a conflict may be a supersede,
        #: put once more before a persist is reported).
        self.truth = truth
        self.resubmit = resubmit
        self._stop = stop
        self._standby: dict[Generation, tuple[str, str]] = {}

    def claim(self, gen: Generation) -> tuple[ClaimRole, str]:
        """Decide this node's role for persisting ``gen``: ``("done", path)``,
        ``("lead", target_path)``, ``("standby", "")`` or ``("retry", "")``."""
        ph, digest = self.membership.announce(gen)
        if self._stored(ph, digest):
            return ClaimRole.DONE, gen.path
        target = self._conflict_target(gen, ph, digest)
        group = parse_all(HolderRecord, self.membership.coord.scan(keys.group_prefix(ph, digest)))
        live = set(self.membership.node_ids())
        members = sorted((h.node for h in group.values() if h.node in live),
                         key=lambda n: digest_bytes(f"{ph}{digest}{n}".encode()))  # fmt: skip
        me = self.membership.node.node_id
        rank = members.index(me) if me in members else len(members)
        if rank:
            time.sleep(min(0.2 * rank, 1.0))  # the preferred node gets a head start
        rep = keys.rep_key(ph, digest)
        if not self._elect(rep, RepRecord(me, time.time()).to_dict(), ("node",)):
            return ClaimRole.STANDBY, ""
        if self._stored(ph, digest):
            # A previous representative finished (and stepped down) while we waited.
            self.membership.release(rep)
            return ClaimRole.DONE, gen.path
        writer = WriterRecord(me, digest).to_dict()
        if not self._elect(keys.writer_key(ph), writer, ("node", "digest")):
            self.membership.coord.release(rep)
            return ClaimRole.RETRY, ""
        return ClaimRole.LEAD, self._conflict_target(gen, ph, digest) or target

    def _elect(self, key: str, value: dict[str, Any], same: tuple[str, ...]) -> bool:
        """Win ``key`` for this node, or find it this node's already (its ``same`` fields
        equal ``value``'s). A claim that failed after it won (a later request failed, or etcd
        created the key and its answer was lost) leaves the key under this node's lease: the
        claim a second later must take it up, not wait as the standby of itself."""
        coord = self.membership.coord
        if coord.elect(key, value):
            return True
        if not coord.healthy():
            return False  # cut off: never take up a role it may not be able to keep
        held = coord.get(key)
        return held is not None and all(held.get(f) == value[f] for f in same)

    def stored(self, gen: Generation) -> bool:
        """``gen`` reached storage at its path: its newest-save record is put before the
        persist is reported (False: the daemon stopped first; see :meth:`Truth.stored`)."""
        return self.truth.stored(gen)

    def newer_saved(self, gen: Generation) -> bool:
        """Whether the cluster's newest save of ``gen``'s path is newer than ``gen`` (one
        coordinator read; False while it is unreachable)."""
        try:
            newest = self.truth.newest(gen.namespace, gen.path)
        except CoordinatorUnavailable:
            return False
        return newest is not None and newest.committed_ns > gen.committed_ns

    def fence(self, gen: Generation, guard: WriteGuard) -> WriteGuard:
        """``guard`` fenced by this node's writer role for ``gen`` (see :class:`FencedGuard`
        and :class:`~ckptcache.server.cluster.writer_fence.WriterFence`)."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        fence = WriterFence(self.membership.coord, ph, digest, self.membership.node.node_id)
        kept = {f.name: getattr(guard, f.name) for f in fields(WriteGuard)}
        return FencedGuard(**kept, still_writer=fence.check)

    def _stored(self, ph: str, digest: str) -> bool:
        """Whether storage holds this content at its path: a persist of it is recorded and no
        other content of the path was persisted after it (a path saved X, Y, then X again
        must be written again: storage holds Y)."""
        records = parse_all(PersistedRecord, self.membership.coord.scan(keys.persisted_prefix(ph)))
        key = keys.persisted_key(ph, digest)
        mine = records.get(key)
        if mine is None:
            return False
        return all(
            _stamp(r) <= _stamp(mine) for k, r in records.items() if k != key and not r.sidecar
        )

    def _concurrent_contents(self, gen: Generation, ph: str, digest: str) -> dict[str, int]:
        """Other contents of the path whose saves raced with ``gen`` (made on another node
        while ``gen`` was being saved, neither having seen the other), by digest, with their
        stamps: a replica group that disagrees. Only each save's own node knows what it had
        seen (a backup copy's holder does not), and a generation that is not a save of this
        node races with nothing."""
        scanned = self.membership.coord.scan(keys.holders_prefix(ph))
        contents = {k: v for k, v in scanned.items() if keys.digest_of(k) != keys.INFLIGHT}
        me = self.membership.node.node_id
        return {
            keys.digest_of(key): h.committed_ns
            for key, h in parse_all(HolderRecord, contents).items()  # in flight: no content
            if keys.digest_of(key) != digest and h.node != me and not h.origin
            and races(gen.seen_ns, gen.committed_ns, h.seen, h.committed_ns)
        }  # fmt: skip

    def _conflict_target(self, gen: Generation, ph: str, digest: str) -> str:
        """Where this content goes: the path, or a sidecar when it raced with a newer save
        of other content (which takes the path)."""
        others = self._concurrent_contents(gen, ph, digest)
        if not others:
            return gen.path
        if not gen.conflict:
            gen.conflict = f"saved at the same time as {len(others)} other content(s) on other " \
                "nodes: " + ", ".join(sorted(others))  # fmt: skip
            self.metrics.corrupt.labels(tier=Tier.GROUP).inc()
            log.error("digest disagreement on %s: this node holds %s, others hold %s",
                      gen.path, digest, sorted(others))  # fmt: skip
        if max(others.values()) > gen.committed_ns:  # a newer racing save takes the path
            return f"{gen.path}.conflict-{digest}"
        return gen.path

    def persisted(self, gen: Generation, target: str) -> None:
        """Record the group's persist and step down. If the coordinator is unreachable, the
        record is retried in the background (with backoff) until it answers: the object is
        already complete on storage, so nothing waits for it but the standbys."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        record = PersistedRecord(self.membership.node.node_id, target, time.time(),
                                 gen.committed, gen.committed_ns)  # fmt: skip
        try:
            self._record_persisted(ph, digest, record)
        except CoordinatorUnavailable as e:
            log.warning("cannot record the persist of %s yet (%s); retrying", gen.path, e)
            threading.Thread(
                target=self._retry_record, args=(gen.path, ph, digest, record),
                name="persisted-record", daemon=True,
            ).start()  # fmt: skip

    def _record_persisted(self, ph: str, digest: str, record: PersistedRecord) -> None:
        self.membership.coord.record(keys.persisted_key(ph, digest), record.to_dict())
        for key in (keys.writer_key(ph), keys.rep_key(ph, digest)):
            self.membership.coord.release(key)

    def _retry_record(self, path: str, ph: str, digest: str, record: PersistedRecord) -> None:
        failures = 0
        while not self._stop.wait(RECORD_RETRY.delay(failures)):
            try:
                self._record_persisted(ph, digest, record)
            except CoordinatorUnavailable:
                failures += 1
                continue
            log.info("recorded the persist of %s after a coordinator outage", path)
            return

    def failed(self, gen: Generation) -> None:
        """Step down after giving up, so a standby can take over; keep watching the group."""
        self.step_down(gen)
        self.watch(gen, resubmit=False)

    def step_down(self, gen: Generation) -> None:
        """Give up the representative's keys of ``gen`` (superseded, dropped or failed):
        held, they would keep every later save of the path from being persisted."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        self.membership.release(keys.writer_key(ph), keys.rep_key(ph, digest))

    def replace_corrupt(self, gen: Generation) -> bool:
        """This node's copy of ``gen`` is corrupt: leave its redundancy group (so a standby
        takes over the persist) and fetch a good copy from another member; returns whether
        one was found. The fetched copy is committed as a newer generation and persisted (or
        marked persisted) through the normal election."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        me = self.membership.node.node_id
        self.membership.withdraw_held(gen)
        self.membership.release(keys.writer_key(ph), keys.rep_key(ph, digest))
        try:
            members = parse_all(
                HolderRecord, self.membership.coord.scan(keys.group_prefix(ph, digest))
            )
            live = {n.node_id: n for n in self.membership.live_nodes()}
        except CoordinatorUnavailable as e:
            log.error("cannot look for a good copy of %s: %s", gen.path, e)
            return False
        for entry in members.values():
            node = live.get(entry.node)
            if node is None or node.node_id == me or not node.data_addr:
                continue
            try:
                good = self._fetch_good(node, gen, ph)
            except (OSError, CkptCacheError) as e:
                log.warning("good copy of %s from %s failed: %s", gen.path, node.node_id, e)
                continue
            log.warning("replaced the corrupt copy of %s with the one of %s (generation %d)",
                        gen.path, node.node_id, good.number)  # fmt: skip
            self.protect(good)
            return True
        log.error("no other node holds a good copy of %s: it cannot be persisted", gen.path)
        return False

    def _fetch_good(self, node: NodeInfo, gen: Generation, ph: str) -> Generation:
        """``node``'s copy of ``gen``'s path, asked again while it answers busy (sending
        it to other peers: a group restore), for at most :data:`BUSY_PATIENCE` seconds."""
        deadline = time.monotonic() + BUSY_PATIENCE
        while True:
            try:
                with self.membership.in_flight(ph) as announce:
                    return self.fetching.fetch_from(node, gen.namespace, gen.path, announce)
            except PeerBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def watch(self, gen: Generation, *, resubmit: bool = True) -> None:
        """Watch the group of ``gen`` as a standby (with the state lock held or not)."""
        ph, digest = path_hash(gen.namespace, gen.path), object_digest(gen.digests or [])
        self._standby[gen] = (ph, digest if resubmit else f"!{digest}")

    def check_standbys(self) -> None:
        """Resolve watched groups: persisted by another member, or take over."""
        coord = self.membership.coord
        for gen, (ph, tag) in list(self._standby.items()):
            digest = tag.lstrip("!")
            if not self.state.is_current(gen):
                self._standby.pop(gen, None)
                continue
            if self._stored(ph, digest):
                self._standby.pop(gen, None)
                self.mark_persisted(gen)
            elif not tag.startswith("!") and coord.get(keys.rep_key(ph, digest)) is None:
                self._standby.pop(gen, None)
                log.warning("representative of %s is gone: taking over", gen.path)
                self.resubmit(gen)
