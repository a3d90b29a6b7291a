"""Megatron through the cache: dist_checkpointing at another world size, the legacy path."""

from __future__ import annotations

import types

import pytest
import torch

from tests.e2e.adapters.conftest import run_script
from tests.helpers import assert_same

pytest.importorskip("megatron.core")


def mg(mode, ck, world, *extra, daemon=None, **kw):
    proc = run_script("megatron_worker.py", mode, str(ck), str(world), *extra, daemon=daemon, **kw)
    if not kw.get("expect_kill"):
        assert f"{mode.upper()}-OK" in proc.stdout, proc.stdout
    return proc


@pytest.fixture
def local_commit(monkeypatch):
    """The trainers' adapters return after phase 1 (``commit_waits="local"``): what memory
    alone serves is what these tests check."""
    monkeypatch.setenv("CKPTCACHE_COMMIT_WAITS", "local")


def test_dist_checkpointing_save_at_2_load_at_1_and_2_from_memory(
    daemon_factory, tmp_path, local_commit
):
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    ck.mkdir()
    mg("dist-save", ck, 2, daemon=d)
    assert not list(ck.glob("*.distcp"))  # only in memory; .metadata/metadata.json on disk
    mg("dist-load", ck, 1, "2", daemon=d)
    mg("dist-load", ck, 2, daemon=d)


def test_dist_checkpointing_at_the_defaults_loads_with_stock_strategy_at_once(
    daemon_factory, tmp_path
):
    """Default ``commit_waits`` and a memory-only daemon: when ``dist_checkpointing.save``
    returns, megatron-core's own ``torch_dist`` strategy loads the directory, with the daemon
    gone (the files are there, not just in memory)."""
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    ck.mkdir()
    mg("dist-save", ck, 2, daemon=d)
    assert len(list(ck.glob("*.distcp"))) == 2
    d.kill()
    mg("dist-load-stock", ck, 1, "2")


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


def test_legacy_resume_from_memory_only(daemon_factory, tmp_path, local_commit):
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    mg("legacy-crash", ck, 2, daemon=d, expect_kill=True)
    assert not list(ck.rglob("*.pt"))
    mg("legacy-resume", ck, 2, daemon=d)


def test_legacy_file_is_readable_right_after_the_save_at_the_defaults(client, tmp_path):
    """Default ``commit_waits``, a memory-only daemon: Megatron's module-level ``torch.save``
    returns with its file in place (so the tracker written after it names a readable
    iteration), and a plain ``torch.load`` of it, as Megatron's converters do, gets the save."""
    import ckptcache.adapters.megatron as cm

    standin = types.ModuleType("standin_checkpointing")
    standin.torch = torch  # type: ignore[attr-defined]
    cm.enable(standin)
    path = tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    state = {"iteration": 5, "model": {"w": torch.arange(12.0).reshape(3, 4)}}
    standin.torch.save(state, str(path))  # type: ignore[attr-defined]
    assert_same(torch.load(path, weights_only=False), state)
    assert [o.path for o in client.list(str(tmp_path))] == [str(path)]  # through the cache
