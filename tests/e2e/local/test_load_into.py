"""A load into tensors the caller already has (``load_into``), on a real daemon and from a
file: every tensor named is filled with the saved bytes in place (same storage, version
counter moved, gradients untouched), what it does not name comes back as a load returns it,
and a checkpoint that does not fit raises a typed error naming the tensor before anything is
written."""

from __future__ import annotations

import dataclasses
import io
import os
import types
import zipfile
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
    if isinstance(into, torch.nn.Module):
        assert "state_dict()" in str(raised.value)
    else:
        assert "holds none" in str(raised.value)


@dataclasses.dataclass
class _Moments:
    exp_avg: torch.Tensor


HOLDERS = {
    "a module in a dict": lambda: torch.nn.Linear(2, 2),
    "a dataclass": lambda: _Moments(torch.zeros(4)),
    "an object's attributes": lambda: types.SimpleNamespace(exp_avg=torch.zeros(4)),
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_tensors_held_by_another_kind_of_object_are_a_type_error(daemon, tmp_path, holder):
    """Only dicts, lists and tuples are walked: tensors held otherwise would be passed over
    and taken for restored, so they are named instead, before anything is written (also
    where the checkpoint has nothing at that key)."""
    path = str(tmp_path / "state.pt")
    with daemon.client() as c:
        c.save({"w": torch.ones(8), "opt": {"exp_avg": torch.ones(4)}}, path)
        for key in ("opt", "absent"):
            live = {"w": torch.zeros(8), key: HOLDERS[holder]()}
            with pytest.raises(TypeError) as raised:
                c.load_into(path, live, weights_only=False)
            assert str(raised.value).startswith(f"{key}: ") and "would not fill" in str(
                raised.value
            )
            assert torch.equal(live["w"], torch.zeros(8))


def _inference_zeros(n: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(n)


def _freed(n: int) -> torch.Tensor:
    t = torch.zeros(n)
    t.untyped_storage().resize_(0)  # as FSDP and ZeRO free a parameter's memory
    return t


UNFILLABLE = {
    "expanded": (lambda: torch.zeros(1).expand(1000), "share one address"),
    "inference tensor": (lambda: _inference_zeros(1000), "inference_mode"),
    "storage freed": (lambda: _freed(1000), "fewer bytes than its shape"),
    "sparse": (lambda: torch.zeros(1000).to_sparse(), "only dense tensors"),
}


@pytest.mark.parametrize("kind", sorted(UNFILLABLE))
def test_a_destination_a_copy_cannot_fill_raises_and_writes_nothing(daemon, tmp_path, kind):
    """Checked with the rest, before the first byte is written: not halfway through."""
    make, why = UNFILLABLE[kind]
    path = str(tmp_path / "state.pt")
    live = {"a": torch.zeros(1000), "b": make()}
    with daemon.client() as c:
        c.save({"a": torch.arange(1000.0), "b": torch.arange(1000.0)}, path)
        with pytest.raises(StateMismatch) as raised:
            c.load_into(path, live)
    assert raised.value.tensor == "b" and why in str(raised.value)
    assert torch.equal(live["a"], torch.zeros(1000))


def test_a_sparse_tensor_in_the_checkpoint_is_a_mismatch(daemon, tmp_path):
    path = str(tmp_path / "state.pt")
    live = {"a": torch.zeros(1000), "s": torch.zeros(4)}
    with daemon.client() as c:
        c.save({"a": torch.arange(1000.0), "s": torch.zeros(4).to_sparse()}, path)
        with pytest.raises(StateMismatch, match="only dense tensors"):
            c.load_into(path, live)
    assert torch.equal(live["a"], torch.zeros(1000))


def test_inference_tensors_are_filled_inside_inference_mode(daemon, tmp_path):
    path = str(tmp_path / "state.pt")
    live = {"a": _inference_zeros(1000), "b": _inference_zeros(64).reshape(8, 8).t()}
    saved = {"a": torch.arange(1000.0), "b": torch.arange(64.0).reshape(8, 8)}
    with daemon.client() as c:
        c.save(saved, path)
        with torch.inference_mode():
            c.load_into(path, live)
    assert torch.equal(live["a"], saved["a"]) and torch.equal(live["b"], saved["b"])


@pytest.mark.parametrize("where", ["memory", "file"])
def test_conjugate_and_negative_views_are_filled_with_their_values(daemon, tmp_path, where):
    """A lazily conjugated or negated complex tensor (on either side) holds bytes that are
    not its values: filled as ``copy_`` fills it, never by a copy of bytes."""
    values = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j] * 100, dtype=torch.complex64)
    saved = {"plain": values, "conj": values.conj()}  # torch.save keeps the conjugate bit
    path = str(tmp_path / "state.pt")
    with daemon.client() as c:
        if where == "memory":
            c.save(saved, path)
        else:
            torch.save(saved, path)
        base, neg_base, other = (torch.zeros(300, dtype=torch.complex64) for _ in range(3))
        live = {"plain": base.conj(), "conj": other}
        c.load_into(path, live)
        assert torch.equal(live["plain"], values) and torch.equal(live["conj"], values.conj())
        assert torch.equal(base, values.conj())  # the bytes under the conjugate view
        neg = torch._neg_view(neg_base)
        c.load_into(path, {"plain": neg})
        assert torch.equal(neg, values) and torch.equal(neg_base, -values)


def test_destinations_that_share_bytes_are_filled_in_order(daemon, tmp_path):
    """Tied weights: the same tensor named twice, or a strided view of another one named.
    The result is what ``copy_`` in the order of ``into`` leaves: the last one named wins."""
    x, y = torch.arange(12.0).reshape(3, 4), 100 + torch.arange(12.0).reshape(4, 3)
    path = str(tmp_path / "state.pt")
    with daemon.client() as c:
        c.save({"b": x, "a": y, "c": y.t()}, path)
        w = torch.zeros(4, 3)
        c.load_into(path, {"b": w.t(), "a": w})
        assert torch.equal(w, y)
        c.load_into(path, {"a": w, "b": w.t()})
        assert torch.equal(w, x.t())
        t = torch.zeros(3, 4)
        c.load_into(path, {"b": t, "c": t})  # one object twice; the second saved strided
        assert torch.equal(t, y.t())


def test_a_checkpoint_saved_from_a_gpu_fills_cpu_tensors(daemon, tmp_path):
    """Storages saved with a CUDA location (as a GPU trainer's ``torch.save`` writes them)
    are read on the CPU and copied to each destination's device: no GPU is needed for CPU
    destinations, and none holds the checkpoint twice."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(10.0)}, buf)
    path = tmp_path / "gpu-saved.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(info, data)
    live = {"w": torch.zeros(10)}
    with daemon.client() as c:
        c.load_into(str(path), live)
    assert torch.equal(live["w"], torch.arange(10.0))


def test_a_legacy_file_is_filled(daemon, tmp_path):
    """A file of ``torch.save``'s format before zip archives cannot be mapped: it is read."""
    path = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.arange(100.0)}, path, _use_new_zipfile_serialization=False)
    live = {"w": torch.zeros(100)}
    with daemon.client() as c:
        out = c.load_into(path, live)
    assert torch.equal(live["w"], torch.arange(100.0)) and out["w"] is live["w"]


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
