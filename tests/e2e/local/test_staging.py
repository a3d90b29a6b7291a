"""Client.stage on a real daemon: one copy, held against eviction, private to its holder,
dropped on release or with the trainer (kill -9); plain copies without a daemon."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptcache
from ckptcache.errors import BudgetExceeded, DaemonUnavailable
from tests.helpers import wait_until

MIB = 1 << 20


def _state() -> list[torch.Tensor]:
    """Tensors as a state dict holds them: views of one storage, strides, scalars, dtypes."""
    flat = torch.arange(4096, dtype=torch.float32)
    return [
        flat,
        flat[100:200],  # a view of the same storage
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
        torch.tensor(41, dtype=torch.int64),  # a 0-dim step counter
        torch.linspace(0, 1, 33, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.zeros(0),
    ]


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, in logical order."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _staging(c: ckptcache.Client) -> list[str]:
    return [o.path for o in c.list() if "ckptcache-staging-" in o.path]


def test_staged_tensors_are_a_private_copy_of_the_originals(daemon):
    originals = _state()
    expected = [t.clone() for t in originals]
    with daemon.client() as c, daemon.client() as other:
        staged = c.stage(originals)
        assert staged.cached
        for t in originals:  # training goes on at once
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
        got = staged.tensors
        assert [(t.dtype, t.shape, t.stride(), t.storage_offset()) for t in got] == [
            (t.dtype, t.shape, t.stride(), t.storage_offset()) for t in originals
        ]
        for a, b in zip(got, expected, strict=True):
            assert a.device.type == "cpu"
            assert _raw(a) == _raw(b)
        # Shared storages stay shared: a view is a view of the staged storage.
        assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
        # A write to a staged tensor stays private: the committed copy is unchanged for others.
        got[0].fill_(-1.0)
        (path,) = _staging(c)
        seen = other.load(path)
        assert torch.equal(seen[0], expected[0]) and torch.equal(seen[2], expected[2])
        staged.release()
        assert staged.tensors == [] and _staging(c) == []
        staged.release()  # idempotent


def test_staged_copy_outlasts_a_full_budget_and_its_room_is_free_once_released(
    daemon_factory, tmp_path
):
    d = daemon_factory("--memory-limit", "24MiB", "--reserve-timeout", "1", "--pool-bytes", "0")
    held = torch.full((2 * MIB,), 7, dtype=torch.int32)  # 8 MiB
    with d.client(fallback="raise") as c:
        staged = c.stage([held])
        held.zero_()
        same = str(tmp_path / "same.pt")
        with pytest.raises(BudgetExceeded):  # fills the budget: evicts all it may, then stops
            for i in range(8):
                c.save({"w": torch.full((5 * MIB // 4 - 1024,), float(i))}, same)
                c.save({"w": torch.ones(5 * MIB // 4 - 1024)}, str(tmp_path / f"p{i}.pt"))
                assert d.segment_bytes() <= 24 * MIB
        assert len(_staging(c)) == 1  # the older generations went, not the staged copy
        assert torch.equal(staged.tensors[0], torch.full((2 * MIB,), 7, dtype=torch.int32))
        stored = c.daemon_status().memory_stored
        staged.release()
        gc.collect()  # nothing maps the segment any more: the daemon may reuse it
        assert _staging(c) == []
        assert c.daemon_status().memory_stored <= stored - 8 * MIB
        c.save({"w": torch.ones(5 * MIB // 4 - 1024)}, str(tmp_path / "after.pt"))  # fits now
        assert d.segment_bytes() <= 24 * MIB


STAGER = textwrap.dedent(
    """
    import sys, time, torch, ckptcache
    c = ckptcache.Client(sys.argv[1])
    staged = c.stage([torch.ones(1 << 20), torch.arange(10)])
    print("STAGED", flush=True)
    time.sleep(120)
    """
)


def test_staged_copy_of_a_killed_trainer_is_dropped(daemon):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", STAGER, daemon.socket], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "STAGED"
        with daemon.client() as c:
            (path,) = _staging(c)
            assert f"ckptcache-staging-{proc.pid}-" in path
            assert c.daemon_status().memory_stored >= 4 * MIB
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            wait_until(lambda: _staging(c) == [], 30, "the staging copy to go")
            status = c.daemon_status()
            assert (status.memory_stored, status.pinned) == (0, 0)
    finally:
        proc.kill()
        proc.wait()


def test_without_a_daemon_staged_tensors_are_plain_copies(tmp_path):
    originals = _state()
    expected = [t.clone() for t in originals]
    with ckptcache.Client(str(tmp_path / "none.sock")) as c:
        staged = c.stage(originals)
        assert not staged.cached
        originals[0].zero_()
        for a, b in zip(staged.tensors, expected, strict=True):
            assert torch.equal(a, b)
        staged.release()
        assert staged.tensors == []
    with (
        ckptcache.Client(str(tmp_path / "none.sock"), fallback="raise") as strict,
        pytest.raises(DaemonUnavailable),
    ):
        strict.stage(originals)


def test_stage_takes_tensors_only(daemon):
    with daemon.client() as c, pytest.raises(TypeError, match="stage takes tensors, not dict"):
        c.stage([{"w": torch.ones(1)}])  # type: ignore[list-item]
    with daemon.client() as c:
        with pytest.raises(TypeError, match=r"dense \(strided\) tensors, not torch\.sparse_coo"):
            c.stage([torch.ones(2), torch.ones(3).to_sparse()])
        assert c.list("") == []  # refused before anything was copied or held


def test_dcp_writer_gives_its_staging_copies_back_on_close(daemon, tmp_path):
    from ckptcache.adapters.dcp import CacheWriter

    with daemon.client() as c:
        writer = CacheWriter(tmp_path / "ck", client=c)
        live = {"model": {"w": torch.arange(6.0)}, "step": 3}
        staged = writer.stage(live)
        live["model"]["w"].zero_()
        assert torch.equal(staged["model"]["w"], torch.arange(6.0)) and staged["step"] == 3
        assert len(_staging(c)) == 1
        writer.close()  # an async_save that never reached write_data
        assert _staging(c) == []


def test_staged_copies_do_not_outlive_their_stager_across_a_daemon_restart(daemon, tmp_path):
    """Stage 4 x 8 MiB, kill -9 the daemon, restart it, kill -9 the stager: the copies were
    held for the stager's lease, which no restart keeps, so the new daemon reclaims them (it
    used to adopt them as memory-only objects, held until somebody ran rm)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    stager = textwrap.dedent(
        """
        import sys, time, torch, ckptcache
        c = ckptcache.Client(sys.argv[1])
        staged = [c.stage([torch.full((2 << 20,), float(i))]) for i in range(4)]
        print("STAGED", flush=True)
        time.sleep(120)
        """
    )
    kept = str(tmp_path / "kept.pt")
    with daemon.client() as c:
        c.save({"w": torch.ones(1024)}, kept, durability="memory")
    proc = subprocess.Popen(
        [sys.executable, "-c", stager, daemon.socket], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "STAGED"
        with daemon.client() as c:
            assert len(_staging(c)) == 4
        daemon.restart()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    with daemon.client() as c:
        assert _staging(c) == []
        assert [o.path for o in c.list()] == [kept]  # the checkpoint itself was adopted
        assert torch.equal(c.load(kept)["w"], torch.ones(1024))
        status = c.daemon_status()
        assert status.memory_stored < MIB and status.generations == 1
    assert not any(
        name.startswith("seg-")
        and os.path.getsize(os.path.join(daemon.segments_dir, name)) >= 8 * MIB
        for name in os.listdir(daemon.segments_dir)
    )  # their segments are gone, not only unlisted


def test_a_save_refused_for_staged_copies_names_them(daemon_factory, tmp_path):
    """A budget held by staging copies: the refusal says so (and whose), not "pinned by
    loads"."""
    d = daemon_factory("--memory-limit", "24MiB", "--reserve-timeout", "1", "--pool-bytes", "0")
    with d.client(fallback="raise") as c:
        staged = [c.stage([torch.full((2 * MIB,), float(i))]) for i in range(2)]  # 2 x 8 MiB
        with pytest.raises(BudgetExceeded) as refused:
            c.save({"w": torch.ones(3 * MIB)}, str(tmp_path / "big.pt"))  # 12 MiB
        message = str(refused.value)
        assert f"staging copies of uid {os.geteuid()}" in message, message
        assert "pinned by loads" not in message
        for s in staged:
            s.release()
