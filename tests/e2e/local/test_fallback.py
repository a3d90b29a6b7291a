"""No daemon: saves write through, loads read the file, strict clients raise."""

from __future__ import annotations

import errno
import threading
import warnings
from typing import Any

import pytest
import torch

import ckptcache
from ckptcache.errors import (
    CheckpointNotFound,
    CkptCacheWarning,
    DaemonUnavailable,
    TensorMutated,
)


def test_no_daemon_write_through_and_file_fallback(tmp_path):
    with ckptcache.Client(str(tmp_path / "nobody.sock")) as c:
        path = tmp_path / "x.pt"
        with pytest.warns(CkptCacheWarning, match="straight to storage"):
            c.save({"w": torch.arange(4.0)}, path)
        assert torch.equal(torch.load(path)["w"], torch.arange(4.0))
        assert torch.equal(c.load(path)["w"], torch.arange(4.0))
        assert c.exists(path) and c.status(path).stages == ("storage",)
        with pytest.raises(CheckpointNotFound):
            c.load(tmp_path / "missing.pt")


def test_strict_client_raises_daemon_unavailable(tmp_path):
    with ckptcache.Client(str(tmp_path / "nobody.sock"), fallback="raise") as c:
        with pytest.raises(DaemonUnavailable, match="ckptcache daemon") as err:
            c.save({"w": torch.ones(1)}, tmp_path / "x.pt")
        assert isinstance(err.value, ConnectionError)
        with pytest.raises(DaemonUnavailable):
            c.delete(tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_daemon_gone_between_calls(daemon, tmp_path):
    with daemon.client() as c:
        c.save({"w": torch.ones(2)}, tmp_path / "a.pt")
        daemon.kill()
        with pytest.warns(CkptCacheWarning):
            c.save({"w": torch.zeros(2)}, tmp_path / "b.pt")
        assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.zeros(2))
        daemon.start()
        assert torch.equal(c.load(tmp_path / "a.pt")["w"], torch.ones(2))  # reconnects


@pytest.mark.parametrize("mutate", ["add_", "resize_"])
def test_write_through_of_a_mutated_non_blocking_save_keeps_file_and_generations(
    daemon_factory, tmp_path, mutate
):
    d = daemon_factory("--memory-limit", "4MiB", "--pool-bytes", "0")
    path = str(tmp_path / "m.pt")
    torch.save({"w": torch.zeros(4)}, path)  # an older checkpoint on storage
    with d.client() as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", CkptCacheWarning)
        c.save({"w": torch.ones(4)}, path)  # the newest generation, cached
        big = torch.zeros(2 << 20)  # 8 MiB: larger than the budget, so written through
        with c._connection.lock:  # the background save cannot start before the trainer "steps"
            handle = c.save({"w": big}, path, blocking=False)
            if mutate == "add_":  # broken contract
                big.add_(1.0)
            else:  # freed, as FSDP does: no version counter bump
                big.untyped_storage().resize_(0)
        with pytest.raises(TensorMutated):
            handle.wait()
        assert c.fallbacks == 1
        assert torch.equal(torch.load(path)["w"], torch.zeros(4))  # the file is untouched
        assert c.status(path).generation == 1  # and the cached generation not superseded
        assert torch.equal(c.load(path)["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("m.pt")) == ["m.pt"]


def test_failed_write_through_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(4)}, path)
    real_save = torch.save

    def disk_full(obj: Any, f: Any, *args: Any, **kw: Any) -> None:
        real_save({"torn": torch.ones(1)}, f)  # some bytes reach the file, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with ckptcache.Client(str(tmp_path / "nobody.sock")) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", CkptCacheWarning)
        with pytest.raises(OSError, match="No space"):
            c.save({"w": torch.ones(4)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["w"], torch.zeros(4))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("x.pt")] == ["x.pt"]


def test_commit_failure_after_the_copy_writes_what_was_copied(daemon, tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    with daemon.client() as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", CkptCacheWarning)
        at_commit, stepped = threading.Event(), threading.Event()
        request = c._connection.request

        def daemon_dies_at_commit(kind: str, *args: Any) -> Any:
            if kind == "commit":
                at_commit.set()
                stepped.wait()
                daemon.kill()
            return request(kind, *args)

        monkeypatch.setattr(c._connection, "request", daemon_dies_at_commit)
        w = torch.zeros(1 << 20)
        handle = c.save({"w": w, "step": 1}, path, blocking=False)
        at_commit.wait()
        assert handle.copied()
        w.add_(7.0)  # the optimizer step: allowed once copied
        stepped.set()
        handle.wait()  # written through instead
        assert c.fallbacks == 1
    saved = torch.load(path)
    assert torch.equal(saved["w"], torch.zeros(1 << 20)) and saved["step"] == 1
