"""The kernel's record of written pages (:mod:`ckptcache.client._watch`): every way a CPU
tensor's bytes can change is reported, from Python, torch, numpy, DLPack and the kernel's own
writes alike, and what the scan cannot vouch for counts as written."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from ckptcache.client._watch import PAGE, WriteWatch, interior

MiB = 1 << 20


@pytest.fixture
def watch():
    w = WriteWatch.open()
    assert w is not None, "this kernel lacks UFFD_FEATURE_WP_ASYNC or PAGEMAP_SCAN (Linux 6.7)"
    yield w
    w.close()


def watched(watch: WriteWatch, tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    start, end = interior(storage.data_ptr(), storage.nbytes())
    assert watch.watch([(start, end)]) == [True]
    first = watch.written(start, end)
    assert first is not None and sum(e - s for s, e in first) == end - start  # all, at first
    assert watch.written(start, end) == []  # protected again: clean
    return start, end


def page_of(tensor: torch.Tensor, index: int) -> int:
    return (tensor.data_ptr() + index * tensor.element_size()) // PAGE * PAGE


def _read_into(t: torch.Tensor, index: int) -> None:
    read, write = os.pipe()
    os.write(write, b"\x01" * 8)
    os.close(write)
    view = memoryview(t.numpy()).cast("B")
    os.readv(read, [view[index * 4 : index * 4 + 8]])
    os.close(read)


def _proc_mem(t: torch.Tensor, index: int) -> None:
    fd = os.open("/proc/self/mem", os.O_RDWR)
    try:
        os.pwrite(fd, b"\x07" * 4, t.data_ptr() + index * 4)
    finally:
        os.close(fd)


def _inference(t: torch.Tensor, index: int) -> None:
    with torch.inference_mode():
        t[index] = 9.0


WRITES = {
    "in place op": lambda t, i: t[i : i + 1].add_(1),
    ".data": lambda t, i: t.data[i].fill_(3),
    "numpy": lambda t, i: t.numpy().__setitem__(i, 2.0),
    "dlpack": lambda t, i: torch.from_dlpack(t)[i].fill_(5),
    "inference mode": _inference,
    "read() by the kernel": _read_into,
    "/proc/self/mem": _proc_mem,
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_kind_of_write_is_reported(watch, how):
    t = torch.zeros(4 * MiB // 4)
    index = 300_000  # well inside: not on the partial first or last page
    before = t.untyped_storage().nbytes()
    start, end = watched(watch, t)
    WRITES[how](t, index)
    found = watch.written(start, end)
    assert found == [(page_of(t, index), page_of(t, index) + PAGE)], how
    assert watch.written(start, end) == []  # reported once, protected again
    assert t.untyped_storage().nbytes() == before


def test_a_write_by_a_forked_child_is_its_own_and_the_parents_after_is_seen(watch):
    t = torch.zeros(4 * MiB // 4)
    start, end = watched(watch, t)
    pid = os.fork()
    if pid == 0:
        t[200_000] = 1.0
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert watch.written(start, end) == []  # the child's page is its own copy
    assert float(t[200_000]) == 0.0
    t[500_000] = 2.0
    assert watch.written(start, end) == [(page_of(t, 500_000), page_of(t, 500_000) + PAGE)]


def test_pages_dropped_without_a_write_count_as_written(watch):
    """MADV_DONTNEED reads back zeros with no write: the next scan reports the pages."""
    t = torch.ones(4 * MiB // 4)
    start, end = watched(watch, t)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.madvise(ctypes.c_void_p(start + MiB), ctypes.c_size_t(2 * PAGE), 4) == 0
    assert float(t[(start + MiB - t.data_ptr()) // 4]) == 0.0  # the bytes changed
    found = watch.written(start, end)
    assert found and found[0][0] == start + MiB and found[-1][1] == start + MiB + 2 * PAGE
    assert sum(e - s for s, e in found) == 2 * PAGE


def test_a_range_no_longer_watched_cannot_be_vouched_for(watch):
    t = torch.ones(4 * MiB // 4)
    start, end = watched(watch, t)
    watch.unwatch(start, end)
    assert watch.written(start, end) is None


def test_only_private_anonymous_memory_is_watched(watch, tmp_path):
    """Another process may write a shared mapping or a file through its own page tables."""
    shared = torch.ones(4 * MiB // 4).share_memory_()
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 4 * MiB)
    mapped = torch.from_file(str(path), shared=False, size=MiB, dtype=torch.float32)
    private = torch.ones(4 * MiB // 4)
    ranges = [interior(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
              for t in (shared, mapped, private)]  # fmt: skip
    assert watch.watch(ranges) == [False, False, True]


@pytest.mark.parametrize("loop", ["extension", "python"])
def test_one_call_scans_many_ranges_as_one_scan_each_would(watch, monkeypatch, loop):
    """A save scans all its watched storages in one call: each range's answer is the span of
    its own written pages, ``(0, 0)`` for none, ``None`` for one no longer watched, and
    every page reported is protected again."""
    from ckptcache.client import _watch

    if loop == "python":
        monkeypatch.setattr(_watch, "_LIB", None)
    elif _watch._LIB is None:
        pytest.skip("the scan extension is not built here")
    tensors = [torch.zeros(2 * MiB // 4) for _ in range(5)]
    ranges = [watched(watch, t) for t in tensors]
    tensors[0][100_000] = 1.0
    tensors[0][400_000] = 1.0
    tensors[3][7_000] = 1.0
    watch.unwatch(*ranges[4])
    assert watch.written_many(ranges) == [
        (page_of(tensors[0], 100_000), page_of(tensors[0], 400_000) + PAGE),
        (0, 0),
        (0, 0),
        (page_of(tensors[3], 7_000), page_of(tensors[3], 7_000) + PAGE),
        None,
    ]
    assert watch.written_many(ranges[:4]) == [(0, 0)] * 4  # reported once, protected again
    assert watch.written_many([]) == []


def test_a_range_with_more_written_runs_than_one_call_returns_is_scanned_to_its_end(watch):
    """Every other page written: more runs than the kernel's table of one call holds."""
    t = torch.zeros(4 * MiB // 4)
    start, end = watched(watch, t)
    per_page = PAGE // 4
    first = (start - t.data_ptr()) // 4
    written = [first + 2 * k * per_page for k in range(200)]
    for i in written:
        t[i] = 1.0
    assert watch.written_many([(start, end)]) == [(start, start + 398 * PAGE + PAGE)]
    assert watch.written(start, end) == []
