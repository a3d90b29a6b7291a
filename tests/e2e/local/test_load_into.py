"""A load into tensors the caller already has (``load_into``), on a real daemon and from a
file: every tensor named is filled with the saved bytes in place (same storage, version
counter moved, gradients untouched), what it does not name comes back as a load returns it,
and a checkpoint that does not fit raises a typed error naming the tensor before anything is
written."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch

import ckptcache
from ckptcache.errors import StateMismatch
from tests.helpers import wait_until

MIB = 1 << 20
Moments = namedtuple("Moments", ["exp_avg", "exp_avg_sq"])


def training_state(seed: int) -> dict:
    """A model and an optimizer state as a trainer restores them: several dtypes, a large
    and many small tensors, a named tuple, a list, views (one sharing a larger tensor's
    bytes, one strided) and non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(2 * MIB // 4, generator=g)
    model = {f"layers.{i}.bias": torch.randn(100 + i, generator=g) for i in range(50)}
    model["weight"] = weight
    model["tied"] = weight[:1000]
    model["embedding"] = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    model["positions"] = torch.arange(1000 * seed, 1000 * seed + 4096)
    model["proj"] = torch.randn(48, 64, generator=g).t()  # strided: filled by copy_
    return {
        "model": model,
        "optimizer": {
            "moments": Moments(torch.randn(300, generator=g), torch.rand(300, generator=g)),
            "steps": [torch.tensor(float(seed)), torch.tensor(float(seed + 1))],
        },
        "epoch": seed,
        "name": "run-a",
    }


def tensors(obj, where=""):
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{where}.{i}")


def snapshot(obj) -> dict[str, bytes]:
    """Every tensor's bytes by key path (a meta tensor, which has none: its shape)."""
    return {k: str(t.shape).encode() if t.is_meta else t.reshape(-1).view(torch.uint8).numpy().tobytes()
            for k, t in tensors(obj)}  # fmt: skip


@pytest.mark.parametrize("where", ["memory", "file"])
def test_every_tensor_is_filled_in_place_with_the_saved_bytes(daemon, tmp_path, where):
    path = str(tmp_path / "job" / "step-2" / "state.pt")
    saved = training_state(2)
    live = training_state(1)  # the trainer's own tensors, one step behind
    addresses = {k: t.data_ptr() for k, t in tensors(live)}
    versions = {k: t._version for k, t in tensors(live)}
    with daemon.client() as c:
        if where == "memory":
            c.save(saved, path, durability="memory")
        else:
            os.makedirs(os.path.dirname(path))
            torch.save(saved, path)
        out = c.load_into(path, live, weights_only=False)  # the named tuple is this file's
        assert snapshot(live) == snapshot(saved)
        assert {k: t.data_ptr() for k, t in tensors(live)} == addresses  # in place
        assert all(t._version > versions[k] for k, t in tensors(live))
        # The result is the checkpoint with the trainer's tensors in it.
        assert out["epoch"] == 2 and out["name"] == "run-a"
        assert out["model"]["weight"] is live["model"]["weight"]
        assert out["optimizer"]["moments"].exp_avg is live["optimizer"]["moments"].exp_avg
        assert isinstance(out["optimizer"]["moments"], Moments)
        assert out["optimizer"]["steps"][1] is live["optimizer"]["steps"][1]
        # Nothing of the daemon's copy is kept once the result names only the trainer's.
        if where == "memory":
            del out
            wait_until(lambda: c.status(path).pins == 0, what="the load's pin released")
            assert snapshot(c.load(path, weights_only=False, verify=True)) == snapshot(saved)


def test_a_parameter_is_filled_without_touching_its_gradient(daemon, tmp_path):
    path = str(tmp_path / "model.pt")
    model = torch.nn.Linear(256, 128)
    model.weight.grad = torch.ones_like(model.weight)
    saved = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    with daemon.client() as c:
        c.save(saved, path, durability="memory")
        c.load_into(path, model.state_dict())
    assert torch.equal(model.weight.detach(), saved["weight"])
    assert torch.equal(model.bias.detach(), saved["bias"])
    assert model.weight.requires_grad and torch.equal(model.weight.grad, torch.ones(128, 256))


def test_only_the_tensors_named_are_filled_and_the_rest_come_back_loaded(daemon, tmp_path):
    path = str(tmp_path / "state.pt")
    saved = training_state(3)
    only = {"model": {"weight": torch.zeros(2 * MIB // 4)}}
    with daemon.client() as c:
        c.save(saved, path, durability="memory")
        out = c.load_into(path, only, weights_only=False)
    assert torch.equal(only["model"]["weight"], saved["model"]["weight"])
    assert out["model"]["weight"] is only["model"]["weight"]
    assert snapshot(out) == snapshot(saved)


MISFITS = {
    "missing tensor": (lambda s: s["model"].__setitem__("extra", torch.zeros(3)), "model.extra"),
    "missing in a list": (
        lambda s: s["optimizer"]["steps"].append(torch.zeros(1)),
        "optimizer.steps.2",
    ),
    "shape": (
        lambda s: s["model"].__setitem__("layers.7.bias", torch.zeros(200)),
        "model.layers.7.bias",
    ),
    "dtype": (lambda s: s["model"].__setitem__("positions", torch.zeros(4096)), "model.positions"),
    "not a tensor": (lambda s: s.__setitem__("epoch", torch.zeros(1)), "epoch"),
    "meta device": (
        lambda s: s["model"].__setitem__("weight", torch.empty(2 * MIB // 4, device="meta")),
        "model.weight",
    ),
}


@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_a_checkpoint_that_does_not_fit_raises_and_writes_nothing(daemon, tmp_path, misfit):
    path = str(tmp_path / "state.pt")
    change, name = MISFITS[misfit]
    live = training_state(1)
    change(live)
    before = snapshot(live)
    with daemon.client() as c:
        c.save(training_state(2), path, durability="memory")
        with pytest.raises(StateMismatch) as raised:
            c.load_into(path, live, weights_only=False)
    assert raised.value.tensor == name and name in str(raised.value)
    assert snapshot(live) == before  # not one tensor written, the fitting ones included


def test_the_module_function_uses_the_default_client(client, tmp_path):
    path = str(tmp_path / "m.pt")
    saved = {"w": torch.randn(1000), "step": 4}
    ckptcache.save(saved, path)
    live = {"w": torch.zeros(1000)}
    out = ckptcache.load_into(path, live)
    assert torch.equal(live["w"], saved["w"]) and out["step"] == 4 and out["w"] is live["w"]


def test_a_path_nobody_saved_raises_not_found(daemon, tmp_path):
    live = {"w": torch.zeros(10)}
    with daemon.client() as c, pytest.raises(ckptcache.CheckpointNotFound):
        c.load_into(str(tmp_path / "nothing.pt"), live)
    assert torch.equal(live["w"], torch.zeros(10))


@pytest.mark.parametrize("into", [torch.nn.Linear(4, 4), {"step": 3}, None], ids=repr)
def test_something_with_no_tensor_to_fill_is_a_type_error(daemon, tmp_path, into):
    """A module given for its state dict would fill nothing: named before anything is read."""
    with daemon.client() as c, pytest.raises(TypeError) as raised:
        c.load_into(str(tmp_path / "never-saved.pt"), into)
    assert "holds none" in str(raised.value)
    if isinstance(into, torch.nn.Module):
        assert "state_dict()" in str(raised.value)


def test_a_damaged_file_raises_and_writes_nothing(daemon, tmp_path):
    """A stored file is checked (zip CRC-32 of every record) before the first tensor is
    filled: a flipped byte in a tensor's bytes raises, and the trainer's tensors are as
    they were."""
    path = tmp_path / "plain.pt"
    weight = torch.arange(256 * 1024, dtype=torch.float32)
    torch.save({"w": weight}, path)
    data = bytearray(path.read_bytes())
    at = data.find(weight[1000:1004].numpy().tobytes())
    assert at > 0
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    live = {"w": torch.zeros(256 * 1024)}
    with daemon.client() as c, pytest.raises(ckptcache.CorruptCheckpoint):
        c.load_into(str(path), live)
    assert torch.equal(live["w"], torch.zeros(256 * 1024))
