"""Fixtures of the batch-cache tests that run worker processes; the private cache directory is
the in-process tests' fixture (``tests/data/conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.data.conftest import cache_dir  # noqa: F401 - fixture
from tests.helpers import REPO


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``python -m tests.e2e.data._workers ROLE CFG``; every process is killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(role: str, cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.data._workers", role, json.dumps(cfg)],
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
