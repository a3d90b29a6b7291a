"""Simulated nodes on the real etcd coordinator: the control plane is real, bytes are modelled.

Every simulated node owns one :class:`~ckptcache.server.cluster.coord.etcd.EtcdCoordinator` built by
the daemon's own factory (its own HTTP session, lease and keep-alive thread) and drives it
through the call sequences of :mod:`ckptcache.server.cluster.cluster` with the daemon's key schema
(``path_hash`` included). Only the data plane is replaced: a storage read, a peer transfer or
a persist is a delay. Nodes are step generators run by :class:`Scheduler` on a bounded thread
pool: a node that waits (the rank head start, a standby's 0.5 s monitor, a loader's 50 ms poll)
yields the delay instead of holding a thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptcache.format.digest import digest_bytes, digest_hex
from ckptcache.server.cluster.cluster import path_hash
from ckptcache.server.cluster.coord import NodeInfo, make_coordinator
from ckptcache.server.cluster.coord.etcd import EtcdCoordinator

#: A node's behaviour: a generator yielding seconds to wait before its next step.
Steps = Generator[float, None, Any]

NAMESPACE = "sim"


class RequestCounter:
    """Counts etcd requests at the coordinator's client layer, by gateway endpoint."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def wrap(self, node: SimNode) -> None:
        """Count every request ``node`` sends (leases, puts, ranges, transactions); its own
        ``ops`` counts the ones that are not lease keep-alives."""
        client = node.coord._client
        post = client.post

        def counted(url: str, *args: Any, **kwargs: Any) -> Any:
            endpoint = url.split("/v3/", 1)[-1]
            with self._lock:
                self.counts[endpoint] += 1
                if not endpoint.startswith("lease/"):
                    node.ops += 1
            return post(url, *args, **kwargs)

        client.post = counted  # type: ignore[method-assign]

    def total(self) -> int:
        """All requests so far."""
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> Counter[str]:
        """A copy of the per-endpoint counts."""
        with self._lock:
            return Counter(self.counts)


