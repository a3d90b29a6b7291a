"""Megatron through the cache: dist_checkpointing at another world size, the legacy path."""

from __future__ import annotations

import pytest

from tests.adapters.conftest import run_script

pytest.importorskip("megatron.core")


def mg(mode, ck, world, *extra, daemon=None, **kw):
    proc = run_script("megatron_worker.py", mode, str(ck), str(world), *extra, daemon=daemon, **kw)
    if not kw.get("expect_kill"):
        assert f"{mode.upper()}-OK" in proc.stdout, proc.stdout
    return proc


def test_dist_checkpointing_save_at_2_load_at_1_and_2_from_memory(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    ck.mkdir()
    mg("dist-save", ck, 2, daemon=d)
    assert not list(ck.glob("*.distcp"))  # only in memory; .metadata/metadata.json on disk
    mg("dist-load", ck, 1, "2", daemon=d)
    mg("dist-load", ck, 2, daemon=d)


def test_dist_checkpointing_persisted_loads_with_stock_strategy(daemon_factory, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    d = daemon_factory("--persist-root", str(tmp_path))
    mg("dist-save", ck, 2, daemon=d)
    with d.client() as c:
        c.wait(prefix=str(ck), timeout=120)
    d.kill()
    mg("dist-load-stock", ck, 1, "2")


def test_legacy_torch_path_crash_resume_then_cache_off(daemon_factory, tmp_path):
    ck = tmp_path / "ck"
    d = daemon_factory("--persist-root", str(tmp_path))
    mg("legacy-crash", ck, 2, daemon=d, expect_kill=True)
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "5"
    mg("legacy-resume", ck, 2, daemon=d)
    with d.client() as c:
        c.wait(prefix=str(ck), timeout=120)
    d.kill()
    for r in (0, 1):
        assert (ck / "iter_0000005" / f"mp_rank_0{r}" / "model_optim_rng.pt").is_file()
    mg("legacy-plain", ck, 2)


def test_legacy_resume_from_memory_only(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    mg("legacy-crash", ck, 2, daemon=d, expect_kill=True)
    assert not list(ck.rglob("*.pt"))
    mg("legacy-resume", ck, 2, daemon=d)
