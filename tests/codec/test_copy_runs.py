"""copy_storages_into: many storages into one buffer, cut across threads, checked bounds."""

from __future__ import annotations

import pytest
import torch

from ckptcache.codec import packing, shm
from ckptcache.codec.shm import copy_storages_into
from ckptcache.errors import TensorMutated


def _storages(sizes: list[int], seed: int = 0) -> list[torch.UntypedStorage]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).untyped_storage()
            for n in sizes]  # fmt: skip


def _expected(size: int, runs: list[tuple[int, torch.UntypedStorage]]) -> torch.Tensor:
    out = torch.full((size,), 7, dtype=torch.uint8)
    for offset, s in runs:
        out[offset : offset + s.nbytes()] = torch.empty(0, dtype=torch.uint8).set_(s)
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_byte_lands_once_whatever_the_split(monkeypatch, threads):
    """Runs of uneven sizes (empty, odd, larger than a thread's share) with gaps between them:
    the destination equals one copy per storage, the gaps keep their bytes."""
    monkeypatch.setattr(shm, "_MIN_BYTES_PER_THREAD", 1)  # split even these small runs
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    sizes = [0, 1, 4093, 100_000, 17, 3 << 16, 5]
    runs, offset = [], 3
    for s in _storages(sizes):
        runs.append((offset, s))
        offset += s.nbytes() + 11  # a gap that must stay untouched
    dst = torch.full((offset,), 7, dtype=torch.uint8)
    copy_storages_into(dst, runs)
    assert torch.equal(dst, _expected(offset, runs))


def test_split_cuts_runs_into_equal_shares_in_order():
    parts = shm._split([(1000, 0, 10), (2000, 50, 5)], 3)
    assert parts == [[(1000, 0, 5)], [(1005, 5, 5)], [(2000, 50, 5)]]
    assert shm._split([], 2) == [[], []]


@pytest.mark.parametrize("parts", [1, 2, 16])
def test_split_of_many_small_runs_and_a_few_large_ones_keeps_every_byte_in_order(parts):
    """A state dict's runs (thousands of small storages, a few large ones): every byte of every
    run in exactly one piece, in order, large runs cut at shares, no piece past two shares."""
    sizes = [65536] * 500 + [16 << 20] * 3 + [4096, 1] * 40
    runs, dst, src = [], 1 << 40, 1 << 20
    for n in sizes:
        runs.append((dst, src, n))
        dst, src = dst + n + 64, src + n + 4096
    pieces = shm._split(runs, parts)
    assert 1 <= len(pieces) <= parts
    share = -(-sum(sizes) // parts)
    assert all(sum(n for _, _, n in piece) <= 2 * share for piece in pieces)
    merged: list[tuple[int, int, int]] = []
    for d, s, n in (run for piece in pieces for run in piece):
        if merged and merged[-1][0] + merged[-1][2] == d and merged[-1][1] + merged[-1][2] == s:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)  # a cut run, joined
        else:
            merged.append((d, s, n))
    assert merged == runs


def test_runs_outside_the_destination_or_off_the_cpu_are_refused():
    (s,) = _storages([16])
    dst = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside 32 bytes"):
        copy_storages_into(dst, [(17, s)])
    with pytest.raises(ValueError, match="outside 32 bytes"):
        copy_storages_into(dst, [(-1, s)])
    with pytest.raises(ValueError, match="not meta"):
        copy_storages_into(dst, [(0, torch.empty(4, device="meta").untyped_storage())])
    with pytest.raises(ValueError, match="contiguous CPU uint8"):
        copy_storages_into(torch.zeros(8), [])
    assert torch.equal(dst, torch.zeros(32, dtype=torch.uint8))  # nothing written on refusal


def test_a_forked_child_copies_with_its_own_threads(monkeypatch):
    """The copy threads do not survive a fork: a child (a data-loader worker, say) that saves
    gets its own, and its copy completes with every byte in place. (The child runs no torch
    kernel: torch's own thread pools are not fork-safe.)"""
    import ctypes
    import os

    monkeypatch.setattr(shm, "_MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    n = 1 << 16
    (src,) = _storages([n])
    dst = torch.zeros(n, dtype=torch.uint8)
    copy_storages_into(torch.zeros(n, dtype=torch.uint8), [(0, src)])  # the parent's threads
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = False
        try:
            copy_storages_into(dst, [(0, src)])
            ok = ctypes.string_at(dst.data_ptr(), n) == ctypes.string_at(src.data_ptr(), n)
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.waitpid(pid, 0)
        os.close(read)


@pytest.mark.parametrize("planned", [15, 17])
def test_a_storage_not_of_its_planned_size_is_refused(planned):
    """A storage resized since its place was planned (``resize_`` bumps no version counter)
    would leave stale bytes in its record or overwrite the next one: nothing is copied."""
    first, second = _storages([16, 16])
    dst = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(TensorMutated, match=f"resized from {planned} to 16 bytes"):
        copy_storages_into(dst, [(0, first, 16), (planned, second, planned)])
    assert torch.equal(dst, torch.zeros(64, dtype=torch.uint8))


def test_packed_item_resized_after_packing_is_refused():
    items = [torch.full((256,), 1.0), torch.full((256,), 2.0)]
    packed = packing.Packed(items)
    items[0].untyped_storage().resize_(2048)
    with pytest.raises(TensorMutated, match="resized from 1024 to 2048 bytes"):
        packed.materialize()


def test_the_streaming_copy_is_built_and_in_use_on_x86_64():
    """The install builds the copy extension (setup.py); on x86-64 it streams."""
    import platform

    from ckptcache.format import fastcopy

    if platform.machine() != "x86_64":
        pytest.skip("streaming stores are x86-64 only; elsewhere the extension memcpys")
    assert fastcopy.COPY_IMPLEMENTATION in ("stream-avx2", "stream-sse2"), (
        "the copy extension is not built in this tree: `pip install -e .` builds it"
    )


@pytest.mark.parametrize("streaming", [True, False], ids=["extension", "memmove"])
def test_copy_runs_lands_every_byte_at_every_alignment_and_length(monkeypatch, streaming):
    """Lengths around the streaming threshold and the store widths, at destination and source
    addresses off every alignment of a cache line: each run equals its source and nothing
    between the runs is written, with the extension and with the memmove fallback."""
    from ckptcache.format import fastcopy

    if not streaming:
        monkeypatch.setattr(fastcopy, "_LIB", None)
    lengths = [0, 1, 15, 31, 127, 4096, (32 << 10) - 1, 32 << 10, (32 << 10) + 1,
               (32 << 10) + 97, 100_000, (1 << 20) + 63]  # fmt: skip
    shifts = [0, 1, 7, 16, 31, 33, 63]
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))  # fmt: skip
    dst = torch.full((len(lengths) * len(shifts) * ((1 << 20) + 256),), 7, dtype=torch.uint8)
    expected = dst.clone()
    runs, at, placed = [], 0, []
    for i, n in enumerate(lengths):
        for j, shift in enumerate(shifts):
            s_at = (i * 131 + j * 977) % (src.numel() - n - 64) + (shift + 5) % 64
            d_at = at + shift
            runs.append((dst.data_ptr() + d_at, src.data_ptr() + s_at, n))
            placed.append((d_at, s_at, n))
            at = d_at + n + 64  # a gap that must keep its bytes
    fastcopy.copy_runs(runs)
    for d_at, s_at, n in placed:
        expected[d_at : d_at + n] = src[s_at : s_at + n]
    assert torch.equal(dst, expected)
