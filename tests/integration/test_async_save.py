"""Non-blocking saves: bytes equal after wait, in-place modifications caught before commit,
the previous generation kept, errors surfaced on wait, StepGuard waits for the copies."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptcache
from ckptcache.errors import ReplicationError, TensorMutated
from ckptcache.recovery import StepGuard

MIB = 1 << 20


def state(fill: float) -> dict:
    return {"w": torch.full((MIB,), fill), "b": torch.arange(1000.0) + fill, "step": int(fill)}


def test_non_blocking_save_commits_the_same_bytes(client, tmp_path):
    path = str(tmp_path / "a.pt")
    s = state(1.0)
    handle = ckptcache.save(s, path, blocking=False)
    assert isinstance(handle, ckptcache.SaveHandle)
    handle.wait()
    assert handle.done() and handle.copied()
    loaded = client.load(path, mmap=False)
    assert torch.equal(loaded["w"], s["w"]) and torch.equal(loaded["b"], s["b"])
    assert loaded["step"] == 1 and client.status(path).generation == 1


def test_in_place_change_during_copy_aborts_and_keeps_previous_generation(client, tmp_path):
    path = str(tmp_path / "m.pt")
    old = state(1.0)
    client.save(old, path)
    s = state(2.0)
    with client._lock:  # the background copy cannot start until the trainer "steps"
        handle = client.save(s, path, blocking=False)
        s["w"].add_(1.0)  # an optimizer step before handle.wait(): a broken contract
    with pytest.raises(TensorMutated, match=r"'w'.*modified in place"):
        handle.wait()
    assert client.status(path).generation == 1
    loaded = client.load(path, mmap=False)
    assert torch.equal(loaded["w"], old["w"]) and loaded["step"] == 1
    # The aborted segment went back to the daemon: the next save of the path works.
    client.save(s, path, blocking=False).wait()
    assert torch.equal(client.load(path, mmap=False)["w"], s["w"])


def test_errors_surface_on_wait(client, tmp_path):
    path = str(tmp_path / "e.pt")
    handle = client.save(state(1.0), path, durability="backup", blocking=False)
    with pytest.raises(ReplicationError, match="backup"):
        handle.wait()
    assert handle.done()


def test_optimizer_step_waits_for_pending_copies(client, tmp_path):
    guard = StepGuard()
    held, go = threading.Event(), threading.Event()

    def hold_client() -> None:  # delay the copy until the trainer reaches its step
        with client._lock:
            held.set()
            go.wait()

    holder = threading.Thread(target=hold_client)
    holder.start()
    held.wait()
    s = state(3.0)
    handle = client.save(s, str(tmp_path / "g.pt"), blocking=False)
    go.set()
    with guard.optimizer_step():
        assert handle.copied()
        s["w"].mul_(2.0)  # safe: the copy is done
    holder.join()
    handle.wait()
    assert torch.equal(client.load(str(tmp_path / "g.pt"))["w"], torch.full((MIB,), 3.0))
