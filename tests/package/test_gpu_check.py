"""``scripts/gpu-check.sh`` without a CUDA device: one clear line, exit 0 (CI has no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: it would run")
def test_without_a_gpu_it_says_what_it_skipped_and_succeeds():
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"gpu-check: no CUDA device visible to {sys.executable}: skipped the CUDA tests and "
        "the GPU figures"
    ]
