"""The fast weights-only unpickle: tensors made straight from a zero-copy load's array, with
the same results as torch's unpickler, and torch's unpickler wherever the skeleton needs more."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptcache.codec.decode import decode_skeleton
from ckptcache.codec.fast_unpickle import _Pending
from ckptcache.codec.flatten import flatten


def _archive(obj):
    """``obj``'s skeleton, its storages' bytes in one array, and the loaders over them."""
    flat = flatten(obj)
    chunks, places, at = [], {}, 0
    for i, storage in enumerate(flat.storages):
        data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
        places[str(i)] = (at, len(data))
        chunks.append(data)
        at += len(data)
    whole = np.frombuffer(bytearray(b"".join(chunks)), dtype=np.uint8)
    arrays: list[str] = []

    def load_storage(key: str, nbytes: int) -> torch.UntypedStorage:
        offset, size = places[key]
        assert size == nbytes
        return torch.from_numpy(whole[offset : offset + nbytes]).untyped_storage()

    def load_array(key: str, nbytes: int) -> np.ndarray | None:
        offset, size = places[key]
        arrays.append(key)
        return whole[offset : offset + nbytes] if size == nbytes else None

    return flat.skeleton, load_storage, load_array, arrays


def _pending_in(obj) -> bool:
    if isinstance(obj, _Pending):
        return True
    if isinstance(obj, dict):
        return any(_pending_in(v) for v in obj.values())
    return False


def test_tensors_made_from_the_array_equal_the_saved_ones_and_keep_shared_storages():
    w = torch.arange(24.0).reshape(4, 6)
    state = {
        "w": w, "tied": w, "rows": w[1:3], "t": w.t(),
        "bf16": torch.linspace(0, 1, 5, dtype=torch.bfloat16), "scalar": torch.tensor(3.5),
        "ints": torch.arange(7), "empty": torch.empty(0),
        "grad": torch.ones(3, requires_grad=True),
    }  # fmt: skip
    skeleton, load_storage, load_array, arrays = _archive(state)
    out = decode_skeleton(skeleton, load_storage, load_array=load_array)
    assert out.keys() == state.keys()
    for key, want in state.items():
        got = out[key]
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.detach(), want.detach()), key
    assert out["grad"].requires_grad and not out["w"].requires_grad
    # Tied weights and views saved together still share one storage.
    shared = {out[k].untyped_storage()._cdata for k in ("w", "tied", "rows", "t")}
    assert len(shared) == 1
    # The whole-storage tensors came from the array (the empty one has no bytes to map).
    assert len(arrays) == len(set(arrays)) == 5


def test_a_bare_storage_in_the_state_is_left_to_torchs_unpickler():
    w = torch.arange(6.0)
    skeleton, load_storage, load_array, _ = _archive({"storage": w.storage(), "w": w})
    out = decode_skeleton(skeleton, load_storage, load_array=load_array)
    assert type(out["storage"]) is torch.storage.TypedStorage
    assert out["storage"].tolist() == w.tolist() and torch.equal(out["w"], w)


def test_a_persistent_id_reused_through_the_memo_never_reaches_the_result():
    """A crafted skeleton that memoizes a storage's persistent id and puts it in the state as
    well as in a tensor: the fast path refuses, torch's unpickler decides."""
    w = torch.arange(6.0)
    skeleton, load_storage, load_array, _ = _archive({"w": w, "x": "yy"})
    persid = skeleton.index(b"Q")  # BINPERSID: the storage's persistent id
    crafted = skeleton[: persid + 1] + b"q\xff" + skeleton[persid + 1 :]  # BINPUT 255
    crafted = crafted.replace(b"X\x02\x00\x00\x00yy", b"h\xff")  # "yy": BINGET 255
    assert crafted != skeleton
    out = decode_skeleton(crafted, load_storage, load_array=load_array)
    assert not _pending_in(out)
    assert torch.equal(out["w"], w) and type(out["x"]) is torch.storage.TypedStorage


@pytest.mark.parametrize("bad", ["short", "missing"])
def test_an_array_that_does_not_match_its_storage_is_not_used(bad):
    w = torch.arange(8.0)
    skeleton, load_storage, _, _ = _archive({"w": w})

    def load_array(key: str, nbytes: int) -> np.ndarray | None:
        return np.zeros(nbytes // 2, dtype=np.uint8) if bad == "short" else None

    out = decode_skeleton(skeleton, load_storage, load_array=load_array)
    assert torch.equal(out["w"], w)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24.0).reshape(2, 3, 4),
        torch.arange(5, dtype=torch.int32).reshape(5, 1),
        torch.arange(5.0, dtype=torch.float64).reshape(1, 1, 5),
        torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4),
    ],
    ids=["3d", "column", "leading-ones", "bf16-2d"],
)
def test_a_shaped_tensor_is_made_over_the_array_with_its_shape_and_strides(tensor):
    """The shape is given to the array (or, without a numpy twin, to the tensor); either way the
    tensor lies over the loader's array, not over a copy."""
    skeleton, load_storage, load_array, arrays = _archive({"t": tensor})
    got = decode_skeleton(skeleton, load_storage, load_array=load_array)["t"]
    assert arrays == ["0"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert got.stride() == tensor.stride() and got.is_contiguous()
    assert torch.equal(got, tensor)
    got.view(-1)[0] = 7  # the bytes are the array's: a write shows through a second load
    again = decode_skeleton(skeleton, load_storage, load_array=load_array)["t"]
    assert again.view(-1)[0].item() == 7
