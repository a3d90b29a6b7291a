"""Phase 2 against a real directory and a real S3 endpoint: atomic, retried, restart-proof."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from ckptcache.errors import PathNotAllowed, PersistError
from ckptcache.storage.fs import TEMP_MARK
from tests.helpers import assert_same, read_only_dir, wait_until


def config(tmp_path, **extra) -> str:
    """A daemon config with quick retries (and anything else given)."""
    lines = {"persist_retries": 3, "persist_backoff": 0.1, "persist_backoff_max": 0.5, **extra}
    path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
    return str(path)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 512, generator=g), "step": seed, "t": torch.arange(10).t()}


def debris(root):
    return [p for p in root.rglob("*") if TEMP_MARK in p.name]


def test_persisted_file_is_a_plain_torch_save_archive(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "run7" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt"
    with d.client() as c:
        c.save(state(1), path)
        c.wait(path)
        assert_same(state(1), torch.load(path, weights_only=True))  # no ckptcache involved
        st = c.status(path)
        assert st.stages == ("local", "persisted") and st.persist_state == "persisted"
        c.delete(path)  # drop the memory copy: the next load reads storage
        assert_same(state(1), c.load(path))
        c.save(state(2), path, durability="persisted")  # returns only once on storage
        assert torch.load(path)["step"] == 2
        c.wait()  # everything this client saved
    assert debris(root) == []


def test_read_only_directory_fails_then_reports_and_keeps_memory_copy(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    target_dir = root / "iter_1"
    target_dir.mkdir(parents=True)
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = target_dir / "model.pt"
    with d.client() as c, read_only_dir(target_dir):
        c.save(state(3), path)
        with pytest.raises(PersistError, match="PermissionError") as err:
            c.wait(path, timeout=60)
        assert isinstance(err.value, OSError)
        st = c.status(path)
        assert st.persist_state == "failed" and "gave up after 4 attempts" in st.persist_error
        assert_same(state(3), c.load(path))  # never evicted, still loadable
    assert not path.exists() and debris(root) == []
    with d.client() as c:
        c.save(state(4), path)  # the directory is writable again
        c.wait(path, timeout=60)
    assert torch.load(path)["step"] == 4


def test_transient_failure_is_retried_until_it_succeeds(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    cfg = config(tmp_path, persist_retries=20, persist_backoff=0.2, persist_backoff_max=0.5)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    with d.client() as c:
        with read_only_dir(root):
            c.save(state(5), root / "m.pt")
            wait_until(lambda: c.status(root / "m.pt").persist_error)  # an attempt failed
            assert c.status(root / "m.pt").persist_state == "persisting"  # and is retried
        c.wait(root / "m.pt", timeout=60)
    assert torch.load(root / "m.pt")["step"] == 5
    assert "attempt 1 of 21" in d.log()


def test_s3_round_trip_and_endpoint_outage(daemon_factory, tmp_path, s3_server, s3_bucket):
    root = f"s3://{s3_bucket}/run7"
    cfg = config(tmp_path, persist_retries=30, persist_backoff=0.2, persist_backoff_max=0.5)
    d = daemon_factory("--persist-root", root, "--config", cfg,
                       "--s3-endpoint-url", s3_server.endpoint)  # fmt: skip
    s3 = s3_server.client()
    with d.client() as c:
        c.save(state(6), f"{root}/iter_1/model.pt", durability="persisted")
        body = s3.get_object(Bucket=s3_bucket, Key="run7/iter_1/model.pt")["Body"].read()
        assert_same(state(6), torch.load(io.BytesIO(body)))
        s3_server.stop()
        try:
            c.save(state(7), f"{root}/iter_2/model.pt")
            wait_until(lambda: c.status(f"{root}/iter_2/model.pt").persist_error)  # failing
            assert c.status(f"{root}/iter_2/model.pt").persist_state == "persisting"
        finally:
            s3_server.restart()
        c.wait(f"{root}/iter_2/model.pt", timeout=60)
        c.delete(f"{root}/iter_2/model.pt")
        assert_same(state(7), c.load(f"{root}/iter_2/model.pt"))  # read back from S3
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_daemon_killed_mid_persist_finishes_after_restart(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    target_dir = root / "iter_9"
    target_dir.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = target_dir / "model.pt"
    with read_only_dir(target_dir):
        with d.client() as c:
            c.save(state(8), path)
            wait_until(lambda: c.status(path).persist_error)  # mid-persist: retrying
            assert c.status(path).persist_state == "persisting"
        d.kill()  # SIGKILL while the persist is being retried
    d.start()
    with d.client() as c:
        c.wait(path, timeout=60)
        assert c.status(path).persist_state == "persisted"
    assert_same(state(8), torch.load(path))
    assert "re-queueing unpersisted" in d.log()
    assert debris(root) == []


def test_allowed_roots(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "link").symlink_to(elsewhere)
    d = daemon_factory("--persist-root", str(root), "--memory-only", "refuse")
    with d.client() as c:
        with pytest.raises(PathNotAllowed, match="through a symlink"):
            c.save(state(), root / "link" / "x.pt")
        with pytest.raises(PathNotAllowed, match="under no storage root of this daemon"):
            c.save(state(), elsewhere / "x.pt")
        with pytest.raises(PathNotAllowed, match=r"contains '\.\.'"):
            c.save(state(), f"{root}/../elsewhere/y.pt")  # '..' is refused, never resolved
        with pytest.raises(PathNotAllowed, match=r"'\.\.'"):
            c.save(state(), "s3://bucket/run/../../etc/x.pt")
        assert c.list() == []
    assert list(elsewhere.iterdir()) == []


def test_memory_only_objects_say_so(daemon_factory, tmp_path):
    d = daemon_factory("--persist-root", str(tmp_path / "ckpt"))
    path = tmp_path / "scratch" / "x.pt"
    with d.client() as c:
        c.save(state(), path)
        assert c.status(path).persist_state == "memory-only"
        with pytest.raises(PathNotAllowed, match="memory only"):
            c.wait(path)
        c.wait()  # waiting for everything skips memory-only objects
    assert not path.exists()


def test_unpersisted_generations_are_never_evicted(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.2,
                 reserve_timeout=0.5, memory_limit="12MiB")  # fmt: skip
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    blob = {"w": torch.zeros((5 << 20) // 4 - 1024)}
    done = threading.Event()
    with d.client() as c:
        with read_only_dir(root):
            c.save(blob, root / "a.pt")
            c.save(blob, root / "b.pt")
            with pytest.warns(UserWarning, match="straight to storage"):
                c.save(blob, tmp_path / "c.pt")  # no room: a and b are not persisted yet
            assert {o.path for o in c.list()} == {str(root / "a.pt"), str(root / "b.pt")}
            done.set()
        c.wait(timeout=60)
        # Persisted, and the workers' pins dropped just after: evictable now.
        wait_until(lambda: c.daemon_status().pinned == 0, what="the persist pins dropped")
        c.save(blob, root / "d.pt")  # now a persisted generation can be evicted
        assert str(root / "d.pt") in {o.path for o in c.list()}
    assert done.is_set() and (root / "a.pt").exists() and (root / "b.pt").exists()
