"""The ckptcache command: tables, --json, exit codes, bad configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import torch

from tests.helpers import wait_until


def cli(daemon, *args):
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    return subprocess.run([sys.executable, "-m", "ckptcache.cli", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip


def test_ls_status_inspect_rm(daemon, tmp_path):
    path = str(tmp_path / "iter_1" / "model.pt")
    with daemon.client() as c:
        c.save({"w": torch.zeros(1 << 18)}, path)
    out = cli(daemon, "ls")
    assert out.returncode == 0 and path in out.stdout and "1.0 MiB" in out.stdout
    listed = json.loads(cli(daemon, "ls", str(tmp_path), "--json").stdout)
    assert [o["path"] for o in listed] == [path]
    assert json.loads(cli(daemon, "ls", "/elsewhere", "--json").stdout) == []
    status = json.loads(cli(daemon, "status", "--json").stdout)
    assert status["daemon"]["objects"] == 1 and status["daemon"]["memory_limit"] == 1 << 30
    assert "memory" in cli(daemon, "status").stdout
    inspect = json.loads(cli(daemon, "inspect", path, "--verify", "--json").stdout)
    assert inspect["verify"]["ok"] is True and inspect["object"]["generation"] == 1
    assert cli(daemon, "rm", path).stdout.startswith("dropped 1 generation")
    missing = cli(daemon, "inspect", path)
    assert missing.returncode == 1 and "not in the memory of node" in missing.stderr


def test_daemon_refuses_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("memory_limit: plenty\n")
    out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "daemon", "--config", str(cfg)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "invalid 'memory_limit'" in out.stderr


def test_second_daemon_on_same_shm_dir_is_refused(daemon, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "daemon", "--shm-dir", daemon.shm_dir,
         "--socket", str(tmp_path / "other.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "another daemon already uses" in out.stderr


def test_metrics_endpoint(daemon_factory, tmp_path):
    d = daemon_factory("--metrics-port", "0", "--memory-limit", "256MiB")
    wait_until(lambda: "metrics=:" in d.log(), 30, "the daemon's ready line")
    port = int(d.log().split("metrics=:")[1].split()[0])
    with d.client() as c:
        c.save({"w": torch.zeros(1000)}, str(tmp_path / "a.pt"))
        c.load(str(tmp_path / "a.pt"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["ckptcache_saves_total"]) == 1
    assert float(samples['ckptcache_loads_total{tier="local"}']) == 1
    assert float(samples["ckptcache_memory_limit_bytes"]) == 256 << 20
    assert float(samples["ckptcache_save_stall_seconds_count"]) == 1
