"""No daemon: saves write through, loads read the file, strict clients raise."""

from __future__ import annotations

import pytest
import torch

import ckptcache
from ckptcache.errors import CheckpointNotFound, CkptCacheWarning, DaemonUnavailable


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
