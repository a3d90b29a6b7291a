"""The group read's stream count, chosen on the object's first bytes: one where the streams
share the link (each added one splits it), as many as allowed where each connection has a
rate of its own (a real object store), and in between where the link holds two.

Stores with those bounds, simulated on a clock: a read of one range takes ``TICK`` seconds on
its own, and ``slots`` reads at once fit the link (a semaphore; the others queue behind it,
as flows sharing a link share its rate).
"""

from __future__ import annotations

import threading
import time

import pytest

from ckptcache.format.prefix_read import PROBE, more_streams, probe_streams

MiB = 1 << 20
TICK = 0.25  # long beside a loaded machine's scheduling noise (a thread pool's start)


class Store:
    """``slots`` ranged reads at once at full rate; offsets in the order the reads began."""

    def __init__(self, slots: int, latency: float = 0.0):
        self.link = threading.Semaphore(slots)
        self.latency = latency
        self.lock = threading.Lock()
        self.started: list[int] = []
        self.most = self.now = 0

    def read(self, off: int, n: int) -> None:
        with self.lock:
            self.started.append(off)
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.latency)  # the time to the first byte: requests overlap it
        with self.link:
            time.sleep(TICK * n / PROBE)
        with self.lock:
            self.now -= 1


@pytest.mark.parametrize(
    ("slots", "most", "streams"),
    [(1, 4, 1), (2, 4, 2), (8, 4, 4), (8, 3, 3), (1, 1, 1)],
)
def test_the_probe_stops_where_one_more_stream_does_not_raise_the_rate(slots, most, streams):
    store = Store(slots)
    chosen, probed = probe_streams(store.read, 256 * MiB, most)
    assert chosen == streams
    # Rounds of 1, 2, ... ranges, one more than it kept (it had to try it) unless at ``most``.
    rounds = min(most, streams + 1)
    assert [n for _, n in probed] == [PROBE] * (rounds * (rounds + 1) // 2)
    # Contiguous from the start, and begun in file order: the relays' prefix keeps moving.
    assert [o for o, _ in probed] == [i * PROBE for i in range(len(probed))]
    assert store.started == sorted(store.started)
    assert store.most == rounds


def test_a_store_s_latency_is_no_reason_for_more_streams_where_the_link_is_full():
    # Where each request waits 4 ticks before its bytes come, two requests at once look
    # faster than one (their waits overlap) although the link holds one; the measured latency
    # taken off each round shows the link's rate.
    store = Store(1, latency=4 * TICK)
    assert probe_streams(store.read, 256 * MiB, 4, latency=0.0)[0] > 1
    store = Store(1, latency=4 * TICK)
    assert probe_streams(store.read, 256 * MiB, 4, latency=4 * TICK)[0] == 1


def test_a_small_object_is_probed_on_at_most_half_its_bytes():
    store = Store(8)
    chosen, probed = probe_streams(store.read, 12 * MiB, 4)  # rounds 1 and 2: 6 MiB
    assert (chosen, sum(n for _, n in probed)) == (2, 6 * MiB)
    chosen, probed = probe_streams(store.read, 3 * MiB, 4)  # not even one round
    assert (chosen, probed) == (1, [])


def test_an_added_stream_counts_when_it_brings_half_a_stream():
    assert more_streams(100.0, 150.0, 2) and not more_streams(100.0, 149.0, 2)
    assert more_streams(300.0, 350.0, 4) and not more_streams(300.0, 340.0, 4)
