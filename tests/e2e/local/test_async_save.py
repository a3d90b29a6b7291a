"""Non-blocking saves: bytes equal after wait, in-place modifications caught before commit,
the previous generation kept, errors surfaced on wait, StepGuard waits for the copies."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import ckptcache
import ckptcache.client._async
from ckptcache.client._async import VersionCheck
from ckptcache.codec import objectio
from ckptcache.codec.flatten import flatten
from ckptcache.errors import CkptCacheWarning, ReplicationError, TensorMutated
from ckptcache.recovery import StepGuard

MIB = 1 << 20


@dataclasses.dataclass
class Holder:
    """A dataclass carrying a tensor (as training frameworks' state objects do)."""

    w: torch.Tensor


class Box:
    """A plain object carrying tensors in its attributes."""

    def __init__(self, w: torch.Tensor):
        self.inner = {"w": w}


def state(fill: float) -> dict:
    return {"w": torch.full((MIB,), fill), "b": torch.arange(1000.0) + fill, "step": int(fill)}


@contextlib.contextmanager
def copies_held(client: ckptcache.Client) -> Iterator[threading.Event]:
    """Keep ``client``'s background copies from starting until the yielded event is set."""
    held, go = threading.Event(), threading.Event()

    def hold_client() -> None:
        with client._connection.lock:
            held.set()
            go.wait()

    holder = threading.Thread(target=hold_client)
    holder.start()
    held.wait()
    try:
        yield go
    finally:
        go.set()
        holder.join()


def drain(client: ckptcache.Client) -> None:
    """Return once every save submitted so far has finished (done callbacks included): the
    save thread runs them in order."""
    client._saves.background().submit(lambda: None).result()


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
    with client._connection.lock:  # the background copy cannot start until the trainer "steps"
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
    s = state(3.0)
    with copies_held(client) as go:  # delay the copy until the trainer reaches its step
        handle = client.save(s, str(tmp_path / "g.pt"), blocking=False)
        go.set()
        with guard.optimizer_step():
            assert handle.copied()
            s["w"].mul_(2.0)  # safe: the copy is done
    handle.wait()
    assert torch.equal(client.load(str(tmp_path / "g.pt"))["w"], torch.full((MIB,), 3.0))


def test_dropped_handle_is_still_waited_for_by_optimizer_step(client, tmp_path):
    path = str(tmp_path / "d.pt")
    s = state(3.0)
    with copies_held(client) as go:
        ckptcache.save(s, path, blocking=False)  # the handle is not kept
        gc.collect()
        assert [h.path for h in ckptcache.client._async._pending] == [path]
        go.set()
        with StepGuard().optimizer_step():
            s["w"].mul_(2.0)  # safe: the step waited for the copy
    client.wait()  # waits for the save itself (no persist root: nothing more to wait for)
    drain(client)  # the handle leaves the pending set in a done callback, after the wait wakes
    assert not ckptcache.client._async._pending
    assert torch.equal(client.load(path, mmap=False)["w"], torch.full((MIB,), 3.0))


@pytest.mark.parametrize("with_path", [True, False])
def test_client_wait_waits_for_pending_saves_and_raises_their_error(client, tmp_path, with_path):
    path = str(tmp_path / "w.pt")
    s = state(1.0)
    with copies_held(client) as go:
        handle = client.save(s, path, blocking=False)
        s["w"].add_(1.0)  # broken contract: the save will fail
        go.set()
        with pytest.raises(TensorMutated):
            client.wait(path) if with_path else client.wait()
    assert handle.done()


def test_failed_save_with_dropped_handle_is_logged(client, tmp_path, caplog):
    path = str(tmp_path / "l.pt")
    s = state(1.0)
    with caplog.at_level(logging.ERROR, logger="ckptcache.client._async"):
        with copies_held(client):
            client.save(s, path, blocking=False)
            s["w"].add_(1.0)
        drain(client)
        gc.collect()
    (record,) = [r for r in caplog.records if "never waited on" in r.getMessage()]
    assert path in record.getMessage() and "TensorMutated" in record.getMessage()


def test_failed_save_waited_on_is_not_logged(client, tmp_path, caplog):
    path = str(tmp_path / "n.pt")
    s = state(1.0)
    with caplog.at_level(logging.ERROR, logger="ckptcache.client._async"):
        with copies_held(client):
            handle = client.save(s, path, blocking=False)
            s["w"].add_(1.0)
        with pytest.raises(TensorMutated):
            handle.wait()
        del handle
        gc.collect()
    assert not [r for r in caplog.records if "never waited on" in r.getMessage()]


WRAPPERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "namespace": lambda t: {"args": argparse.Namespace(w=t)},
    "dataclass": lambda t: {"holder": Holder(t)},
    "object": lambda t: [Box(t)],
    "parameter": lambda t: {"p": torch.nn.Parameter(t)},
}


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_in_place_change_is_caught_wherever_the_tensor_sits(client, tmp_path, kind):
    path = str(tmp_path / "o.pt")
    obj = WRAPPERS[kind](torch.zeros(1024))
    (tensor,) = _all_tensors(obj)
    with copies_held(client):
        handle = client.save(obj, path, blocking=False)
        with torch.no_grad():
            tensor.add_(5.0)  # before the copy: a broken contract
    with pytest.raises(TensorMutated, match="modified in place"):
        handle.wait()
    assert not client.exists(path)


