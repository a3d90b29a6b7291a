"""CUDA tensors: device-to-host into the segment on save (pageable until the mapping is
registered in the background, DMA after; small storages gathered on the device), and
host-to-device through the staging buffers on load. Skipped without a CUDA device; the
CPU-side rules run everywhere (and tests/codec/test_gpu_paths.py checks the arithmetic)."""

from __future__ import annotations

import pytest
import torch

from ckptcache.codec.gpu import copy as gpu_copy
from ckptcache.codec.gpu import pinning as gpu_pinning
from ckptcache.codec.gpu.staging import SLOT_BYTES
from tests.helpers import wait_until

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_record_ready_makes_no_cuda_call_for_cpu_storages(monkeypatch):
    def no_cuda(*args: object) -> None:
        raise AssertionError("CUDA touched by a CPU-only save")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    assert gpu_copy.record_ready([torch.ones(4).untyped_storage()]) == {}


def test_device_target_only_for_plain_cuda_locations():
    assert gpu_copy.device_target(None) is None
    assert gpu_copy.device_target("cpu") is None
    assert gpu_copy.device_target({"cuda:0": "cpu"}) is None
    if not torch.cuda.is_available():
        assert gpu_copy.device_target("cuda") is None  # the CPU path is untouched


@pytest.mark.gpu
@cuda
def test_cuda_tensors_round_trip_through_the_pinned_segment(client, tmp_path):
    path = str(tmp_path / "gpu.pt")
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.arange(10.0, device="cuda")}
    client.save(state, path)  # pageable: the mapping is registered in the background
    wait_until(lambda: bool(gpu_pinning._pinned), timeout=60)
    state["w"].mul_(2.0)
    client.save(state, path)  # by DMA into the registered mapping (or its twin)
    on_cpu = client.load(path, map_location="cpu")
    assert torch.equal(on_cpu["w"], state["w"].cpu()) and on_cpu["w"].device.type == "cpu"
    on_gpu = client.load(path, map_location="cuda")
    assert on_gpu["w"].is_cuda and torch.equal(on_gpu["w"], state["w"])
    assert torch.equal(on_gpu["b"], state["b"])


@pytest.mark.gpu
@cuda
def test_save_sees_pending_kernel_writes(client, tmp_path):
    path = str(tmp_path / "pending.pt")
    w = torch.zeros(1 << 22, device="cuda")
    w.add_(7.0)  # queued on the current stream; the side stream must wait for it
    client.save({"w": w}, path)
    assert torch.equal(client.load(path, map_location="cpu")["w"], torch.full((1 << 22,), 7.0))


@pytest.mark.gpu
@cuda
def test_non_blocking_save_waits_for_the_trainers_stream(client, tmp_path):
    """The copy runs on the save thread, whose current stream is not the trainer's: it must
    wait for the kernels the trainer queued on its own stream before the save."""
    path = str(tmp_path / "stream.pt")
    trainer = torch.cuda.Stream()
    with torch.cuda.stream(trainer):
        w = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(1 << 30)  # keeps the fill below pending for a while
        w.fill_(7.0)
        handle = client.save({"w": w}, path, blocking=False)
        handle.wait()
    assert torch.equal(client.load(path, map_location="cpu")["w"], torch.full((1 << 22,), 7.0))


def _mixed_state() -> dict[str, torch.Tensor]:
    """Small CUDA storages of odd sizes and dtypes with CPU tensors, an empty one, a large
    one and two views of one storage among them: gathered runs, broken runs, direct copies."""
    g = torch.Generator(device="cuda").manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    for i in range(300):
        n = (i * 37) % 2000 + 1
        dtype = (torch.float32, torch.float16, torch.int64)[i % 3]
        t = torch.randint(0, 100, (n,), generator=g, device="cuda").to(dtype)
        state[f"small.{i}"] = t
        if i % 50 == 7:
            state[f"cpu.{i}"] = torch.arange(float(n))
    state["empty"] = torch.empty(0, device="cuda")
    state["large"] = torch.rand(3 << 20, generator=g, device="cuda")  # 12 MiB
    flat = torch.rand(4096, generator=g, device="cuda")
    state["view.a"], state["view.b"] = flat[:1000], flat[1000:]
    return state


