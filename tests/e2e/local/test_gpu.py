"""CUDA tensors: device-to-host into the pinned segment on save, host-to-device from the
pinned mapping on load. Skipped without a CUDA device; the CPU-side rules run everywhere."""

from __future__ import annotations

import pytest
import torch

from ckptcache.format import gpu as _gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_record_ready_makes_no_cuda_call_for_cpu_storages(monkeypatch):
    def no_cuda(*args: object) -> None:
        raise AssertionError("CUDA touched by a CPU-only save")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    assert _gpu.record_ready([torch.ones(4).untyped_storage()]) == {}


def test_device_target_only_for_plain_cuda_locations():
    assert _gpu.device_target(None) is None
    assert _gpu.device_target("cpu") is None
    assert _gpu.device_target({"cuda:0": "cpu"}) is None
    if not torch.cuda.is_available():
        assert _gpu.device_target("cuda") is None  # the CPU path is untouched


@pytest.mark.gpu
@cuda
def test_cuda_tensors_round_trip_through_the_pinned_segment(client, tmp_path):
    path = str(tmp_path / "gpu.pt")
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.arange(10.0, device="cuda")}
    client.save(state, path)
    assert _gpu._pinned  # the segment mapping was registered as pinned memory
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
