"""The weights-only load of a plain skeleton in the C unpickler: the same objects as
``torch.load(weights_only=True)``, torch's unpickler for anything beyond it, and nothing a
hostile skeleton asks for is ever called."""

from __future__ import annotations

import builtins
import collections
import io
import math
import pickle
from typing import Any

import pytest
import torch
from torch import _weights_only_unpickler

from ckptcache.codec.decode import decode_skeleton
from ckptcache.codec.flatten import flatten
from ckptcache.errors import UnsafeUnpickle
from tests.helpers import assert_same


def _load(obj_or_skeleton: Any, storages: dict[str, torch.UntypedStorage] | None = None) -> Any:
    if storages is None:
        flat = flatten(obj_or_skeleton)
        skeleton = flat.skeleton
        storages = {i.key: s for i, s in zip(flat.infos, flat.storages, strict=True)}
    else:
        skeleton = obj_or_skeleton
    return decode_skeleton(skeleton, lambda key, nbytes: storages[key], weights_only=True)


def _torch_load(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture
def torch_unpickler_calls(monkeypatch):
    """How many times torch's weights-only unpickler was made."""
    calls = []
    real = _weights_only_unpickler.Unpickler

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kw: Any):
            calls.append(1)
            super().__init__(*args, **kw)

    monkeypatch.setattr(_weights_only_unpickler, "Unpickler", Counting)
    return calls


def _odd_containers() -> dict[Any, Any]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shared = torch.ones(2, dtype=torch.bfloat16)
    ordered = collections.OrderedDict(a=torch.zeros(1))
    ordered._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    return {
        "nested": {"a": [{"b": (torch.ones(2), [], {}, ())}], 3: {(1, "x"): None}},
        "ordered": ordered,
        "views": [base, base.t(), base[1:, ::2]],
        "same": [shared, shared],
        "loop": loop,
        "scalars": [2**80, -0.0, math.inf, True, None, "", 1.5],
        "empty": torch.empty(0, 3),
        "zero_dim": torch.tensor(7, dtype=torch.int64),
        "grad": torch.ones(2).requires_grad_(),
        "dtypes": [torch.ones(2, dtype=d) for d in (torch.float16, torch.int8, torch.bool,
                                                     torch.complex64, torch.bfloat16)],
    }  # fmt: skip


def test_plain_and_odd_containers_load_as_torch_load_does_without_torchs_unpickler(
    torch_unpickler_calls,
):
    obj = _odd_containers()
    out = _load(obj)
    assert torch_unpickler_calls == []
    expected = _torch_load(obj)
    for key in ("nested", "ordered", "views", "same", "scalars", "empty", "zero_dim", "grad"):
        assert_same(out[key], expected[key])
    assert out["ordered"]._metadata == {"": {"version": 1}}
    assert out["same"][0] is out["same"][1]
    assert out["loop"][1] is out["loop"]
    views = out["views"]
    assert {v.untyped_storage().data_ptr() for v in views} == {views[0].data_ptr()}
    assert views[1].stride() == (1, 4) and views[2].storage_offset() == 4
    assert out["grad"].requires_grad and not out["views"][0].requires_grad
    assert math.copysign(1, out["scalars"][1]) == -1
    for got, want in zip(out["dtypes"], obj["dtypes"], strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_anything_beyond_goes_to_torchs_unpickler(torch_unpickler_calls):
    obj = {"p": torch.nn.Parameter(torch.ones(2)), "size": torch.Size([2])}
    out = _load(obj)
    assert torch_unpickler_calls == [1]
    assert isinstance(out["p"], torch.nn.Parameter) and out["size"] == torch.Size([2])
    fp8 = torch.ones(2, dtype=torch.float8_e4m3fn)  # torch saves these through another rebuild
    assert torch.equal(_load({"t": fp8})["t"].view(torch.uint8), fp8.view(torch.uint8))
    assert _load({"raw": b"\x00\xff"}) == {"raw": b"\x00\xff"}  # protocol 2: codecs.encode
    assert torch_unpickler_calls == [1, 1, 1]


class _Runs:
    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


def test_a_skeleton_that_calls_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    for evil in (_Runs(builtins.exec, code), _Runs(builtins.eval, code)):
        flat = flatten({"t": torch.ones(1), "x": evil})
        storages = {i.key: s for i, s in zip(flat.infos, flat.storages, strict=True)}
        with pytest.raises(UnsafeUnpickle, match="weights_only"):
            _load(flat.skeleton, storages)
        assert not marker.exists()


def test_a_rebuild_over_something_not_loaded_makes_no_tensor():
    """The tensor rebuild is reachable: asked to build over bytes, or past a storage's end,
    it refuses (as torch's unpickler then does), never reading memory it was not given."""
    from torch._utils import _rebuild_tensor_v2

    not_storage = pickle.dumps(
        {"t": _Runs(_rebuild_tensor_v2, b"\x00" * 64, 0, (4,), (1,), False,
                    collections.OrderedDict())},
        protocol=2,
    )  # fmt: skip
    with pytest.raises((UnsafeUnpickle, AttributeError, TypeError)):
        _load(not_storage, {})
    flat = flatten({"t": torch.ones(4)})
    # As a load's storages are (views of a mapping): a tensor past the end cannot grow them.
    storages = {"0": torch.frombuffer(bytearray(16), dtype=torch.uint8).untyped_storage()}
    too_long = flat.skeleton.replace(b"K\x04\x85", b"M\x00\x01\x85")  # size (4,) -> (256,)
    assert too_long != flat.skeleton
    with pytest.raises(RuntimeError):
        _load(too_long, storages)


def test_a_malformed_persistent_id_is_refused():
    class _Pid(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("not", "a storage") if isinstance(obj, torch.UntypedStorage) else None

    buf = io.BytesIO()
    _Pid(buf, protocol=2).dump({"s": torch.UntypedStorage(4)})
    with pytest.raises(UnsafeUnpickle, match="persistent"):
        _load(buf.getvalue(), {})
