"""Real processes: SIGKILL mid-epoch and restart, one shared copy for many readers, a dead
loading rank. Timeouts here are safety nets; the assertions are on results."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

import pytest

from ckptcache.data import CachedDataLoader
from ckptcache.errors import ConfigError
from tests.data._dataset import SeqLoader, batch_digest, make_batch
from tests.e2e.data._helpers import read_json
from tests.helpers import wait_until

Spawn = Callable[[str, dict[str, Any]], "Popen[bytes]"]


def _log(path: Path) -> list[tuple[int, int, str]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(e), int(s), d) for e, s, d in rows]


def test_sigkill_mid_epoch_then_restart_is_exact(
    cache_dir: str, tmp_path: Path, spawn: Spawn
) -> None:
    n, epochs = 10, 2
    cfg = {
        "cache_dir": cache_dir, "run_id": "job", "n": n, "epochs": epochs, "prefetch": 4,
        "item_delay": 0.005, "step_delay": 0.05, "state": str(tmp_path / "state.json"),
    }  # fmt: skip
    first = spawn("trainer", {**cfg, "log": str(tmp_path / "first.log")})
    wait_until(lambda: len(_log(tmp_path / "first.log")) >= 13, what="13 training steps")
    first.send_signal(signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    state = read_json(tmp_path / "state.json")
    resume = (state["epoch"], state["step"])
    assert resume > (1, 0)  # killed mid-way through the second epoch

    # The restarted trainer's real loader cannot even be created until it has trained on 3
    # batches: those must come from the cache its dead predecessor filled.
    gate = str(tmp_path / "gate")
    second = spawn(
        "trainer",
        {**cfg, "log": str(tmp_path / "second.log"), "resume": True, "gate": gate,
         "open_gate_after": 3},
    )  # fmt: skip
    assert second.wait(60) == 0
    before = [row for row in _log(tmp_path / "first.log") if row[:2] < resume]
    after = _log(tmp_path / "second.log")
    assert after[0][:2] == resume
    reference = [(e, i, batch_digest(make_batch(e, i))) for e in range(epochs) for i in range(n)]
    assert before + after == reference
    assert not os.path.exists(os.path.join(cache_dir, "job"))  # clean exit removed it


def _mapped(pid: int, paths: list[str]) -> dict[str, int]:
    """Rss, Pss and private bytes of ``pid``'s mappings of the files ``paths``."""
    totals = {"Rss": 0, "Pss": 0, "Private_Clean": 0, "Private_Dirty": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = any(path in line for path in paths)
            elif inside:
                key, _, value = line.partition(":")
                if key in totals:
                    totals[key] += int(value.split()[0]) * 1024
    return totals


def test_readers_share_one_copy(cache_dir: str, tmp_path: Path, spawn: Spawn) -> None:
    hold, numel = 6, 1 << 20  # six batches of 4 MiB each, held by every process
    data = hold * numel * 4
    stop = str(tmp_path / "stop")
    cfg = {
        "cache_dir": cache_dir, "run_id": "shared", "n": 100, "numel": numel,
        "prefetch": hold, "lookback": hold, "hold": hold, "stop": stop,
    }  # fmt: skip
    procs = [spawn("holder", {**cfg, "loading": True, "report": str(tmp_path / "r0.json")})]
    procs += [
        spawn("holder", {**cfg, "loading": False, "report": str(tmp_path / f"r{i}.json")})
        for i in range(1, 5)
    ]
    reports = [
        wait_until(lambda i=i: read_json(tmp_path / f"r{i}.json"), 60, f"holder {i}")
        for i in range(5)
    ]
    try:
        assert len({r["sum"] for r in reports}) == 1  # all five saw the same data
        run_dir = os.path.join(cache_dir, "shared", "train")
        # Only the held batches: the loading rank may be writing a later one right now.
        held = [os.path.join(run_dir, f"e000000-s{i:012d}.batch") for i in range(hold)]
        usage = [_mapped(r["pid"], held) for r in reports]
        held_files = sum(os.path.getsize(path) for path in held)
    finally:
        open(stop, "w").close()
    for proc in procs:
        assert proc.wait(30) == 0
    assert data <= held_files < 1.01 * data  # one copy of the held batches in tmpfs
    for u in usage[1:]:  # each reader really maps all of it ...
        assert u["Rss"] >= 0.99 * data
        assert u["Private_Clean"] + u["Private_Dirty"] < 0.01 * data  # ... none of it private
    # Proportional set sizes add up to one copy (five processes), not five copies.
    assert 0.9 * data < sum(u["Pss"] for u in usage) < 1.1 * data


def test_dead_loading_rank_fails_readers_fast(cache_dir: str, tmp_path: Path, spawn: Spawn) -> None:
    cfg = {
        "cache_dir": cache_dir, "run_id": "dies", "n": 1000, "epochs": 1, "prefetch": 2,
        "item_delay": 0.1, "timeout": 45.0,
    }  # fmt: skip
    loading = spawn(
        "trainer", {**cfg, "log": str(tmp_path / "loading.log"), "state": str(tmp_path / "s")}
    )
    wait_until(lambda: _log(tmp_path / "loading.log"), 60, "the loading rank's first step")
    reader = spawn(
        "reader",
        {**cfg, "report": str(tmp_path / "reader.json"), "ready": str(tmp_path / "ready"),
         "ready_after": 1},
    )  # fmt: skip
    wait_until(lambda: os.path.exists(tmp_path / "ready"), 60, "the reader's first batch")
    loading.send_signal(signal.SIGKILL)
    assert loading.wait(30) == -signal.SIGKILL
    assert reader.wait(60) == 0  # it returned (with a report), it did not hang
    report = read_json(tmp_path / "reader.json")
    assert report["types"][:3] == ["LoaderDied", "BatchTimeout", "CkptCacheError"]
    assert "TimeoutError" in report["types"]
    assert report["pid"] == loading.pid
    assert f"pid {loading.pid}" in report["message"]
    assert report["got"] >= 1


def test_a_live_loading_rank_excludes_others_even_before_its_lease_is_seen(
    cache_dir: str, tmp_path: Path, spawn: Spawn
) -> None:
    cfg = {
        "cache_dir": cache_dir, "run_id": "job", "n": 8, "numel": 8, "prefetch": 2,
        "hold": 1, "stop": str(tmp_path / "stop"), "report": str(tmp_path / "r.json"),
        "loading": True, "fork": True,
    }  # fmt: skip
    first = spawn("holder", cfg)
    report = wait_until(lambda: read_json(tmp_path / "r.json"), 60, "the first loading rank")
    try:
        # A second loading rank that looked before the first wrote its lease finds none; it
        # must still be refused (it would otherwise write the same batch files).
        os.unlink(os.path.join(cache_dir, "job", "train", "owner"))
        with pytest.raises(ConfigError, match=r"already has a live loading rank \(another"):
            CachedDataLoader(lambda: SeqLoader(8, 8), cache_dir=cache_dir, run_id="job")
        # Its death frees the place at once, although its forked child still lives.
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
        os.kill(report["child"], 0)  # (raises if it is gone)
        with CachedDataLoader(
            lambda: SeqLoader(8, 8), cache_dir=cache_dir, run_id="job", start_step=0
        ) as dl:
            assert [batch_digest(b) for b in dl] == [
                batch_digest(make_batch(0, i, 8)) for i in range(8)
            ]
    finally:
        os.kill(report["child"], signal.SIGKILL)


def test_a_dead_runs_failure_marker_does_not_fail_the_restart(
    cache_dir: str, tmp_path: Path, spawn: Spawn
) -> None:
    cfg = {"cache_dir": cache_dir, "run_id": "job", "n": 6, "numel": 8, "prefetch": 2}
    # First incarnation: the real loader raises (a transient error), the process exits.
    first = spawn(
        "trainer",
        {**cfg, "epochs": 1, "fail_at": 3, "log": str(tmp_path / "first.log"),
         "state": str(tmp_path / "state.json")},
    )  # fmt: skip
    assert first.wait(60) != 0
    assert os.path.exists(os.path.join(cache_dir, "job", "train", "failed"))
    # Restart: a reader that comes up before the new loading rank waits for it; the old
    # failure is not its loading rank's.
    reader = CachedDataLoader(
        None, cache_dir=cache_dir, run_id="job", is_loading_rank=False, timeout=30
    )
    stop = str(tmp_path / "stop")
    second = spawn(
        "holder",
        {**cfg, "loading": True, "hold": 6, "stop": stop, "report": str(tmp_path / "r.json")},
    )  # fmt: skip
    try:
        got = [batch_digest(b) for b in reader]
    finally:
        open(stop, "w").close()
    assert got == [batch_digest(make_batch(0, i, 8)) for i in range(6)]
    reader.close()
    assert second.wait(30) == 0


def test_readers_a_little_behind_finish_when_the_loading_rank_closes(
    cache_dir: str, tmp_path: Path, spawn: Spawn
) -> None:
    cfg = {"cache_dir": cache_dir, "run_id": "job", "n": 6, "numel": 8, "timeout": 20.0}
    # The reader is there first (as when all ranks start together) and lags at the end.
    reader = spawn(
        "reader", {**cfg, "report": str(tmp_path / "reader.json"), "linger_after": 6,
                   "linger": 1.0},
    )  # fmt: skip
    wait_until(lambda: os.listdir(os.path.join(cache_dir, "job", "train")), 60, "the reader")
    loading = spawn(
        "trainer",
        {**cfg, "epochs": 1, "log": str(tmp_path / "loading.log"),
         "state": str(tmp_path / "state.json")},
    )  # fmt: skip
    assert loading.wait(60) == 0  # trained its epoch and closed: the normal end of training
    assert reader.wait(60) == 0
    assert read_json(tmp_path / "reader.json") == {
        "types": [], "message": "", "pid": None, "got": 6,
    }  # fmt: skip
    assert [row[:2] for row in _log(tmp_path / "loading.log")] == [(0, i) for i in range(6)]
    assert not os.path.exists(os.path.join(cache_dir, "job"))  # and close() still cleaned up