class Scheduler:
    """Runs node step generators on a bounded pool; a yielded float is a wait in seconds."""

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sim")
        self._heap: list[tuple[float, int, SimNode, Steps]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._pending = 0
        self._closed = False
        self.errors: list[str] = []
        threading.Thread(target=self._dispatch, name="sim-dispatch", daemon=True).start()

    def spawn(self, node: SimNode, steps: Steps, delay: float = 0.0) -> None:
        """Start ``steps`` for ``node`` after ``delay`` seconds."""
        with self._cond:
            self._pending += 1
            self._push(node, steps, delay)

    def _push(self, node: SimNode, steps: Steps, delay: float) -> None:
        heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), node, steps))
        self._cond.notify_all()

    def _dispatch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, node, steps = heapq.heappop(self._heap)
                    self._pool.submit(self._step, node, steps)
                wait = self._heap[0][0] - now if self._heap else 1.0
                self._cond.wait(min(wait, 1.0))

    def _step(self, node: SimNode, steps: Steps) -> None:
        if node.dead:  # killed: its generator never runs again (as after kill -9)
            steps.close()
            self._done()
            return
        try:
            delay = next(steps)
        except StopIteration:
            self._done()
            return
        except Exception as e:  # a coordinator error ends this node's run; reported by the caller
            self.errors.append(f"{node.info.node_id}: {type(e).__name__}: {e}")
            self._done()
            return
        with self._cond:
            self._push(node, steps, delay)

    def _done(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait until every spawned generator has finished; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        """Stop dispatching; running steps finish."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)


class SimNode:
    """One node: the daemon's coordinator class plus the parts of ``Cluster`` it drives."""

    def __init__(self, index: int, url: str, cluster: str, ttl: float, counter: RequestCounter):
        coord = make_coordinator(url, cluster=cluster, job="j", ttl=ttl)
        assert isinstance(coord, EtcdCoordinator)
        self.coord = coord
        self.ops = 0  # requests other than lease keep-alives and grants
        counter.wrap(self)
        port = 7000 + index % 1000
        self.info = NodeInfo(f"n{index:05d}", f"h{index:05d}", f"10.{index // 256}.0.1:{port}")
        self.dead = False
        self._live: list[NodeInfo] = []
        self._live_at = float("-inf")

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.info.node_id

    def live_nodes(self, max_age: float = 0.5) -> list[NodeInfo]:
        """As ``Cluster.live_nodes``: membership re-read at most every ``max_age`` seconds."""
        now = time.monotonic()
        if now - self._live_at > max_age:
            self._live = self.coord.live_nodes()
            self._live_at = now
        return self._live

    def node_ids(self) -> set[str]:
        """As ``Cluster.node_ids``."""
        return {n.node_id for n in self.live_nodes()}

    def holders(self, ph: str) -> list[str]:
        """As ``Cluster.holders``: live nodes announcing a copy (newest commit first)."""
        entries = self.coord.scan(f"holders/{ph}/")
        live = self.node_ids()
        ranked = sorted(entries.values(), key=lambda v: -float(v.get("committed", 0)))
        seen: list[str] = []
        for v in ranked:
            node = str(v.get("node"))
            if node in live and node not in seen:
                seen.append(node)
        return seen

    def kill(self) -> None:
        """As kill -9: no more steps, no more keep-alives, no revoke (the lease lapses)."""
        self.dead = True
        self.coord._stop.set()

    def close(self) -> None:
        """Leave (revoke the lease) unless killed."""
        if not self.dead:
            self.coord.close()


@dataclass
class Group:
    """A redundancy group: the ``size`` nodes holding one shard's content."""

    index: int
    path: str
    members: list[SimNode]
    ph: str = ""
    digest: str = ""

    def __post_init__(self) -> None:
        self.ph = path_hash(NAMESPACE, self.path)
        self.digest = digest_hex(digest_bytes(f"content of {self.path}".encode()))


def make_groups(nodes: list[SimNode], size: int, tag: str) -> list[Group]:
    """Consecutive nodes form groups of ``size`` (the data-parallel replicas of one shard)."""
    return [
        Group(i // size, f"/ckpt/{tag}/shard_{i // size:05d}.pt", nodes[i : i + size])
        for i in range(0, len(nodes) - len(nodes) % size, size)
    ]


# --------------------------------------------------------------------------- save wave


@dataclass
class SaveStats:
    """What a save wave did, per group."""

    t0: float = field(default_factory=time.monotonic)
    elections: dict[int, list[tuple[float, str]]] = field(default_factory=dict)
    persists: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def elected(self, group: Group, node: SimNode) -> None:
        """``node`` won ``reps/<path>/<digest>``."""
        with self.lock:
            self.elections.setdefault(group.index, []).append(
                (time.monotonic() - self.t0, node.node_id)
            )

    def persisted(self, group: Group) -> None:
        """A complete persist of the group's object ended (the modelled write returned)."""
        with self.lock:
            self.persists[group.index] += 1

    def current_rep(self, group: Group) -> str | None:
        """The latest representative of ``group``, if any was elected."""
        with self.lock:
            runs = self.elections.get(group.index)
            return runs[-1][1] if runs else None


def claim(node: SimNode, group: Group, holding: dict[str, Any]) -> Generator[float, None, str]:
    """``Cluster.claim``: the same requests in the same order, the head start as a yield."""
    ph, digest, me = group.ph, group.digest, node.node_id
    node.coord.announce(f"holders/{ph}/{digest}/{me}", holding)  # _announce
    if node.coord.get(f"persisted/{ph}/{digest}") is not None:
        return "done"
    conflict_target(node, group)
    members_raw = node.coord.scan(f"holders/{ph}/{digest}/")
    live = node.node_ids()
    members = sorted(
        (str(v["node"]) for v in members_raw.values() if v.get("node") in live),
        key=lambda n: digest_bytes(f"{ph}{digest}{n}".encode()),
    )
    rank = members.index(me) if me in members else len(members)
    if rank:
        yield min(0.2 * rank, 1.0)  # the preferred node gets a head start
    if not node.coord.elect(f"reps/{ph}/{digest}", {"node": me, "since": time.time()}):
        return "standby"
    if node.coord.get(f"persisted/{ph}/{digest}") is not None:
        node.coord.withdraw(f"reps/{ph}/{digest}")
        return "done"
    if not node.coord.elect(f"writer/{ph}", {"node": me, "digest": digest}):
        node.coord.withdraw(f"reps/{ph}/{digest}")
        return "retry"
    conflict_target(node, group)
    return "lead"


def conflict_target(node: SimNode, group: Group) -> None:
    """``Cluster._conflict_target`` with one content per path: one scan of the path's holders."""
    node.coord.scan(f"holders/{group.ph}/")


def save(node: SimNode, group: Group, stats: SaveStats, persist_s: float, backup: bool) -> Steps:
    """One node's save of its shard: announce, (replicate), claim, persist or stand by."""
    ph, digest = group.ph, group.digest
    holding = {"node": node.node_id, "path": group.path, "generation": 1, "committed": time.time()}
    node.coord.announce(f"holders/{ph}/{digest}/{node.node_id}", holding)  # Cluster._worker
    if backup:
        node.node_ids()  # Cluster.replicate: membership for backup placement
    while True:
        role = yield from claim(node, group, holding)
        if role == "done":
            return
        if role == "retry":
            yield 1.0  # Persister: resubmit after a second
            continue
        if role == "lead":
            stats.elected(group, node)
            yield persist_s  # the modelled write to storage
            stats.persisted(group)
            node.coord.record(
                f"persisted/{ph}/{digest}", {"node": node.node_id, "path": group.path}
            )
            for key in (f"writer/{ph}", f"reps/{ph}/{digest}"):
                node.coord.withdraw(key)
            return
        while True:  # standby: Cluster._check_standbys every 0.5 s
            yield 0.5
            if node.coord.get(f"persisted/{ph}/{digest}") is not None:
                return
            if node.coord.get(f"reps/{ph}/{digest}") is None:
                break  # the representative is gone: take over


# --------------------------------------------------------------------------- restart wave


@dataclass
class LoadStats:
    """Where each node of a restart wave gets its bytes from, and when it knew."""

    t0: float = field(default_factory=time.monotonic)
    plans: dict[str, tuple[int, str, float]] = field(default_factory=dict)  # node: group, src, t
    rounds: dict[str, int] = field(default_factory=dict)  # node: requests before its plan
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, node: SimNode, group: Group, source: str, rounds: int) -> None:
        """``node`` chose ``source`` (a node id, or "storage") after ``rounds`` requests."""
        with self.lock:
            self.plans[node.node_id] = (group.index, source, time.monotonic() - self.t0)
            self.rounds[node.node_id] = rounds

    def storage_reads(self) -> Counter[int]:
        """Storage reads per group."""
        with self.lock:
            return Counter(g for g, src, _ in self.plans.values() if src == "storage")

    def depth_and_fanout(self) -> tuple[int, int]:
        """Deepest relay (hops from the storage reader) and widest fan-out of any sender."""
        with self.lock:
            source = {n: src for n, (_, src, _) in self.plans.items()}
        depth: dict[str, int] = {}

        def depth_of(n: str) -> int:
            seen = []
            while n not in depth and source.get(n, "storage") != "storage":
                seen.append(n)
                n = source[n]
                if len(seen) > len(source):
                    raise RuntimeError("relay cycle")
            d = depth.get(n, 0)
            for m in reversed(seen):
                d += 1
                depth[m] = d
            return d

        deepest = max((depth_of(n) for n in source), default=0)
        fanout = Counter(src for src in source.values() if src != "storage")
        return deepest, max(fanout.values(), default=0)


def restore(node: SimNode, group: Group, stats: LoadStats, transfer_s: float) -> Steps:
    """``Cluster.load_remote`` after a full restart (no copy in memory yet, the file exists)."""
    ph, me = group.ph, node.node_id
    inflight = f"holders/{ph}/inflight/{me}"
    holding = {"node": me, "path": group.path, "generation": 1}
    start = node.ops
    while True:
        sources = [n for n in node.holders(ph) if n != me]
        if sources:  # _fetch_from the newest holder: bytes start landing, chain behind it
            stats.plan(node, group, sources[0], node.ops - start)
            node.coord.announce(inflight, {"node": me, "committed": time.time()})
            yield transfer_s  # the modelled relay
            node.coord.announce(
                f"holders/{ph}/{group.digest}/{me}", {**holding, "committed": time.time()}
            )
            node.coord.withdraw(inflight)
            return
        if node.coord.elect(f"loads/{ph}", {"node": me}):
            if any(n != me for n in node.holders(ph)):
                node.coord.withdraw(f"loads/{ph}")  # a reader finished while we looked
                continue
            stats.plan(node, group, "storage", node.ops - start)
            node.coord.announce(inflight, {"node": me, "committed": time.time()})
            yield transfer_s  # the modelled storage read
            node.coord.announce(
                f"holders/{ph}/{group.digest}/{me}", {**holding, "committed": time.time()}
            )
            node.coord.withdraw(inflight)
            node.coord.withdraw(f"loads/{ph}")
            return
        while node.coord.get(f"loads/{ph}") is not None:  # another member reads storage
            yield 0.05
            if any(n != me for n in node.holders(ph)):
                break


# --------------------------------------------------------------------------- steady state


def monitor(node: SimNode, until: float) -> Steps:
    """``Cluster._monitor`` with ``backup`` on: membership re-read every 0.5 s."""
    while time.monotonic() < until:
        node.node_ids()
        yield 0.5


def run_all(
    scheduler: Scheduler, items: Iterator[tuple[SimNode, Steps]], timeout: float
) -> Callable[[], bool]:
    """Spawn every (node, steps) now; return a function that waits for them."""
    for node, steps in items:
        scheduler.spawn(node, steps)
    return lambda: scheduler.join(timeout)
