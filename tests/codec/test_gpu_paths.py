"""The CUDA paths' arithmetic, checked on the CPU: how a load's storages are cut into the two
staging buffers, and which saved storages are gathered into one device-to-host copy. The
CUDA runs themselves are in tests/e2e/local/test_gpu.py."""

from __future__ import annotations

import mmap

import pytest
import torch

from ckptcache.codec.gpu import copy as gpu_copy
from ckptcache.codec.gpu import pinning as gpu_pinning
from ckptcache.codec.gpu.staging import DeviceLoad

CPU = torch.device("cpu")


def _mapping(data: bytes) -> mmap.mmap:
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return m


@pytest.mark.parametrize("slot", [1, 7, 64, 1 << 20])
def test_staged_load_gives_each_storage_its_bytes_whatever_the_slot_size(slot):
    data = bytes(range(256)) * 40
    mapping = _mapping(data)
    # Storages that fit, straddle, exactly fill and exceed a slot; one empty; out of order.
    places = [(0, 5), (5, 64), (69, 1), (70, 0), (70, 3000), (4000, 200), (3100, 7)]
    load = DeviceLoad(mapping, CPU, slot_bytes=slot)
    storages = [load.storage(offset, n) for offset, n in places]
    load.finish()
    for (offset, n), storage in zip(places, storages, strict=True):
        assert storage.nbytes() == n
        got = torch.empty(0, dtype=torch.uint8).set_(storage)
        assert bytes(got.numpy()) == data[offset : offset + n], (offset, n, slot)
    # Each storage is its own allocation, not a view of the mapping or of a staging buffer.
    pointers = {s.data_ptr() for s in storages if s.nbytes()}
    assert len(pointers) == len([p for p in places if p[1]])
    mapping[:] = b"\0" * len(data)  # the loaded bytes are copies
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(storages[1]).numpy()) == data[5:69]


def test_a_finished_staged_load_releases_the_mapping():
    mapping = _mapping(b"x" * 100)
    load = DeviceLoad(mapping, CPU, slot_bytes=16)
    storage = load.storage(10, 50)
    load.finish()
    mapping.close()  # no buffer export left behind: BufferError otherwise
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()) == b"x" * 50
    with pytest.raises(AssertionError, match="finish"):
        load.storage(0, 1)


def _items(*specs: tuple[int, int, int]) -> list[gpu_copy.Item]:
    """(index, offset, nbytes) -> items over CPU storages of those sizes."""
    return [(i, o, torch.UntypedStorage(n), n) for i, o, n in specs]


def _shape(runs: list[list[gpu_copy.Item]]) -> list[list[int]]:
    return [[item[0] for item in run] for run in runs]


def test_runs_gather_small_neighbours_only():
    small, big = 4096, gpu_copy.GATHER_BELOW
    items = _items(
        (0, 0, small), (1, 4160, small),  # neighbours: one run
        (3, 8256, small),  # index 2 (another device, or the CPU) lies between: a new run
        (4, 12352, big),  # large: alone
        (5, 12352 + big + 64, small), (6, 12352 + big + 4224, small),
        (7, 12352 + big + 4224 + small + 128 * 1024, small),  # a gap wider than metadata
    )  # fmt: skip
    assert _shape(gpu_copy._runs(items)) == [[0, 1], [3], [4], [5, 6], [7]]


def test_runs_stop_at_the_run_size():
    n = gpu_copy.GATHER_BELOW // 2
    count = gpu_copy.RUN_BYTES // n + 3
    items = _items(*[(i, i * n, n) for i in range(count)])
    runs = gpu_copy._runs(items)
    assert [len(r) for r in runs] == [gpu_copy.RUN_BYTES // n, 3]
    for run in runs:
        assert run[-1][1] + run[-1][3] - run[0][1] <= gpu_copy.RUN_BYTES


def test_pinning_bookkeeping_without_cuda(monkeypatch):
    # Without CUDA in use nothing is reserved, and unpinning an unknown mapping is a no-op.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    mapping = _mapping(b"y" * 4096)
    assert gpu_pinning.reserve_if_cuda(mapping) is None
    assert not gpu_pinning.pinned(mapping)
    gpu_pinning.unpin(mapping)
    mapping.close()
    gpu_pinning.unpin(mapping)  # closed: nothing to do, no error


def test_copies_are_cut_where_registration_pieces_meet():
    c = gpu_pinning.CHUNK_BYTES
    assert gpu_pinning.pieces(10, 10) == [(10, 10)]
    assert gpu_pinning.pieces(0, c) == [(0, c)]
    assert gpu_pinning.pieces(c - 5, c + 5) == [(c - 5, c), (c, c + 5)]
    assert gpu_pinning.pieces(3, 2 * c + 1) == [(3, c), (c, 2 * c), (2 * c, 2 * c + 1)]


def test_storages_placed_by_a_device_load_are_not_moved_again(monkeypatch):
    # A load to a device makes each storage there itself; torch's restore (a device check
    # and a move per storage) is skipped for it, and only for it.
    from ckptcache.codec import flatten
    from ckptcache.codec.decode import decode_skeleton

    state = {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)}
    flat = flatten.flatten(state)
    by_key = dict(zip((i.key for i in flat.infos), flat.storages, strict=True))

    def restore(*args: object) -> object:
        raise AssertionError("restored again")

    monkeypatch.setattr(flatten, "restore_location", restore)
    got = decode_skeleton(flat.skeleton, lambda key, n: by_key[key], map_location="cpu",
                          placed=True)  # fmt: skip
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())
    with pytest.raises(AssertionError, match="restored again"):
        decode_skeleton(flat.skeleton, lambda key, n: by_key[key], map_location="cpu")


def test_a_small_load_gets_small_staging_buffers():
    from ckptcache.codec.gpu.staging import SLOT_BYTES, slot_size

    assert slot_size(0) == slot_size(1) == 1 << 20
    assert slot_size((1 << 20) + 1) == 2 << 20
    assert slot_size(5 << 20) == 5 << 20
    assert slot_size(10 * SLOT_BYTES) == SLOT_BYTES
