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
