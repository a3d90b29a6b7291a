"""The memory budget under pressure: evict, wait, write through; never grow past the limit."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from ckptcache.errors import BudgetExceeded, CkptCacheWarning, ObjectTooLarge
from tests.helpers import thread_inside, wait_until

MIB = 1 << 20


def blob(mib: int, fill: float = 0.0) -> dict:
    return {"w": torch.full((mib * MIB // 4 - 1024,), float(fill))}


def test_superseded_generations_are_evicted_for_new_paths(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "24MiB", "--reserve-timeout", "1")
    with d.client() as c:
        for i in range(5):  # two generations of one path, then other paths
            c.save(blob(5, i), str(tmp_path / ("same.pt" if i < 2 else f"p{i}.pt")))
            assert d.segment_bytes() <= 24 * MIB
        assert c.status(str(tmp_path / "same.pt")).generation == 2  # newest kept
        assert torch.equal(c.load(str(tmp_path / "same.pt"))["w"][:3], torch.ones(3))


def test_full_budget_waits_then_writes_through(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "12MiB", "--reserve-timeout", "0.5")
    with d.client() as c:
        c.save(blob(5), str(tmp_path / "a.pt"))
        c.save(blob(5), str(tmp_path / "b.pt"))
        target = tmp_path / "c.pt"
        with pytest.warns(CkptCacheWarning, match="straight to storage"):
            c.save(blob(5, 3.0), str(target))
        assert target.exists()  # written through with torch.save
        assert torch.load(target)["w"][0].item() == 3.0
        assert not any(o.path == str(target) for o in c.list())
        assert c.load(str(target))["w"][0].item() == 3.0  # load falls back to the file
        assert d.segment_bytes() <= 12 * MIB
        with d.client(fallback="raise") as strict, pytest.raises(BudgetExceeded, match="no room"):
            strict.save(blob(5), str(tmp_path / "d.pt"))


def test_waiting_save_proceeds_when_a_pin_is_released(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "12MiB", "--reserve-timeout", "20", "--keep", "1")
    path = str(tmp_path / "a.pt")
    with d.client() as c, d.client() as reader:
        c.save(blob(5, 1.0), path)
        held = reader.load(path)  # pins generation 1
        c.save(blob(5, 2.0), path)  # generation 1 retired but pinned
        done = threading.Event()

        def third_save():
            c.save(blob(5, 3.0), str(tmp_path / "b.pt"))
            done.set()

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = threading.Thread(target=third_save)
            t.start()
            # The save has sent its reservation and waits for the daemon's answer.
            wait_until(lambda: thread_inside(t, "request", kind="reserve"), 30, "the reserve")
            assert not done.is_set()  # blocked on the budget, not written through
            assert held["w"][0].item() == 1.0  # the pinned copy is intact
            del held
            reader.status(path)  # any call flushes the released pin
            t.join(30)
        assert done.is_set()
        assert c.load(str(tmp_path / "b.pt"))["w"][0].item() == 3.0
        assert not (tmp_path / "b.pt").exists()


def test_object_larger_than_budget(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "4MiB", "--pool-bytes", "0")  # no spares
    with (
        d.client(fallback="raise") as c,
        pytest.raises(ObjectTooLarge, match="whole memory budget"),
    ):
        c.save(blob(8), str(tmp_path / "big.pt"))
    with d.client() as c, pytest.warns(CkptCacheWarning):
        c.save(blob(8), str(tmp_path / "big.pt"))
    assert (tmp_path / "big.pt").exists()
    assert d.segment_bytes() == 0


def test_a_zero_copy_load_is_unpinned_when_its_last_reference_goes(daemon, tmp_path):
    """The pin of a zero-copy load goes with the last reference to what it returned, not at
    some later garbage collection (no reference cycle holds its storages). The collector is
    off throughout: a pin held by a cycle would never go. The reader's first contact also
    plans the job's saves in the background (``client/_plans.py``), a zero-copy load of its
    own that lets its pin go once planned."""
    import gc

    path = str(tmp_path / "a.pt")
    with daemon.client() as c, daemon.client() as reader:
        c.save({"w": torch.ones(1 << 16), "b": torch.zeros(8)}, path)
        gc.collect()
        gc.disable()
        try:
            held = reader.load(path)
            assert reader.status(path).pins >= 1
            del held
            wait_until(lambda: reader.status(path).pins == 0, timeout=30)
        finally:
            gc.enable()
