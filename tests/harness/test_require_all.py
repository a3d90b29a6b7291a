"""The suite cannot pass with a required area skipped: only GPU tests may skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SAMPLE = """
import pytest

def test_runs():
    pass

def test_needs_etcd():
    pytest.skip("etcd not installed")

@pytest.mark.gpu
def test_needs_cuda():
    pytest.skip("needs a CUDA device")

@pytest.mark.xfail(reason="known")
def test_known_bug():
    raise AssertionError
"""


def _pytest(tmp_path: Path, require: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_missing_package.py").write_text(
        "import pytest\npytest.importorskip('no_such_framework')\n\ndef test_x():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTCACHE_REQUIRE_ALL": require}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests._require_all",
         "-ra", "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_skips_fail_when_every_area_is_required(tmp_path):
    out = _pytest(tmp_path, "1")
    assert out.returncode == 1, out.stdout
    assert "FAILED test_sample.py::test_needs_etcd" in out.stdout
    assert "etcd not installed" in out.stdout and "CKPTCACHE_REQUIRE_ALL is set" in out.stdout
    assert "ERROR test_missing_package.py" in out.stdout  # a module-level importorskip
    assert "SKIPPED [1] test_sample.py" in out.stdout and "needs a CUDA device" in out.stdout
    assert "1 passed" in out.stdout and "1 xfailed" in out.stdout


def test_skips_are_allowed_otherwise(tmp_path):
    out = _pytest(tmp_path, "")
    assert out.returncode == 0, out.stdout
    assert "1 passed, 3 skipped, 1 xfailed" in out.stdout
