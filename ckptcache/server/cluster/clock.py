"""Clock offsets to peers, measured NTP-style over the authenticated data plane.

Nothing in the cache takes its order from wall clocks alone, but people and some decisions
read them: commit times in ``ls``/``status``, storage's modification times, the
the age of a holder. A node whose clock is
far off makes those misleading, so every daemon measures its peers' clocks now and then (the
next few in the ring of node ids, so that every node is measured by as many others however
large the cluster) and warns, with the figure, above ``clock_offset_bound``.

One probe is a few round trips on one authenticated connection::

    this node   t0 = wall clock   -> {"op": "clock"}
    peer        t1 = its wall clock on receipt, t2 = its wall clock on reply -> {"t1", "t2"}
    this node   t3 = t0 + elapsed (monotonic: a clock step mid-probe changes nothing)

    offset = ((t1 - t0) + (t2 - t3)) / 2     the peer's clock minus this node's
    delay  = (t3 - t0) - (t2 - t1)           the round trip, the peer's own time taken out

The offset is exact when both legs take as long; otherwise it is off by at most
``delay / 2``, so of several samples the one with the shortest round trip is kept (NTP's
clock filter). Peers that predate the probe answer "unknown op" and are simply not reported.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptcache.errors import CkptCacheError
from ckptcache.server.cluster.coord import CoordinatorUnavailable, NodeInfo
from ckptcache.server.cluster.dataplane import Channel, recv_msg, send_msg
from ckptcache.server.cluster.membership import Membership
from ckptcache.server.metrics import Metrics
from ckptcache.wire import messages as m

__all__ = ["OP", "ClockWatch", "Sample", "on_probe", "probe", "sample_of"]

log = logging.getLogger(__name__)

#: The data-plane request kind of a probe.
OP = "clock"
#: Round trips per probe (the shortest one is kept).
SAMPLES = 4
#: Seconds a probe may take to connect and answer.
PROBE_TIMEOUT = 5.0
#: Seconds between two looks at the membership for peers due a check.
TICK = 1.0
#: Peers each daemon measures: the next ones in the ring of node ids (all, in small clusters).
MAX_PEERS = 8
#: Seconds between two warnings about the same peer while its offset stays beyond the bound.
REWARN = 3600.0


@dataclass(frozen=True)
class Sample:
    """One peer's clock as measured here: ``offset`` (its clock minus ours) and the round
    trip ``delay`` that bounds the error (half of it), both in seconds."""

    offset: float
    delay: float


def sample_of(t0: float, t1: float, t2: float, t3: float) -> Sample:
    """The NTP estimate from the four timestamps of one round trip (see the module)."""
    return Sample(((t1 - t0) + (t2 - t3)) / 2, (t3 - t0) - (t2 - t1))


def on_probe(conn: Channel, raw: dict[str, Any]) -> None:
    """Data-plane handler of ``clock``: this node's wall clock on receipt and on reply."""
    received = time.time()
    send_msg(conn, {"ok": True, "t1": received, "t2": time.time()})


def _stamp(reply: dict[str, Any], name: str) -> float:
    value = reply.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"clock reply without a valid {name!r}")
    return float(value)


def probe(channel: Channel, samples: int = SAMPLES) -> Sample:
    """Measure the peer at the other end of ``channel``: ``samples`` round trips, the one
    with the shortest delay kept. Raises ValueError if the peer does not answer probes."""
    best: Sample | None = None
    for _ in range(samples):
        t0, start = time.time(), time.monotonic()
        send_msg(channel, {"op": OP})
        reply = recv_msg(channel)
        t3 = t0 + (time.monotonic() - start)
        if reply.get("ok") is not True:
            raise ValueError(f"peer does not answer clock probes: {reply.get('message', reply)}")
        sample = sample_of(t0, _stamp(reply, "t1"), _stamp(reply, "t2"), t3)
        if best is None or sample.delay < best.delay:
            best = sample
    assert best is not None
    return best


