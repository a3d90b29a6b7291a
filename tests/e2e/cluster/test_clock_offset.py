"""Daemons measure their peers' clocks: a node whose wall clock runs an hour ahead (a real
daemon under libfaketime) is reported with the figure, in ``status`` and the log, by the
others, and it reports them as an hour behind."""

from __future__ import annotations

import glob
import logging
import subprocess
import sys
import threading

import pytest

from ckptcache.server.cluster.clock import ClockWatch, Sample, sample_of
from ckptcache.server.metrics import Metrics
from tests.helpers import wait_until

#: Debian's faketime package puts it under the multiarch directory.
LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), "")
HOUR = 3600.0
#: Generous bound: a loaded machine's scheduling never makes a true 0 look like a minute.
BOUND = "60"


def _faketime_env(shift: str) -> dict[str, str]:
    if not LIBFAKETIME:
        pytest.skip("libfaketime not installed (apt-get install faketime)")
    # Only the wall clock moves: the daemon's timeouts and leases run on the monotonic one.
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": shift, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def _with(args: list[str], **values: str) -> list[str]:
    """``args`` with the values of the flags in ``values`` (``node_id="n"``) replaced."""
    out = list(args)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


def _offsets(d):
    return {c.node_id: c.offset for c in d.status().clock_offsets}


def test_a_peer_an_hour_ahead_is_reported_with_the_figure(cluster_factory, daemon_factory):
    a, c = cluster_factory(2, "--clock-offset-bound", BOUND)
    env = _faketime_env("+1h")
    late = daemon_factory(*_with(a.args, node_id="late", host="hostlate"), env=env)
    wait_until(lambda: "late" in a.status().cluster_nodes)

    seen = wait_until(lambda: _offsets(a).get("late"), what="node0's figure for late")
    assert abs(seen - HOUR) < 60
    assert abs(wait_until(lambda: _offsets(late).get("node0")) + HOUR) < 60
    wait_until(lambda: "node1" in _offsets(a), what="node0's figure for node1")
    assert abs(_offsets(a)["node1"]) < 60
    assert a.status().clock_offset_bound == float(BOUND)  # the flag reached the daemon

    warning = f"WARNING ckptcache.server.cluster.clock: clock of node late is +{seen:.3f} s off"
    wait_until(lambda: warning in a.log(), what="the warning with the figure")
    wait_until(lambda: "clock of node late is +3" in c.log(), what="node1's warning")
    wait_until(lambda: "clock of node node0 is -3" in late.log(), what="the late node's")
    assert "clock of node node1 " not in a.log()  # within the bound: no warning

    cmd = [sys.executable, "-m", "ckptcache.cli", "status", "--socket", a.socket]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "late +3" in out and "BEYOND BOUND" in out and f"(bound {BOUND} s)" in out


def test_the_ntp_estimate_takes_the_round_trip_out():
    """Peer 10 s ahead, 0.2 s out and 0.4 s back, 0.1 s spent on the peer."""
    s = sample_of(t0=100.0, t1=110.2, t2=110.3, t3=100.7)
    assert s.delay == pytest.approx(0.6)
    assert s.offset == pytest.approx(9.9)  # off by half the asymmetry (0.1 s), < delay / 2


def test_one_warning_per_excursion_beyond_the_bound(caplog):
    """Warned when a peer goes beyond the bound, not again at every check while it stays
    there, told when it is back; the figure is kept and exported either way."""
    metrics = Metrics()
    watch = ClockWatch(None, metrics, bound=1.0, interval=60.0, stop=threading.Event())  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="ckptcache.server.cluster.clock")
    for offset in (-2.5, -2.4, 0.2, 3.0):
        watch.record("n1", Sample(offset, 0.001))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "n1 is -2.500 s off" in warnings[0] and "+3.000" in warnings[1]
    assert any("back within 1 s" in r.getMessage() for r in caplog.records)
    assert [(c.node_id, c.offset) for c in watch.offsets()] == [("n1", 3.0)]
    assert (
        metrics.registry.get_sample_value("ckptcache_peer_clock_offset_seconds", {"peer": "n1"})
        == 3.0
    )
