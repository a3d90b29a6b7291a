"""Integers that change from save to save (step counters) are patched into a reused plan.

A training loop's checkpoint holds counters (DeepSpeed's ``global_steps``, Lightning's
``global_step``, Megatron's ``iteration``) that differ at every save. The plan cache keys an
integer by its pickled width; after one save that changes a counter, it knows where that
counter lies in the skeleton, and later saves get the cached plan with the new values written
in. The archive must be byte for byte the one a fresh flatten writes, and anything it cannot
place for sure keeps the slow path."""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import ObjectPlan, plan_object, read_object, write_object
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.format.archive import _SCATTER_FROM
from tests.helpers import assert_same


def _state(step: int, *, tensors: int = 3, extra: int = 7) -> dict[str, Any]:
    return {
        "module": {f"w{i}": torch.full((4,), float(i)) for i in range(tensors)},
        "global_steps": step,
        "global_samples": step * 32,
        "lr_scheduler": {"last_epoch": step - 1, "base": -70000, "countdown": -step},
        "optimizer": {"state": {i: {"step": torch.tensor(1.0)} for i in range(2)}},
        "extra": extra,
        "big": 2**40,  # LONG1: pinned by value
    }


def _archive(flat: Any, plan: ObjectPlan) -> tuple[bytes, Any]:
    """The archive bytes of a segment written from ``flat``/``plan`` (serialization id made
    equal) and what it loads."""
    plan = dataclasses.replace(plan, archive=plan.archive.with_serialization_id("7" * 40))
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    loaded = read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), zero_copy=False
    )
    return bytes(mapping[4096 : 4096 + plan.archive.size]), loaded


def _save(cache: PlanCache, state: Any) -> None:
    """A save through ``cache``: its archive is a fresh flatten's, and loads ``state``."""
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns")
    fresh = flatten(state)
    assert flat.skeleton == fresh.skeleton
    cached_bytes, loaded = _archive(flat, plan)
    assert cached_bytes == _archive(fresh, plan_object(fresh, "/ckpt/a.pt", "ns"))[0]
    assert_same(loaded, state)


@pytest.mark.parametrize("tensors", [3, _SCATTER_FROM], ids=["few pieces", "one scatter"])
def test_changing_counters_are_patched_into_the_cached_plan(tensors):
    cache = PlanCache()
    # Per width of the counters (BININT1, BININT2, BININT): the first save is a new
    # structure, the second changes the counters and places them, the rest are patched.
    for steps in ([1, 2, 3, 4, 5, 6], [300, 301, 302], [70000, 70001, 70002, 2**25]):
        misses, hits = cache.misses, cache.hits
        for step in steps:
            _save(cache, _state(step, tensors=tensors))
        assert (cache.misses - misses, cache.hits - hits) == (2, len(steps) - 2)


def test_the_width_is_part_of_the_structure_and_large_integers_their_value():
    small, wide = describe(_state(255)), describe(_state(256))
    assert small.key != wide.key  # BININT1 against BININT2
    cache = PlanCache()
    for big in (2**40, 2**40 + 1, 2**40 + 2):
        state = _state(1)
        state["big"] = big
        _save(cache, state)
    assert cache.hits == 0  # LONG1 values are in the key


def test_a_counter_that_starts_changing_later_is_placed_then():
    cache = PlanCache()
    for step in (1, 2, 3):
        _save(cache, _state(step))
    hits = cache.hits
    for extra in (8, 9):  # a counter that did not change until now
        _save(cache, _state(3, extra=extra))
    assert cache.hits == hits + 1  # placed at its first change, patched at its second
    _save(cache, _state(4, extra=10))  # both kinds change at once
    assert cache.hits == hits + 2


def test_skeletons_that_differ_elsewhere_are_not_patched():
    """Equal strings held once or twice pickle differently (a memo reference or a second
    copy) but describe alike; such saves are never patched from one another."""
    shared = "x" * 40
    cache = PlanCache()
    for step in range(1, 5):
        state = _state(step)
        state["names"] = [shared, shared] if step % 2 else [shared, "".join(["x"] * 40)]
        flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns")
        assert flat.skeleton == flatten(state).skeleton
        assert_same(_archive(flat, plan)[1], state)
    assert cache.hits == 0


def test_a_pickle_of_another_length_is_refused():
    _, plan = PlanCache().prepare(_state(1), "/ckpt/a.pt", "ns")
    with pytest.raises(ValueError, match="keep its length"):
        plan.archive.with_pickle(b"\x80\x02N.")