class ClockWatch:
    """Measures the clocks of the next :data:`MAX_PEERS` live peers in the ring each
    ``clock_check_interval`` seconds (a new peer at once), keeps the figures for ``status``
    and the metrics, and warns about offsets beyond the bound."""

    def __init__(
        self,
        membership: Membership,
        metrics: Metrics,
        *,
        bound: float,
        interval: float,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.membership = membership
        self.metrics = metrics
        self.bound = bound
        self.interval = interval
        self._stop = stop
        self._clock = clock
        self._lock = threading.Lock()
        self._figures: dict[str, m.PeerClock] = {}
        self._due: dict[str, float] = {}  # next check per peer (monotonic)
        self._warned: dict[str, float] = {}  # last warning per peer (monotonic)

    def start(self) -> None:
        """Start measuring in the background (nothing when the interval is 0)."""
        if self.interval > 0:
            threading.Thread(target=self._run, name="clock-watch", daemon=True).start()

    def offsets(self) -> tuple[m.PeerClock, ...]:
        """The latest figure of every peer measured and still live, by node id."""
        with self._lock:
            return tuple(self._figures[k] for k in sorted(self._figures))

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self.check_due()
            except CoordinatorUnavailable as e:
                log.debug("clock check skipped: %s", e)
            except Exception:
                log.exception("clock check")

    def check_due(self) -> None:
        """Measure the live peers whose check is due (new peers at once); forget the
        figures of peers that left."""
        peers = self._ring_peers()
        self._forget({n.node_id for n in peers})
        now = self._clock()
        for node in peers:
            if self._stop.is_set():
                return
            if self._due.get(node.node_id, 0.0) <= now:
                self._due[node.node_id] = now + self.interval
                self.measure(node)

    def _ring_peers(self) -> list[NodeInfo]:
        """The (at most :data:`MAX_PEERS`) live peers after this node in the ring of node
        ids: every node is measured by as many others, and the probes a node makes stay
        bounded however large the cluster (all pairs would grow with its square)."""
        me = self.membership.node.node_id
        live = {n.node_id: n for n in self.membership.live_nodes() if n.data_addr}
        ids = sorted(set(live) | {me})
        at = ids.index(me)
        ring = ids[at + 1 :] + ids[:at]
        return [live[i] for i in ring[:MAX_PEERS]]

    def measure(self, node: NodeInfo) -> m.PeerClock | None:
        """Probe ``node`` now and record the figure (None when it cannot be measured)."""
        try:
            with self.membership.dial(node, timeout=PROBE_TIMEOUT) as conn:
                sample = probe(conn.channel)
        except (OSError, ValueError, CkptCacheError) as e:
            log.debug("clock of %s not measured: %s", node.node_id, e)
            return None
        return self.record(node.node_id, sample)

    def record(self, node_id: str, sample: Sample) -> m.PeerClock:
        """Keep ``sample`` as ``node_id``'s figure and warn if it is beyond the bound."""
        figure = m.PeerClock(node_id, sample.offset, sample.delay, time.time())
        with self._lock:
            self._figures[node_id] = figure
        self.metrics.peer_clock_offset.labels(peer=node_id).set(sample.offset)
        self._judge(node_id, sample)
        return figure

    def _judge(self, node_id: str, sample: Sample) -> None:
        """Warn when a peer's offset goes beyond the bound (again every :data:`REWARN`
        seconds while it stays there); say so once it is back within."""
        beyond = self.bound > 0 and abs(sample.offset) > self.bound
        last = self._warned.get(node_id)
        now = self._clock()
        if beyond and (last is None or now - last >= REWARN):
            self._warned[node_id] = now
            log.warning(
                "clock of node %s is %+.3f s off this node's (bound %g s, measured within "
                "%.3f s): commit times, storage times and conflict windows across these nodes "
                "disagree by as much; synchronise the clocks (NTP/chrony)",
                node_id, sample.offset, self.bound, sample.delay / 2,
            )  # fmt: skip
        elif not beyond and last is not None:
            del self._warned[node_id]
            log.info("clock of node %s is back within %g s of this node's (%+.3f s)",
                     node_id, self.bound, sample.offset)  # fmt: skip

    def _forget(self, live: set[str]) -> None:
        with self._lock:
            gone = (set(self._figures) | set(self._due)) - live
            for node_id in gone:
                self._figures.pop(node_id, None)
        for node_id in gone:
            self._due.pop(node_id, None)
            self._warned.pop(node_id, None)
            try:
                self.metrics.peer_clock_offset.remove(node_id)
            except KeyError:
                pass
