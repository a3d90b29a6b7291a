"""Fixtures of the batch-cache tests: a private cache directory and worker processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir() -> Iterator[str]:
    """A unique directory in /dev/shm (tmpfs, as in production), removed afterwards."""
    path = f"/dev/shm/ckptcache-test-data-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``python -m tests.data._workers ROLE CFG``; every process is killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(role: str, cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.data._workers", role, json.dumps(cfg)],
            cwd=REPO,
            env=env,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
