"""DeepSpeed's own small files of a save through the cache (``latest``, the recovery scripts):
the files DeepSpeed leaves, written without waiting for the disk (see the worker)."""

from __future__ import annotations

import pytest

from tests.e2e.adapters.conftest import run_script

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("how", ["hook", "engine"])
def test_latest_and_recovery_scripts_are_deepspeeds_own(daemon_factory, tmp_path, how):
    """Through the process-wide hook and through ``enable(engine)``: ``latest`` names each
    saved tag (not with ``save_latest=False``) with DeepSpeed's mode and no temporary file
    left; the recovery scripts hold DeepSpeed's bytes, are restored when they differ and not
    rewritten when they do not; DeepSpeed's loader and ``zero_to_fp32`` read back the states
    saved, tensor for tensor."""
    ck = tmp_path / "ck"
    d = daemon_factory("--persist-root", str(ck))
    proc = run_script("ds_files_worker.py", str(ck), how, daemon=d)
    assert "DSFILES-OK" in proc.stdout
