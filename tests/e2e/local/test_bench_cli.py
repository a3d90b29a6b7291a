"""``ckptcache bench`` against a real daemon: the JSON shape and a byte-exact reload (speed
itself is for benchmarks/, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptcache.hugepages import huge_policy
from tests.helpers import run_on_terminal

EXPECTED = {
    "memcpy (limit)",
    "ckptcache.save, first (new path)",
    "ckptcache.save, repeated",
    "ckptcache.save, non-blocking (returns)",
    "ckptcache.load, zero-copy",
    "ckptcache.load, private copy",
    "torch.save (local file, CRC off)",
    "torch.load (local file)",
}


def _bench(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ckptcache.cli", "bench", "--socket", daemon.socket, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())


def test_bench_json_reports_every_figure_and_matching_bytes(daemon_factory, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    # The daemon's own defaults: saves under no root are refused, so the bench's cache paths
    # must be memory-only by choice (they are: durability="memory").
    d = daemon_factory("--memory-limit", "256MiB", "--persist-root", str(root), defaults=True)
    out = _bench(d, "--sizes", "8MiB", "--repeats", "1", "--json", "--root", str(root))
    assert out.returncode == 0, out.stderr + out.stdout
    result = json.loads(out.stdout)
    assert result["repeats"] == 1 and result["root"] == str(root)
    assert result["shm_huge_pages"] == huge_policy(d.shm_dir)  # the page size behind the figures
    (entry,) = result["sizes"]
    assert entry["matched"] is True and entry["nbytes"] >= 8 << 20
    rows = {r["what"]: r for r in entry["rows"]}
    assert EXPECTED | {"raw write + fsync (limit)", "ckptcache persist (after save returns)"} == (
        set(rows)
    )
    for r in entry["rows"]:
        assert r["seconds"] > 0 and r["nbytes"] == entry["nbytes"]
        assert (r["vs_limit"] is None) == (r["limit"] == "")
    assert rows["ckptcache persist (after save returns)"]["limit"] == "raw write + fsync"
    assert "\r[" not in out.stderr  # no progress bar where stderr is no terminal
    assert os.listdir(root) == []  # the bench cleans up after itself


def test_bench_draws_its_progress_bar_only_on_a_terminal(daemon_factory):
    """On a terminal the bar reaches its end (five steps: no --root, no peers); in a pipe or
    a file (CI logs) there is none, and the output is the same table."""
    d = daemon_factory("--memory-limit", "128MiB")
    cmd = [sys.executable, "-m", "ckptcache.cli", "bench", "--socket", d.socket,
           "--sizes", "4MiB", "--repeats", "1"]  # fmt: skip
    code, terminal, table = run_on_terminal(cmd, "stderr")
    assert code == 0, terminal + table
    assert "\r[" in terminal and "] 5/5 " in terminal and "| ckptcache.save, repeated |" in table
    piped = _bench(d, "--sizes", "4MiB", "--repeats", "1")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert "| ckptcache.save, repeated |" in piped.stdout


def test_bench_table_and_bad_sizes(daemon_factory):
    d = daemon_factory("--memory-limit", "128MiB")
    out = _bench(d, "--sizes", "4MiB", "--repeats", "1")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "| ckptcache.save, repeated |" in out.stdout and "matched: True" in out.stdout
    assert f"segments on a tmpfs with huge={huge_policy(d.shm_dir)}" in out.stdout
    bad = _bench(d, "--sizes", "lots")
    assert bad.returncode == 2 and "--sizes" in bad.stderr


def test_bench_refuses_at_once_what_it_could_not_measure(daemon_factory, tmp_path):
    """A --root the daemon does not persist to, or a size over its budget: a clear error
    before any measurement, never a table without the persist row."""
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    d = daemon_factory("--memory-limit", "64MiB", "--persist-root", str(root), defaults=True)
    out = _bench(d, "--sizes", "1MiB", "--root", str(elsewhere))
    assert out.returncode == 2 and out.stdout == ""
    assert f"--root {elsewhere}: the daemon does not persist there" in out.stderr
    assert f"its persist roots: {root}" in out.stderr and "\r[" not in out.stderr  # no bar
    assert os.listdir(elsewhere) == [] and os.listdir(root) == []
    with d.client() as c:
        assert c.list() == []  # the probe is gone
    big = _bench(d, "--sizes", "48MiB", "--json")
    error = json.loads(big.stdout)["error"]
    assert big.returncode == 2 and error["type"] == "ConfigError"
    assert error["message"].startswith("--sizes 48.0 MiB: the bench holds 2 copies")
    assert "64.0 MiB budget" in error["message"] and "\r[" not in big.stderr
    # A daemon that keeps the path in memory only (--memory-only allow) is refused as well.
    m = daemon_factory("--memory-limit", "64MiB", "--memory-only", "allow")
    out = _bench(m, "--sizes", "1MiB", "--root", str(elsewhere))
    assert out.returncode == 2 and "the daemon does not persist there" in out.stderr
    assert "its persist roots: none" in out.stderr and os.listdir(elsewhere) == []


CLUSTER_ROWS = {
    "raw socket, loopback TCP (limit)",
    "ckptcache.save, durability=backup",
    "backup copy (backup save - local save)",
    "ckptcache.load from a peer",
}


def test_bench_on_a_cluster_node_measures_the_backup_copy_and_a_peer_load(cluster_factory):
    """Two real daemons on a real etcd: the bench adds the cluster rows, each next to the raw
    socket, and the peer load really came from the peer."""
    # No orphan sweep: the bench removes its work directory when it ends, and a sweep on the
    # peer would then drop the backup copies whose survival the last line checks.
    a, b = cluster_factory(2, config="orphan_sweep: 0\n")
    out = _bench(a, "--sizes", "4MiB", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr + out.stdout  # --json: an error is on stdout
    result = json.loads(out.stdout)
    assert sorted(result["cluster_nodes"]) == ["node0", "node1"]
    (entry,) = result["sizes"]
    assert entry["matched"] is True
    rows = {r["what"]: r for r in entry["rows"]}
    assert set(rows) == EXPECTED | CLUSTER_ROWS  # "from a peer": no other tier served it
    for what in CLUSTER_ROWS - {"raw socket, loopback TCP (limit)"}:
        r = rows[what]
        assert r["limit"] == "raw socket" and r["seconds"] > 0 and r["vs_limit"] > 0
        assert r["limit_seconds"] == rows["raw socket, loopback TCP (limit)"]["seconds"] > 0
        assert r["nbytes"] == entry["nbytes"]
    assert "\r[" not in out.stderr  # no progress bar where stderr is no terminal
    with a.client() as ca, b.client() as cb:
        assert ca.list() == []  # the bench dropped what it cached on its node
        # A delete is local: the peer keeps its backup copies until they are evicted.
        assert {o.origin for o in cb.list()} == {"node0"}
