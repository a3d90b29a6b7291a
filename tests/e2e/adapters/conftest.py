"""Fixtures for the framework adapter tests: trainer scripts run in their own processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ``TORCH_EXTENSIONS_DIR`` for every trainer this run starts.

    Nothing should be compiled (the DeepSpeed trainers disable the ops that would be), and if
    something ever is, it neither waits on nor corrupts the shared ``~/.cache/torch_extensions``
    lock of other runs on the machine.
    """
    path = tmp_path_factory.mktemp("torch_extensions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(path))
        yield path


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_env(daemon: DaemonProc | None) -> dict[str, str]:
    """Environment of a trainer process that talks to ``daemon`` (or to none)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["CKPTCACHE_SOCKET"] = daemon.socket if daemon else "/nonexistent/ckptcache.sock"
    return env


def run_script(
    name: str,
    *args: str,
    daemon: DaemonProc | None = None,
    expect_kill: bool = False,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``args``; a trainer that should die by SIGKILL may."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], env=daemon_env(daemon), text=True,
        capture_output=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    if expect_kill:
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "CHECKPOINT-SAVED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return proc


@pytest.fixture
def script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``script(name, *args, daemon=..., expect_kill=...)``: run a trainer script."""
    return run_script
