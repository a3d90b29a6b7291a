"""Which runs a save copies (:mod:`ckptcache.client._unchanged`): only a storage the kernel
proves unwritten since the save whose bytes the handed segment holds, at the same offset, is
left out, and never its partial first and last pages."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from ckptcache.client._unchanged import MIN_BYTES, VOLATILE, Unchanged
from ckptcache.client._watch import PAGE

MiB = 1 << 20


def columns(tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    storages = [t.untyped_storage() for t in tensors]
    sizes = np.array([s.nbytes() for s in storages], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) + 4096
    addresses = np.array([s.data_ptr() for s in storages], dtype=np.uint64)
    return offsets, addresses, sizes


_SEGMENTS: dict[str, mmap.mmap] = {}


def save(u: Unchanged, segment: str, handed: int, token: int, tensors: list[torch.Tensor]):
    """One save's runs into ``segment`` (a mapping made at its first use), copied there as
    the save would copy them, and committed with ``token``; the segment then holds every
    storage at its offset, copied or skipped."""
    mapping = _SEGMENTS.setdefault(segment, mmap.mmap(-1, 16 * MiB))
    p = u.begin(segment, handed, mapping)
    assert p is not None
    runs = p.runs(*columns(tensors))
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    for offset, address, nbytes in zip(*runs, strict=True):
        ctypes.memmove(base + int(offset), int(address), int(nbytes))
    p.committed(token)
    for t, offset in zip(tensors, columns(tensors)[0], strict=True):
        n = t.untyped_storage().nbytes()
        live = ctypes.string_at(t.untyped_storage().data_ptr(), n)
        assert mapping[int(offset) : int(offset) + n] == live, "the segment holds stale bytes"
    return runs, p.skipped


def copied(runs) -> int:
    return int(runs[2].sum())


@pytest.fixture
def u():
    """One client's record (closed after: a range stays another watch's until then)."""
    unchanged = Unchanged()
    yield unchanged
    unchanged.close()


@pytest.fixture
def state():
    torch.manual_seed(0)
    return [torch.randn(2 * MiB // 4), torch.randn(3 * MiB // 4), torch.randn(1000)]


def test_an_unwritten_storage_in_the_segment_it_was_saved_to_is_not_copied(state, u):
    total = sum(t.untyped_storage().nbytes() for t in state)
    runs, skipped = save(u, "seg-a", 0, 11, state)
    assert (copied(runs), skipped) == (total, 0)  # first save: everything
    runs, skipped = save(u, "seg-b", 0, 12, state)  # another segment: everything again
    assert (copied(runs), skipped) == (total, 0)
    runs, skipped = save(u, "seg-a", 11, 13, state)
    whole = sum(t.untyped_storage().nbytes() for t in state[:2])  # the small one is copied
    assert skipped == whole and copied(runs) == total - whole
    assert u.skipped == whole


@pytest.mark.parametrize("loop", ["extension", "python"])
def test_a_write_to_the_partial_edge_pages_is_copied(u, monkeypatch, loop):
    """The first and last pages of a storage are not watched (another allocation may share
    them): they are compared with the segment, and a storage whose edges changed is copied
    (by the scan extension's loop, and by the loop in Python where it is not built)."""
    from ckptcache.client import _watch

    if loop == "python":
        monkeypatch.setattr(_watch, "_LIB", None)
    elif _watch._LIB is None:
        pytest.skip("the scan extension is not built here")
    # 12 bytes into a 16-byte aligned allocation, 2 MiB + 104 bytes long: both ends lie 4 or
    # 12 bytes past a multiple of 16, so whatever the allocator gives, the storage has a
    # partial first and a partial last page.
    nbytes = 2 * MiB + 104
    t = [torch.from_numpy(np.ones(3 + nbytes // 4, dtype=np.float32)[3:])]
    assert t[0].data_ptr() % PAGE and (t[0].data_ptr() + nbytes) % PAGE
    save(u, "seg-a", 0, 11, t)
    runs, skipped = save(u, "seg-a", 11, 12, t)
    assert skipped == nbytes  # unwritten: left in place
    t[0][0] = 5.0  # before the first whole page
    runs, skipped = save(u, "seg-a", 12, 13, t)
    assert skipped == 0 and copied(runs) == nbytes
    save(u, "seg-b", 0, 21, t)
    t[0][-1] = 6.0  # after the last whole page
    runs, skipped = save(u, "seg-b", 21, 22, t)
    assert skipped == 0 and copied(runs) == nbytes


@pytest.mark.parametrize("handed", [0, 99])
def test_a_segment_whose_token_is_not_ours_gets_every_byte(state, handed, u):
    total = sum(t.untyped_storage().nbytes() for t in state)
    save(u, "seg-a", 0, 11, state)
    runs, skipped = save(u, "seg-a", handed, 12, state)
    assert (copied(runs), skipped) == (total, 0)


def test_a_write_no_version_counter_sees_is_copied(state, u):
    save(u, "seg-a", 0, 11, state)
    state[1].data[123_456] = 7.0  # in the interior
    runs, _ = save(u, "seg-a", 11, 12, state)
    offsets, addresses, sizes = columns(state)
    assert (int(offsets[1]), int(addresses[1]), int(sizes[1])) in set(
        (int(o), int(a), int(n)) for o, a, n in zip(*runs, strict=True)
    )  # whole
    # Every later save into a segment written before the write copies it too ...
    save(u, "seg-b", 0, 21, state)
    runs, skipped = save(u, "seg-a", 12, 13, state)
    assert skipped > 0  # seg-a was written after the write: unchanged since
    runs, skipped = save(u, "seg-b", 21, 22, state)
    assert skipped > 0


def test_a_write_before_a_segment_is_reused_later_still_counts(u):
    """A write seen by the scan of a save into another segment keeps the first segment's
    copy from being trusted."""
    t = [torch.ones(2 * MiB // 4)]
    save(u, "seg-a", 0, 11, t)
    t[0][100_000] = 3.0
    save(u, "seg-b", 0, 21, t)  # sees the write
    runs, skipped = save(u, "seg-a", 11, 12, t)
    assert skipped == 0 and copied(runs) == 2 * MiB


def test_another_offset_or_size_is_copied(u):
    a, b = torch.ones(2 * MiB // 4), torch.ones(2 * MiB // 4)
    save(u, "seg-a", 0, 11, [a, b])
    runs, skipped = save(u, "seg-a", 11, 12, [b, a])  # swapped: each at the other's offset
    assert skipped == 0 and copied(runs) == 4 * MiB


def test_small_and_overlapping_storages_are_always_copied(u):
    small = torch.ones((MIN_BYTES - PAGE) // 4)
    base = np.ones(4 * MiB // 4, dtype=np.float32)
    x, y = torch.from_numpy(base[: 3 * MiB // 4]), torch.from_numpy(base[MiB // 4 :])
    save(u, "seg-a", 0, 11, [small, x, y])
    runs, skipped = save(u, "seg-a", 11, 12, [small, x, y])
    assert skipped == 0 and copied(runs) == sum(t.untyped_storage().nbytes() for t in (small, x, y))


def test_a_storage_written_at_every_save_stops_being_watched(u):
    t = [torch.ones(2 * MiB // 4)]
    key = (t[0].data_ptr(), 2 * MiB)
    for i in range(VOLATILE + 2):
        t[0].add_(1)
        save(u, f"seg-{i}", 0, i + 1, t)
    assert key not in u._watched and u._resting[key] > u._save


def test_nothing_is_skipped_when_turned_off(state):
    u = Unchanged(enabled=False)
    assert u.begin("seg-a", 0, mmap.mmap(-1, MiB)) is None


def test_a_pass_cut_short_after_a_scan_trusts_nothing_after(u, monkeypatch):
    """A signal's exception between a scan (which protects the written pages again) and the
    note of what it found: the write is not lost, the next save copies the storage."""
    t = [torch.ones(2 * MiB // 4)]
    save(u, "seg-a", 0, 11, t)
    t[0][100_000] = 3.0
    real = Unchanged._note

    def interrupted(self, found, start, end, save_number):
        raise KeyboardInterrupt

    monkeypatch.setattr(Unchanged, "_note", interrupted)
    with pytest.raises(KeyboardInterrupt):
        u.begin("seg-b", 0, mmap.mmap(-1, 16 * MiB)).runs(*columns(t))
    monkeypatch.setattr(Unchanged, "_note", real)
    runs, skipped = save(u, "seg-a", 11, 12, t)  # the helper checks the segment's bytes
    assert skipped == 0 and copied(runs) == 2 * MiB
