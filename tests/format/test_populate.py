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

from ckptcache.codec import shm
from ckptcache.format import pagetables

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


@pytest.mark.parametrize("how", ["copy-threads", "steps", "map-populate"])
def test_a_save_mapping_is_populated_and_shares_the_segments_bytes(segment, how, monkeypatch):
    """Populated by the copy threads (a save's mapping), a step at a time (as the daemon's
    spares are), or by ``MAP_POPULATE`` where the kernel cannot do either."""
    if how == "map-populate":
        monkeypatch.setattr(shm, "POPULATE_IN_PARALLEL", False)
    torch.set_num_threads(max(2, torch.get_num_threads()))
    if how == "steps":
        mapping = shm.map_shared(segment, SIZE, populate=False)
        pagetables.populate_in_steps(mapping)
    else:
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


def _record_steps(monkeypatch, native: bool) -> list[tuple[int, int]]:
    """The ranges populated, as ``(address, length)``: by the extension's loop (its call
    split into the steps it makes) or by the Python loop's calls."""
    calls: list[tuple[int, int]] = []
    if native:
        real_native = pagetables.NATIVE_STEPS
        if real_native is None:
            pytest.skip("the copy extension is not built here")

        def steps(address: int, length: int, step: int, stop: int | None) -> int:
            calls.extend((address + s, min(step, length - s)) for s in range(0, length, step))
            return real_native(address, length, step, stop)

        monkeypatch.setattr(pagetables, "NATIVE_STEPS", steps)
    else:
        monkeypatch.setattr(pagetables, "NATIVE_STEPS", None)
        real = pagetables.populate_range

        def populate(address: int, length: int) -> int:
            calls.append((address, length))
            return real(address, length)

        monkeypatch.setattr(pagetables, "populate_range", populate)
    return calls


@pytest.mark.parametrize("native", [True, False], ids=["extension", "python"])
def test_a_background_mapping_is_populated_a_step_at_a_time(segment, monkeypatch, native):
    """``MAP_POPULATE`` holds the address space's lock for the whole mapping (the process's
    other threads' allocations wait behind it); a step at a time, each covers one range."""
    if not pagetables.POPULATE_IN_PARALLEL:
        pytest.skip("this kernel has no MADV_POPULATE_READ (before 5.14): MAP_POPULATE is used")
    calls = _record_steps(monkeypatch, native)
    step = 3 << 20  # not a divisor of the size: a last, short step
    monkeypatch.setattr(pagetables, "POPULATE_STEP", step)
    mapping = shm.map_shared(segment, SIZE, populate=False)
    pagetables.populate_in_steps(mapping)
    try:
        base = calls[0][0]
        assert [(a - base, n) for a, n in calls] == [
            (start, min(step, SIZE - start)) for start in range(0, SIZE, step)
        ]
        assert _resident_kib(mapping) == SIZE // 1024
        assert _faults_writing_every_page(mapping) < PAGES // 100
    finally:
        mapping.close()


def test_the_extension_populates_a_step_at_a_time_where_it_is_built():
    """On x86-64 Linux the extension is built (as the copy's test requires), so the steps run
    without the interpreter lock; a build that lost the function fails here."""
    import platform

    if platform.machine() != "x86_64" or not pagetables.POPULATE_IN_PARALLEL:
        pytest.skip("the extension is required on x86-64 Linux 5.14+ only")
    assert pagetables.NATIVE_STEPS is not None


def test_the_daemons_spares_are_populated_a_step_at_a_time(monkeypatch):
    """The daemon's pool makes its spares beside its request threads: a step at a time, not
    with ``MAP_POPULATE`` (which would hold its address space's lock for the whole spare);
    every page is mapped once it is made."""
    import shutil
    import uuid

    from ckptcache.server.memory.arena import Arena

    if not pagetables.POPULATE_IN_PARALLEL:
        pytest.skip("this kernel has no MADV_POPULATE_READ (before 5.14): MAP_POPULATE is used")
    calls = _record_steps(monkeypatch, pagetables.NATIVE_STEPS is not None)
    directory = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:8]}"
    arena = Arena(directory, 256 << 20, 0o700)
    try:
        segment = arena.allocate(arena.next_name(arena.uid), SIZE, arena.uid, populate=True)
        lengths = [n for _, n in calls]
        assert sum(lengths) == SIZE and max(lengths) == pagetables.POPULATE_STEP
        assert _resident_kib(segment.mapping) == SIZE // 1024
        segment.mapping.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("native", [True, False], ids=["extension", "python"])
def test_a_stopped_population_ends_after_the_step_under_way(segment, monkeypatch, native):
    """A save that wants a spare being mapped stops its steps: the loop reads the flag before
    every step, ends after the one under way and says it did not make them all; what it made
    is mapped, the rest is not."""
    if not pagetables.POPULATE_IN_PARALLEL:
        pytest.skip("this kernel has no MADV_POPULATE_READ (before 5.14): MAP_POPULATE is used")
    if native and pagetables.NATIVE_STEPS is None:
        pytest.skip("the copy extension is not built here")
    step = 4 << 20
    stop = pagetables.Stop()
    stop.set()
    if not native:
        monkeypatch.setattr(pagetables, "NATIVE_STEPS", None)
    mapping = shm.map_shared(segment, SIZE, populate=False)
    try:
        assert pagetables.populate_in_steps(mapping, step, stop) is False
        assert _resident_kib(mapping) == 0  # stopped before its first step
        if not native:  # stopped by another thread during the third step
            stop, real = pagetables.Stop(), pagetables.populate_range
            calls: list[int] = []

            def populate(address: int, length: int) -> int:
                calls.append(length)
                if len(calls) == 3:
                    stop.set()
                return real(address, length)

            monkeypatch.setattr(pagetables, "populate_range", populate)
            assert pagetables.populate_in_steps(mapping, step, stop) is False
            assert calls == [step] * 3
            # Three steps mapped (a step's last fault maps a few pages past it: fault-around).
            assert 3 * step // 1024 <= _resident_kib(mapping) < 4 * step // 1024
        assert pagetables.populate_in_steps(mapping, step, pagetables.Stop()) is True
        assert _resident_kib(mapping) == SIZE // 1024
    finally:
        mapping.close()