def _all_tensors(obj: Any) -> list[torch.Tensor]:
    """The test objects' tensors (each wrapper holds exactly one)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _all_tensors(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _all_tensors(v)]
    return _all_tensors(vars(obj))


@pytest.mark.parametrize("new_size", [0, 8192])  # freed (FSDP/ZeRO style), or grown
def test_storage_resized_before_the_copy_aborts_the_save(client, tmp_path, new_size):
    path = str(tmp_path / "r.pt")
    old = {"a": torch.full((1024,), 1.0), "b": torch.full((1024,), 2.0)}
    client.save(old, path)
    s = {"a": torch.full((1024,), 3.0), "b": torch.full((1024,), 4.0)}
    with copies_held(client):
        handle = client.save(s, path, blocking=False)
        s["a"].untyped_storage().resize_(new_size)  # no version counter bump
    with pytest.raises(TensorMutated, match=r"storage of 'a' was resized from 4096 to"):
        handle.wait()
    assert client.status(path).generation == 1
    loaded = client.load(path, mmap=False)
    assert torch.equal(loaded["a"], old["a"]) and torch.equal(loaded["b"], old["b"])


def inference_state(fill: float) -> dict:
    """``state(fill)`` made under ``torch.inference_mode()``: tensors without version counters."""
    with torch.inference_mode():
        return state(fill)


def bump(tensor: torch.Tensor) -> None:
    """An optimizer-style in-place step; inference tensors only take one in inference mode."""
    with torch.inference_mode():
        tensor.add_(1.0)


def copy_stepping_midway(step: Callable[[], None]) -> Callable[..., None]:
    """A stand-in for the segment copier (``copy_cpu_storages``) that copies the first half of
    the first storage's bytes, runs ``step`` (the trainer's in-place update racing the copy),
    then copies the rest: the torn copy of the issue, made deterministic."""

    def copy(
        dst: torch.Tensor,
        offsets: Sequence[int],
        storages: Sequence[torch.UntypedStorage],
        sizes: Sequence[int],
    ) -> None:
        pending = [step]
        for offset, storage, nbytes in zip(offsets, storages, sizes, strict=True):
            src = torch.empty(0, dtype=torch.uint8).set_(storage)
            half = nbytes // 2
            dst[offset : offset + half].copy_(src[:half])
            while pending:
                pending.pop()()
            dst[offset + half : offset + nbytes].copy_(src[half:nbytes])

    return copy


def test_inference_tensor_changed_during_the_copy_never_commits_torn_bytes(
    client, tmp_path, monkeypatch
):
    path = str(tmp_path / "i.pt")
    s = inference_state(2.0)
    monkeypatch.setattr(objectio, "copy_cpu_storages", copy_stepping_midway(lambda: bump(s["w"])))
    handle = client.save(s, path, blocking=False)
    handle.wait()
    assert torch.equal(s["w"], torch.full((MIB,), 3.0))  # the step did run during the copy
    loaded = client.load(path, mmap=False, verify=True)
    # What save() was handed, whole: not half 2.0, half 3.0.
    assert torch.equal(loaded["w"], torch.full((MIB,), 2.0))
    assert torch.equal(loaded["b"], torch.arange(1000.0) + 2.0) and loaded["step"] == 2


@pytest.mark.parametrize("where", ["before", "during"])
def test_counted_tensor_beside_inference_tensors_is_still_checked_before_commit(
    client, tmp_path, monkeypatch, where
):
    path = str(tmp_path / "c.pt")
    old = state(1.0)
    client.save(old, path)
    s = {**inference_state(2.0), "counted": torch.full((MIB,), 2.0)}
    if where == "during":
        step = lambda: s["counted"].add_(1.0)  # noqa: E731
        monkeypatch.setattr(objectio, "copy_cpu_storages", copy_stepping_midway(step))
        handle = client.save(s, path, blocking=False)
    else:
        with copies_held(client):
            handle = client.save(s, path, blocking=False)
            s["counted"].add_(1.0)  # a broken contract on a tensor the counter watches
    with pytest.raises(TensorMutated, match=r"'counted'.*modified in place"):
        handle.wait()
    assert client.status(path).generation == 1
    loaded = client.load(path, mmap=False, verify=True)
    assert torch.equal(loaded["w"], old["w"]) and "counted" not in loaded


def floats(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage``'s bytes as float32 values."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.float32)


def storage_state(fill: float) -> tuple[dict, torch.Tensor]:
    """An object holding a bare storage (no tensor of it pickled: no counter watches it) and
    the tensor that writes to that storage."""
    t = torch.full((MIB,), fill)
    return {"s": t.untyped_storage(), "step": int(fill)}, t


@pytest.mark.parametrize("kind", ["inference", "bare storage"])
def test_unwatched_storage_changed_before_the_copy_commits_the_submitted_values(
    client, tmp_path, kind
):
    path = str(tmp_path / "u.pt")
    if kind == "inference":
        s = inference_state(2.0)
        live = s["w"]
    else:
        s, live = storage_state(2.0)
    with copies_held(client):
        handle = client.save(s, path, blocking=False)
        bump(live)  # a broken contract that no version counter can see
    handle.wait()
    loaded = client.load(path, mmap=False, verify=True)
    got = loaded["w"] if kind == "inference" else floats(loaded["s"])
    assert torch.equal(got, torch.full((MIB,), 2.0)) and loaded["step"] == 2


def test_write_through_of_inference_tensors_writes_the_submitted_values(tmp_path):
    path = tmp_path / "t.pt"
    s = {**inference_state(2.0), "counted": torch.full((4,), 2.0)}
    with ckptcache.Client(str(tmp_path / "nobody.sock")) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore", CkptCacheWarning)
        with c._connection.lock:  # the write-through cannot start before the trainer "steps"
            handle = c.save(s, path, blocking=False)
            bump(s["w"])
        assert handle is not None
        handle.wait()
        assert c.fallbacks == 1
    saved = torch.load(path)
    assert torch.equal(saved["w"], torch.full((MIB,), 2.0))
    assert torch.equal(saved["counted"], torch.full((4,), 2.0)) and saved["step"] == 2


def test_only_the_storages_no_counter_watches_are_copied_at_submit():
    counted = torch.zeros(8)
    with torch.inference_mode():
        uncounted = torch.zeros(8)
    bare = torch.zeros(8)
    obj = {
        "counted": counted,
        "view": counted[2:],
        "uncounted": uncounted,
        "bare": bare.untyped_storage(),
    }
    check = VersionCheck(obj, "x.pt", flatten(obj))
    originals = [counted, uncounted, bare]
    same = [
        s._cdata == t.untyped_storage()._cdata
        for s, t in zip(check.flat.storages, originals, strict=True)
    ]
    assert same == [True, False, False]  # the counted storage is used in place, once
    bump(uncounted)
    bare.fill_(5.0)
    assert all(torch.equal(floats(s), torch.zeros(8)) for s in check.flat.storages[1:])


_EXIT_SCRIPT = """
import sys, threading, time
import torch
from ckptcache.client import Client
client = Client(sys.argv[1], fallback="raise")
state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}
client.save(state, sys.argv[2], blocking=False).wait()
time.sleep(1.5)  # the save thread ends a moment after its last save
print("idle threads:", sorted(t.name for t in threading.enumerate() if "ckptcache-save" in t.name))
client.save(state, sys.argv[3], blocking=False)  # never waited for: the process exits now
"""


def test_the_save_thread_ends_when_idle_and_exit_finishes_a_pending_save(daemon, tmp_path):
    """No save thread outlives its work (it is a daemon thread that ends when idle), and a
    process that exits with a non-blocking save still running commits it first."""
    import subprocess
    import sys

    first, second = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, daemon.socket, first, second],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "idle threads: []" in out.stdout
    with daemon.client() as c:
        loaded = c.load(second)
    assert set(loaded) == {f"w{i}" for i in range(16)}
    assert all(torch.equal(loaded[f"w{i}"], torch.full((1 << 20,), float(i))) for i in range(16))
