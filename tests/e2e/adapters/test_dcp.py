"""torch.distributed.checkpoint through the cache: resharding, async staging, failures."""

from __future__ import annotations

import pickle

import pytest

from tests.e2e.adapters.conftest import run_script


def dcp_run(mode, ck, world, daemon=None):
    proc = run_script("dcp_worker.py", mode, str(ck), str(world), daemon=daemon)
    assert f"{mode.upper()}-OK" in proc.stdout, proc.stdout
    return proc


def test_save_at_4_load_at_2_from_memory(daemon_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCACHE_COMMIT_WAITS", "local")  # the writers return after phase 1
    d = daemon_factory("--memory-limit", "1GiB")  # memory only: nothing but .metadata on disk
    ck = tmp_path / "ck"
    dcp_run("save", ck, 4, d)
    assert sorted(p.name for p in ck.iterdir()) == [".metadata"]
    dcp_run("load", ck, 2, d)


def test_persisted_directory_is_a_plain_dcp_checkpoint(daemon_factory, tmp_path):
    ck = tmp_path / "ck"
    d = daemon_factory("--persist-root", str(tmp_path))
    dcp_run("save", ck, 4, d)
    with d.client() as c:
        c.wait(prefix=str(ck), timeout=120)
    names = sorted(p.name for p in ck.iterdir())
    assert ".metadata" in names and all(
        n == ".metadata" or (n.startswith("__") and n.endswith(".distcp")) for n in names
    ), names
    meta = pickle.loads((ck / ".metadata").read_bytes())
    assert {s.relative_path for s in meta.storage_data.values()} == set(names) - {".metadata"}
    d.kill()  # cache gone: DCP's own FileSystemReader reads it, at another world size
    dcp_run("loadfs", ck, 2)


def test_async_save_stages_through_the_cache(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "1GiB")
    ck = tmp_path / "ck"
    dcp_run("asyncsave", ck, 2, d)
    dcp_run("load", ck, 2, d)


def test_async_save_without_a_daemon_stages_plain_copies(tmp_path):
    ck = tmp_path / "ck"
    dcp_run("asyncsave", ck, 2)  # no daemon: staged in private copies, written through
    dcp_run("loadfs", ck, 2)  # a plain DCP checkpoint, from the state at the call


def test_storage_failures_in_every_phase(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "1GiB")
    proc = dcp_run("failures", tmp_path / "ck", 2, d)
    for phase in ("prepare_local_plan", "prepare_global_plan", "write_data", "finish"):
        assert f"WRITER-{phase}-CLEAN" in proc.stdout
    for phase in ("read_metadata", "prepare_local_plan", "prepare_global_plan", "read_data"):
        assert f"READER-{phase}-CLEAN" in proc.stdout


pytest.importorskip("torch.distributed.checkpoint")
