"""A missing daemon is visible: status(), the adapters' enable(), counted and logged fallbacks,
and CKPTCACHE_REQUIRE=1 to fail fast instead of writing through."""

from __future__ import annotations

import logging

import pytest
import torch

import ckptcache
import ckptcache.adapters.dcp as cdcp
from ckptcache import DaemonUnavailable

NO_DAEMON = "/nonexistent/ckptcache.sock"


@pytest.fixture
def no_daemon(monkeypatch):
    """The process default client points at a socket nobody serves."""
    monkeypatch.setenv("CKPTCACHE_SOCKET", NO_DAEMON)
    ckptcache.api.set_default_client(None)
    yield
    ckptcache.api.set_default_client(None)
    cdcp.disable()


def test_status_says_whether_the_cache_is_reachable(no_daemon, daemon, monkeypatch):
    off = ckptcache.status()
    assert isinstance(off, ckptcache.CacheStatus)
    assert not off.reachable and off.socket == NO_DAEMON and off.daemon is None
    assert "no ckptcache daemon" in off.error and "NOT reachable" in off.describe()
    monkeypatch.setenv("CKPTCACHE_SOCKET", daemon.socket)
    ckptcache.api.set_default_client(None)
    ckptcache.save({"w": torch.ones(4)}, "/tmp/ckptcache-visibility-probe.pt")
    on = ckptcache.status()
    assert on.reachable and on.error == "" and on.fallbacks == 0
    assert on.daemon is not None and on.daemon.memory_stored > 0
    assert on.daemon.memory_stored <= on.daemon.memory_used  # stored vs reserved
    ckptcache.delete("/tmp/ckptcache-visibility-probe.pt")


def test_fallbacks_are_counted_and_logged_every_n(no_daemon, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CKPTCACHE_FALLBACK_LOG_EVERY", "3")
    caplog.set_level(logging.WARNING, logger="ckptcache.client")
    with pytest.warns(ckptcache.CkptCacheWarning) as warned:
        for i in range(7):
            ckptcache.save({"i": torch.tensor(i)}, tmp_path / f"{i}.pt")
    assert len(warned) == 1  # the first; the repeats go to the log
    # Training went on: every save is a plain torch.save file.
    assert [int(torch.load(tmp_path / f"{i}.pt")["i"]) for i in range(7)] == list(range(7))
    assert ckptcache.status().fallbacks == 7
    lines = [r.getMessage() for r in caplog.records if "written through" in r.getMessage()]
    # One message per write-through reported: the first was the warning, never a log line too.
    assert [line.split()[1] for line in lines] == ["3", "6"], lines


def test_adapter_enable_reports_reachability(no_daemon, daemon, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ckptcache.adapters")
    off = cdcp.enable()
    assert not off.reachable
    assert any("DCP checkpoints: cache NOT reachable" in r.getMessage() for r in caplog.records)
    on = cdcp.enable(client=daemon.client())
    assert on.reachable and on.socket == daemon.socket


def test_require_fails_fast_without_a_daemon(no_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCACHE_REQUIRE", "1")
    ckptcache.api.set_default_client(None)
    with pytest.raises(DaemonUnavailable, match="no ckptcache daemon"):
        ckptcache.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists()
    assert ckptcache.status().fallback == "raise"
    with pytest.raises(DaemonUnavailable, match="DCP checkpoints"):
        cdcp.enable()
    assert ckptcache.Client(NO_DAEMON, fallback="write-through").fallback == "write-through"


@pytest.mark.parametrize("commit_waits", ["persisted", "files"])
def test_commit_waits_without_a_daemon_is_a_written_through_checkpoint(
    no_daemon, tmp_path, commit_waits
):
    """No daemon, fallback write-through: every adapter's commit point accepts the file the
    client wrote through (there is no daemon to ask, and the file exists), so the save
    completes as a plain checkpoint instead of raising DaemonUnavailable."""
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.full((4, 4), 3.0)}
    ck = tmp_path / "dcp"
    with pytest.warns(ckptcache.CkptCacheWarning):
        dcp.save(sd, storage_writer=cdcp.CacheWriter(ck, commit_waits=commit_waits))
    assert (ck / ".metadata").exists()
    back = {"w": torch.zeros(4, 4)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(ck))
    assert torch.equal(back["w"], sd["w"])


@pytest.mark.parametrize("commit_waits", ["persisted", "files"])
def test_megatron_and_deepspeed_commit_without_a_daemon(no_daemon, tmp_path, commit_waits):
    """The same for Megatron's legacy torch.save and DeepSpeed's engine commit."""
    import types

    pytest.importorskip("megatron.core")
    pytest.importorskip("deepspeed")
    import ckptcache.adapters.megatron as cmegatron
    from ckptcache.adapters.deepspeed import CkptCacheCheckpointEngine

    standin = types.ModuleType("standin_checkpointing")
    standin.torch = torch  # type: ignore[attr-defined]
    cmegatron.enable(standin, commit_waits=commit_waits)
    with pytest.warns(ckptcache.CkptCacheWarning):
        standin.torch.save({"it": torch.tensor(5)}, tmp_path / "model_optim_rng.pt")
    assert int(torch.load(tmp_path / "model_optim_rng.pt")["it"]) == 5

    engine = CkptCacheCheckpointEngine(None, commit_waits=commit_waits)
    engine.create(None)
    engine.save({"w": torch.ones(3)}, str(tmp_path / "mp_rank_00_model_states.pt"))
    assert engine.commit(None) is True
    assert torch.equal(torch.load(tmp_path / "mp_rank_00_model_states.pt")["w"], torch.ones(3))


def test_commit_waits_persisted_without_a_daemon_raises_when_required(
    no_daemon, tmp_path, monkeypatch
):
    """CKPTCACHE_REQUIRE=1: the save itself raises, nothing is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    monkeypatch.setenv("CKPTCACHE_REQUIRE", "1")
    ckptcache.api.set_default_client(None)
    ck = tmp_path / "dcp"
    with pytest.raises(CheckpointException, match="DaemonUnavailable"):
        dcp.save(
            {"w": torch.ones(2)}, storage_writer=cdcp.CacheWriter(ck, commit_waits="persisted")
        )
    assert not (ck / ".metadata").exists()
