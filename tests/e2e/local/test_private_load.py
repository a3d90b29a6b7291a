"""A load with private copies (``mmap=False``) from the daemon's memory: the whole object is
copied into this process's memory by the copy threads, then read as a zero-copy load reads the
segment (``ckptcache.codec.shm.private_copy``). Its tensors are the saved bytes, hold no pin,
share no page with the daemon's copy, and are what the digests are checked against."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from ckptcache.codec.shm import private_copy
from tests.helpers import wait_until

MIB = 1 << 20


def state() -> OrderedDict:
    """Large and small storages, a shared one, a view at an offset, several dtypes."""
    big = torch.randn(3 * MIB // 4)
    out = OrderedDict(
        (f"layers.{i}.bias", torch.full((1000 + i,), float(i), dtype=torch.float16))
        for i in range(300)
    )
    out["big"] = big
    out["view"] = big[1000:5000]
    out["ints"] = torch.arange(4096, dtype=torch.int64)
    out["step"] = 12
    return out


def assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and b[k].shape == v.shape and torch.equal(b[k], v), k
        else:
            assert b[k] == v, k


@pytest.mark.parametrize("verify", [None, True])
def test_a_private_load_is_the_saved_bytes_and_holds_no_pin(daemon, tmp_path, verify):
    path = str(tmp_path / "job" / "step-1" / "model.pt")
    saved = state()
    with daemon.client() as c:
        c.save(saved, path, durability="memory")
        loaded = c.load(path, mmap=False, verify=verify)
        assert_equal(saved, loaded)
        # The storage shared by two names stays shared, as in the saved state.
        assert (
            loaded["view"].untyped_storage().data_ptr()
            == loaded["big"].untyped_storage().data_ptr()
        )
        # No pin while the tensors live: the daemon's copy is free to go.
        wait_until(lambda: c.status(path).pins == 0, what="the load's pin released")
        # Private: writing the loaded tensors changes neither the daemon's copy nor a reload.
        loaded["big"].add_(1.0)
        loaded["layers.0.bias"].fill_(7)
        assert_equal(saved, c.load(path, mmap=False, verify=True))
        assert_equal(saved, c.load(path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_private_load_to_cuda_map_location_is_not_copied_on_the_cpu(daemon, tmp_path):
    """A ``map_location`` other than the CPU keeps its own path."""
    path = str(tmp_path / "m.pt")
    saved = {"w": torch.randn(1000)}
    with daemon.client() as c:
        c.save(saved, path, durability="memory")
        loaded = c.load(path, mmap=False, map_location="cuda:0")
        assert loaded["w"].is_cuda and torch.equal(loaded["w"].cpu(), saved["w"])


@pytest.mark.parametrize("size", [1, 4096, 3 * MIB + 17, 40 * MIB + 5])
def test_private_copy_copies_every_byte(size, tmp_path):
    path = tmp_path / "segment"
    pattern = torch.randint(0, 256, (size + 100,), dtype=torch.uint8)
    path.write_bytes(pattern.numpy().tobytes())
    copy = private_copy(str(path), size)
    assert len(copy) == size
    assert torch.equal(torch.frombuffer(copy, dtype=torch.uint8), pattern[:size])
    # Its own memory: a write to the file does not reach the copy.
    path.write_bytes(b"x" * (size + 100))
    assert copy[0] == int(pattern[0])


def test_private_copy_of_a_file_cut_short_raises(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(b"y" * 1000)
    with pytest.raises(OSError, match="ends at"):
        private_copy(str(path), 20 * MIB)
