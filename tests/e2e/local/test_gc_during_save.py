"""A save runs no cyclic garbage collection: its plan's thousands of short-lived tuples would
set off collections, now and then of the trainer's whole heap, inside the stall (a full one of
115 ms was seen inside a first save of 2,072 tensors)."""

from __future__ import annotations

import gc

import torch

import ckptcache
import ckptcache.client._saves as saves_module


def _state(n: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((16,), float(i)) for i in range(n)}


def test_no_collection_inside_a_save_and_the_collector_is_back_after(client, tmp_path, monkeypatch):
    inside: list[bool] = [False]
    collections: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and inside[0]:
            collections.append(info["generation"])

    real = saves_module.Saves._save

    def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return real(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(saves_module.Saves, "_save", timed)
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # a collection every 50 new objects: hundreds in a save
    gc.callbacks.append(watch)
    try:
        state = _state(1500)
        for i, path in enumerate(("a.pt", "a.pt", "b.pt")):  # first, repeated, new path
            ckptcache.save(state, tmp_path / path)
            assert gc.isenabled(), f"save {i} left the collector off"
        handle = ckptcache.save(state, tmp_path / "c.pt", blocking=False)
        assert handle is not None
        handle.wait()
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
    assert collections == []
    assert gc.isenabled()
    loaded = ckptcache.load(tmp_path / "b.pt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_the_wait_for_storage_runs_with_the_collector_on(daemon_factory, tmp_path, monkeypatch):
    """``durability="persisted"`` waits for storage after the commit, minutes at times: the
    trainer's other threads must have their collector meanwhile."""
    import ckptcache.client._waits as waits_module

    seen: list[bool] = []
    real = waits_module.Waits.persisted

    def recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(waits_module.Waits, "persisted", recorded)
    root = tmp_path / "store"
    root.mkdir()
    d = daemon_factory("--memory-limit", "256MiB", "--persist-root", str(root))
    state = _state(200)
    path = str(root / "p.pt")
    with d.client(fallback="raise") as c:
        c.save(state, path, durability="persisted")
        assert seen == [True]
        assert c.status(path).persist_state == "persisted"
    on_disk = torch.load(path)  # the persisted file itself, as plain torch reads it
    assert all(torch.equal(on_disk[k], v) for k, v in state.items())