def _assert_same(got: dict, want: dict, device: str) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        if v.is_cuda:
            assert got[k].device.type == device, (k, got[k].device)
        assert torch.equal(got[k].to(v.device), v), k


@pytest.mark.gpu
@cuda
def test_gathered_small_storages_round_trip_and_stay_a_plain_archive(daemon_factory, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    d = daemon_factory("--memory-limit", "1GiB", "--persist-root", str(root))
    path = str(root / "mixed.pt")
    state = _mixed_state()
    with d.client() as c:
        for _ in range(2):  # pageable, then (once registered) by DMA
            for v in state.values():
                if v.is_cuda and v.is_floating_point():
                    v.add_(1.0)  # queued kernels: the copies must wait for them
            c.save(state, path)
            _assert_same(c.load(path, map_location="cuda"), state, "cuda")
            _assert_same(c.load(path, map_location="cpu"), state, "cpu")
            wait_until(lambda: bool(gpu_pinning._pinned), timeout=60)
        c.wait(path)
        # The archive metadata between gathered storages was written after them: the
        # persisted file is what torch.load reads.
        _assert_same(torch.load(path, map_location="cpu"), state, "cpu")
        loaded = c.load(path, map_location="cuda")
    assert loaded["view.a"].untyped_storage().data_ptr() == loaded["view.b"].untyped_storage(
    ).data_ptr()  # fmt: skip


@pytest.mark.gpu
@cuda
def test_a_state_across_registration_pieces_and_staging_buffers_round_trips(client, tmp_path):
    path = str(tmp_path / "big.pt")
    g = torch.Generator(device="cuda").manual_seed(5)
    n = (2 * SLOT_BYTES + (5 << 20)) // 4  # across both slots, and around again
    assert n * 4 > 4 * gpu_pinning.CHUNK_BYTES  # and across registration pieces
    state = {"a": torch.rand(n, generator=g, device="cuda"), "b": torch.rand(777, device="cuda")}
    registered = len(gpu_pinning._pinned)
    client.save(state, path)  # pageable, then registered in the background
    _assert_same(client.load(path, map_location="cuda:0"), state, "cuda")
    wait_until(lambda: len(gpu_pinning._pinned) > registered, timeout=60)
    for _ in range(3):  # by DMA, cut where the pieces meet (keep=2: both segments in turn)
        state["a"].add_(1.0)
        client.save(state, path)
        _assert_same(client.load(path, map_location="cuda:0"), state, "cuda")
        _assert_same(client.load(path, map_location="cpu"), state, "cpu")


@pytest.mark.gpu
@cuda
def test_warmup_registers_the_spare_before_the_first_save(daemon_factory, tmp_path):
    torch.ones(1, device="cuda")  # CUDA in use in this process
    d = daemon_factory("--memory-limit", "1GiB", "--pool-segments", "1",
                       "--pool-bytes", str(64 << 20))  # fmt: skip
    state = {"w": torch.rand(1 << 20, device="cuda")}
    with d.client() as c:  # sizes the daemon's spare pool, as a first run of the job does
        c.save(state, str(tmp_path / "sizing.pt"), durability="memory")
        c.delete(str(tmp_path / "sizing.pt"))
        wait_until(lambda: (p := c.pool()).capacities and not p.growing, timeout=60)
    before = set(gpu_pinning._pinned)
    with d.client() as c:
        c.warmup(wait=True)
        assert set(gpu_pinning._pinned) - before  # the spare mapping, registered
        c.save(state, str(tmp_path / "w.pt"))
        _assert_same(c.load(str(tmp_path / "w.pt"), map_location="cuda"), state, "cuda")
    assert set(gpu_pinning._pinned) <= before  # closing the client unregistered them
