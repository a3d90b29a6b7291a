"""The scale simulation's quick mode on a real etcd: invariants only, never timings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

BENCH = REPO / "benchmarks" / "scale" / "bench.py"


@pytest.mark.timeout(600)
def test_quick_simulation_keeps_the_invariants(tmp_path: Path) -> None:
    """64 simulated nodes on the daemon's etcd coordinator: every restart wave reads storage
    exactly once per group, every save wave (one with 1% of the nodes killed) persists each
    group exactly once, and the killed representatives are taken over."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        # The daemon's default 5 s TTL: shorter leases lapse when this shared host stalls the
        # simulator's keep-alive threads, and a lapsed storage reader is rightly replaced.
        [sys.executable, str(BENCH), "--quick", "--window", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=540, cwd=REPO,
    )  # fmt: skip
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["violations"] == [], proc.stderr[-4000:]
    assert proc.returncode == 0
    (res,) = report["results"]
    assert res["nodes"] == 64
    for wave in res["restart"]:
        assert wave["planned"] == wave["nodes"] == 64
        assert wave["storage_reads"] == {"min": 1, "max": 1}
    for wave in [*res["save"], res["failures"]]:
        assert wave["finished"] and wave["errors"] == []
        assert (wave["zero_persists"], wave["double_persists"]) == (0, 0)
    failures = res["failures"]
    assert failures["killed"] >= 1 and failures["killed_reps"] >= 1
    assert len(failures["takeovers_s"]) == failures["killed_reps"]
    # Requests are counted at the client and by etcd itself: the two counts agree (but for
    # requests in flight at the edges of the window).
    steady = res["steady"]
    assert abs(steady["requests"] - steady["etcd_requests"]) <= max(5, steady["requests"] // 20)
