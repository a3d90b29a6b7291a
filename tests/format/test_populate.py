"""A write mapping's page tables made by the copy threads at once (``map_shared(parallel=True)``).

Checked by what the kernel reports: the mapping's resident size (``/proc/self/smaps``) and the
minor faults a write of every page then takes (``getrusage``), next to a mapping made without
populating (which must fault), and with the kernel's own ``MAP_POPULATE`` (the fallback).
"""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np
import pytest
import torch

from ckptcache.format import shm

SIZE = 64 << 20  # eight copy shares of the minimum size
PAGES = SIZE // mmap.PAGESIZE


@pytest.fixture
def segment(tmp_path_factory):
    """A tmpfs file as the daemon's segments are, its pages allocated and numbered."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path_factory.mktemp("seg"))
    path = os.path.join(directory, f"ckptcache-test-populate-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(np.arange(SIZE // 8, dtype=np.int64).tobytes())
    yield path
    os.unlink(path)


def _resident_kib(mapping: mmap.mmap) -> int:
    """The resident size of ``mapping``'s area, as ``/proc/self/smaps`` reports it."""
    view = np.frombuffer(mapping, dtype=np.uint8)
    start = view.ctypes.data
    del view
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        low = line.split("-", 1)[0]
        if " " not in low and line[: len(low)] == low and int(low, 16) == start:
            for entry in lines[i + 1 :]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1])
    raise AssertionError("the mapping is not in /proc/self/smaps")


def _faults_writing_every_page(mapping: mmap.mmap) -> int:
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    view[:: mmap.PAGESIZE].fill_(7)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del view
    return faults


@pytest.mark.parametrize("parallel", [True, False], ids=["copy-threads", "map-populate"])
def test_a_save_mapping_is_populated_and_shares_the_segments_bytes(segment, parallel, monkeypatch):
    if not parallel:
        monkeypatch.setattr(shm, "POPULATE_IN_PARALLEL", False)
    torch.set_num_threads(max(2, torch.get_num_threads()))
    mapping = shm.map_shared(segment, SIZE, parallel=True)
    try:
        assert _resident_kib(mapping) == SIZE // 1024  # every page mapped before the copy
        assert _faults_writing_every_page(mapping) < PAGES // 100
        assert mapping[8:16] == np.int64(1).tobytes()  # the segment's own bytes
        assert mapping[SIZE - 8 :] == np.int64(SIZE // 8 - 1).tobytes()
    finally:
        mapping.close()
    with open(segment, "rb") as f:  # the writes went to the segment itself
        data = np.frombuffer(f.read(), dtype=np.uint8)
    assert (data[:: mmap.PAGESIZE] == 7).all() and data[1] == 0 and data[8] == 1


def test_a_mapping_made_without_populating_faults_on_every_write(segment):
    """The control: what the populated mappings above must not do."""
    mapping = shm.map_shared(segment, SIZE, populate=False)
    try:
        assert _resident_kib(mapping) == 0
        assert _faults_writing_every_page(mapping) >= PAGES // 16  # 16 pages a fault at most
    finally:
        mapping.close()


def test_this_kernel_populates_on_request():
    """The kernels this project supports (5.14 and later) take ``MADV_POPULATE_READ``: a
    failed probe would silently fall back to one thread."""
    assert shm.POPULATE_IN_PARALLEL
