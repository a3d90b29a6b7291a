"""Save plans reused by structure: a reused plan is exactly the fresh one, and any change of
structure (keys, shapes, dtypes, strides, sharing, scalar values, container kinds) makes a
fresh one."""

from __future__ import annotations

import collections
import io
import mmap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, read_object, write_object
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.errors import SerializationError
from tests.helpers import assert_same


def _state() -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    metadata = collections.OrderedDict(w=torch.ones(2, 2), b=torch.zeros(2))
    metadata._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": metadata,
        "base": base,
        "view": base[1:],
        "t": base.t(),
        "opt": {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, dtype=torch.bfloat16)}
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "amsgrad": False}],
        },
        "step": 7,
        "name": "run",
        "raw": b"\x00\x01",
        "nothing": None,
        "loss": -0.0,
    }


def _fresh(obj: Any) -> tuple[Any, Any]:
    flat = flatten(obj)
    return flat, plan_object(flat, "/ckpt/a.pt", "ns")


def _assert_plan_is_fresh(cache: PlanCache, obj: Any) -> None:
    """What the cache gives for ``obj`` is what a fresh flatten and plan give."""
    flat, plan = cache.prepare(obj, "/ckpt/a.pt", "ns")
    want_flat, want_plan = _fresh(obj)
    assert flat.skeleton == want_flat.skeleton
    assert flat.infos == want_flat.infos
    assert [s._cdata for s in flat.storages] == [s._cdata for s in want_flat.storages]
    assert [id(t) for t in flat.tensors] == [id(t) for t in want_flat.tensors]
    assert plan.manifest.storages == want_plan.manifest.storages
    assert plan.layout.payload_size == want_plan.layout.payload_size
    assert plan.archive.storage_offsets == want_plan.archive.storage_offsets


def _write_and_read(flat: Any, plan: Any) -> tuple[Any, bytes]:
    """The object a segment written from ``flat``/``plan`` holds, and its archive's bytes."""
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    archive = bytes(mapping[4096 : 4096 + plan.archive.size])
    return read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), zero_copy=False
    ), archive


def test_same_structure_reuses_the_plan_with_the_new_bytes():
    cache = PlanCache()
    state = _state()
    cache.prepare(state, "/ckpt/a.pt", "ns")
    assert (cache.hits, cache.misses) == (0, 1)
    again = _state()  # other tensor objects, same structure, new bytes
    again["base"].add_(100)
    flat, plan = cache.prepare(again, "/ckpt/b.pt", "other")
    assert (cache.hits, cache.misses) == (1, 1)
    assert plan.manifest.path == "/ckpt/b.pt" and plan.manifest.namespace == "other"
    _assert_plan_is_fresh(cache, again)
    loaded, archive = _write_and_read(flat, plan)
    assert_same(loaded, again)
    # The segment's payload is still an archive plain torch.load reads.
    assert_same(torch.load(io.BytesIO(archive), weights_only=True), again)


def test_a_reused_plan_has_a_new_serialization_id_and_time():
    cache = PlanCache()
    _, first = cache.prepare(_state(), "/ckpt/a.pt", "ns")
    _, second = cache.prepare(_state(), "/ckpt/a.pt", "ns")
    assert cache.hits == 1
    assert second.manifest.created >= first.manifest.created
    ids = [dict(p.archive.pieces)[p.archive.pieces[p.archive.id_piece][0]] for p in (first, second)]
    assert len(ids[0]) == len(ids[1]) == 40


def _set(key: str, value: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state[key] = value(state)

    return change


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "a new key": _set("extra", lambda s: torch.ones(1)),
    "a key removed": lambda s: s.pop("name"),
    "keys reordered": lambda s: s.update(name=s.pop("name")),
    "a changed shape": _set("base", lambda s: torch.zeros(4, 3)),
    "a changed dtype": _set("base", lambda s: s["base"].double()),
    "a changed stride": _set("t", lambda s: s["t"].contiguous()),
    "a tensor replaced by a view": _set("base", lambda s: torch.zeros(24)[:12].view(3, 4)),
    "a view made its own tensor": _set("view", lambda s: s["view"].clone()),
    "a changed storage offset": _set("view", lambda s: s["base"].view(-1)[2:10].view(2, 4)),
    "storage sharing broken": _set("t", lambda s: s["base"].clone().t()),
    "requires_grad": _set("base", lambda s: s["base"].clone().requires_grad_()),
    "an int value": _set("step", lambda s: 8),
    "an int become a bool": _set("step", lambda s: True),
    "a float's sign": _set("loss", lambda s: 0.0),
    "a nested scalar": lambda s: s["opt"]["param_groups"][0].update(lr=0.2),
    "a tuple become a list": lambda s: s["opt"]["param_groups"][0].update(betas=[0.9, 0.999]),
    "a str value": _set("name", lambda s: "other"),
    "bytes": _set("raw", lambda s: b"\x00\x02"),
    "the OrderedDict's attributes": lambda s: s["model"]._metadata.update(x={"version": 2}),
    "a dict become an OrderedDict": _set("opt", lambda s: collections.OrderedDict(s["opt"])),
    "a dict held twice": _set("nothing", lambda s: s["opt"]),
    "a tensor held twice": _set("nothing", lambda s: s["base"]),
    "an int key": lambda s: s["opt"]["state"].update({1: s["opt"]["state"].pop(0)}),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_changed_structure_gets_a_fresh_plan(change):
    cache = PlanCache()
    cache.prepare(_state(), "/ckpt/a.pt", "ns")
    state = _state()
    CHANGES[change](state)
    new, old = describe(state), describe(_state())
    assert (new.key, new.ints) != (old.key, old.ints)  # integers: by width in the key
    _assert_plan_is_fresh(cache, state)
    assert cache.hits == 0  # a miss: the new structure was flattened afresh
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns")  # and is now known
    assert cache.hits == 1
    assert_same(_write_and_read(flat, plan)[0], state)


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "kept by the pickle"  # type: ignore[attr-defined]
    return t


def _with_hook(t: torch.Tensor) -> torch.Tensor:
    t.register_hook(lambda grad: grad)
    return t


@pytest.mark.parametrize(
    "odd",
    [
        {"p": torch.nn.Parameter(torch.ones(2))},
        {"c": torch.ones(2, dtype=torch.complex64).conj()},
        {"s": {1, 2}},
        {"n": torch.ones(2, dtype=torch.complex64)._neg_view()},
        {"w": torch.ones(2), "a": _with_attribute(torch.ones(2))},
        {"w": torch.ones(2), "h": _with_hook(torch.ones(2, requires_grad=True))},
        {"q": torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)},
        {"r": torch.ones(2, dtype=torch.complex64).conj().imag},
    ],
    ids=["parameter", "conj", "set", "neg", "attribute", "hook", "quantized", "neg-real"],
)
def test_other_objects_are_flattened_every_time(odd):
    cache = PlanCache()
    assert describe(odd) is None
    for _ in range(2):
        flat, plan = cache.prepare(odd, "/ckpt/a.pt", "ns")
        assert flat.skeleton == flatten(odd).skeleton
    assert (cache.hits, cache.misses) == (0, 2)
    loaded = read_object_private(flat, plan)
    assert_same(loaded, {k: (v.resolve_conj() if k == "c" else v) for k, v in odd.items()})


def read_object_private(flat: Any, plan: Any) -> Any:
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    return read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), zero_copy=False,
        weights_only=False,
    )  # fmt: skip


def test_a_self_containing_list_round_trips():
    loop: list[Any] = [torch.ones(2)]
    loop.append(loop)
    cache = PlanCache()
    for _ in range(2):
        flat, plan = cache.prepare({"loop": loop}, "/ckpt/a.pt", "ns")
    assert cache.hits == 1
    out = read_object_private(flat, plan)["loop"]
    assert out[1] is out and torch.equal(out[0], loop[0])


def test_one_storage_as_two_dtypes_is_refused_after_a_cached_plan():
    cache = PlanCache()
    base = torch.zeros(4)
    cache.prepare({"a": base, "b": base.clone()}, "/ckpt/a.pt", "ns")
    with pytest.raises(SerializationError, match="different dtypes"):
        cache.prepare({"a": base, "b": base.view(torch.int32)}, "/ckpt/a.pt", "ns")


def test_the_cache_keeps_no_tensor_alive_and_evicts_the_oldest():
    import weakref

    cache = PlanCache(size=2)
    tensor = torch.ones(3)
    ref = weakref.ref(tensor)
    cache.prepare({"t": tensor}, "/ckpt/a.pt", "ns")
    del tensor
    assert ref() is None
    for n in (1, 2, 3):
        cache.prepare({"t": torch.ones(n)}, "/ckpt/a.pt", "ns")
    cache.prepare({"t": torch.ones(3)}, "/ckpt/a.pt", "ns")  # still held
    assert cache.hits == 1
    cache.prepare({"t": torch.ones(1)}, "/ckpt/a.pt", "ns")  # evicted
    assert cache.hits == 1


def test_a_reused_plan_carries_what_a_non_blocking_save_checks():
    """The walk records each tensor's version counter and storage, as the check of a
    non-blocking save needs them (an inference-mode tensor has no counter: ``None``), so a
    tensor modified after the submit of a save with a reused plan is still caught."""
    from ckptcache.client._async import VersionCheck
    from ckptcache.errors import TensorMutated

    with torch.inference_mode():
        frozen = torch.ones(2)
    cache = PlanCache()
    state = {"w": torch.ones(3), "frozen": frozen}
    cache.prepare(state, "/ckpt/a.pt", "ns")
    state["w"].add_(1)
    flat, _ = cache.prepare(state, "/ckpt/a.pt", "ns")
    assert cache.hits == 1
    rows = zip(flat.tensors, flat.versions, flat.storage_ids, state.values(), strict=True)
    assert [(t is s, v, sid) for t, v, sid, s in rows] == [
        (True, state["w"]._version, state["w"].untyped_storage()._cdata),
        (True, None, frozen.untyped_storage()._cdata),
    ]
    check = VersionCheck(state, "/ckpt/a.pt", flat)
    assert check.flat.storages[1]._cdata != frozen.untyped_storage()._cdata  # snapshot taken
    state["w"].mul_(2)
    with pytest.raises(TensorMutated, match="'w'"):
        check.check()


def test_metadata_of_many_pieces_written_as_one_scatter_is_the_pieces():
    """A plan of many pieces writes them in one scatter (kept for its replans, with the new
    serialization id patched in): the bytes are those of writing each piece."""
    from ckptcache.format.archive import _SCATTER_FROM

    state = {f"t{i}": torch.full((i % 5 + 1,), float(i)) for i in range(_SCATTER_FROM)}
    cache = PlanCache()
    _, plan = cache.prepare(state, "/ckpt/a.pt", "ns")
    _, replanned = cache.prepare(state, "/ckpt/a.pt", "ns")
    plan.archive.write_metadata(memoryview(bytearray(plan.archive.size)))  # scatter made
    time.sleep(0.001)
    _, carried = cache.prepare(state, "/ckpt/a.pt", "ns")  # a replan that carries it over
    assert carried.archive._scatter
    for archive in (plan.archive, replanned.archive, carried.archive):
        assert len(archive.pieces) >= _SCATTER_FROM
        _assert_scatter_writes_pieces(archive)
    assert (
        plan.archive.pieces[plan.archive.id_piece]
        != replanned.archive.pieces[plan.archive.id_piece]
    )


def _flat_level(n: int = 12) -> dict[Any, Any]:
    return {f"layers.{i}.weight": torch.full((2, i + 1), float(i)) for i in range(n)}


FLAT_CHANGES: dict[str, Callable[[dict[Any, Any]], Any]] = {
    "none": lambda s: s,
    "a tensor held twice": lambda s: s.update(twice=s["layers.3.weight"]),
    "a tensor seen before the dict": lambda s: {"first": s["layers.5.weight"], "sd": s},
    "an int key": lambda s: s.update({7: torch.ones(1)}),
    "a parameter": lambda s: s.update(p=torch.nn.Parameter(torch.ones(2))),
    "a scalar value": lambda s: s.update(step=3),
    "a nested dict": lambda s: {"model": s, "opt": dict(_flat_level(9))},
    "a view of another": lambda s: s.update(v=s["layers.4.weight"][1:]),
}


@pytest.mark.parametrize("change", list(FLAT_CHANGES), ids=list(FLAT_CHANGES))
def test_a_flat_level_walked_in_one_step_is_walked_as_item_by_item(monkeypatch, change):
    """A dict of string keys and tensors seen for the first time is added to the key by C
    calls: the key, the tensors and their marks are the per-item walk's; anything else in
    the dict (a tensor held twice or seen before, another key or value) walks it item by
    item."""
    from ckptcache.codec.plan import columns as plan_columns

    state = _flat_level()
    obj = FLAT_CHANGES[change](state) or state
    bulk = describe(obj)
    monkeypatch.setattr(plan_columns, "_BULK_FROM", 1 << 30)
    each = describe(obj)
    assert (bulk is None) == (each is None)
    if bulk is not None:
        assert bulk.key == each.key and bulk.ints == each.ints
        assert [id(t) for t in bulk.tensors] == [id(t) for t in each.tensors]
        cache = PlanCache()
        cache.prepare(obj, "/ckpt/a.pt", "ns")
        _assert_plan_is_fresh(cache, obj)
        assert cache.hits == 1


def test_a_tensor_off_the_cpu_and_cuda_is_not_described():
    state = _flat_level()
    state["layers.2.weight"] = torch.empty(2, 3, device="meta")
    assert describe(state) is None


def test_dimensions_moved_between_tensors_change_the_key():
    one = describe({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    other = describe({"a": torch.zeros(2), "b": torch.zeros(3, 4)})
    assert one is not None and other is not None and one.key != other.key


def test_a_blocking_save_reads_no_version_counter_and_shares_the_plan():
    cache = PlanCache()
    state = _state()
    cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    counted, _ = cache.prepare(state, "/ckpt/a.pt", "ns", versions=True)
    blocking, _ = cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    assert (cache.hits, cache.misses) == (2, 1)
    assert counted.versions == tuple(t._version for t in counted.tensors)
    assert blocking.versions == () and blocking.skeleton == counted.skeleton
    described = describe(state, versions=False)
    assert described is not None and described.versions == ()


def test_a_shared_scatter_writes_each_replan_s_own_pickle_and_id():
    """The scatter leaves out the large pieces and the two a replan changes (the pickle, the
    serialization id): replans share it and still write their own bytes."""
    from ckptcache.format.archive import _DIRECT_FROM

    state = {f"layers.{i}.weight": torch.full((i % 7 + 1,), float(i)) for i in range(300)}
    state["step"] = 1
    archive = PlanCache().prepare(state, "/ckpt/a.pt", "ns")[1].archive
    assert max(len(data) for _, data in archive.pieces) >= _DIRECT_FROM
    archive.write_metadata(memoryview(bytearray(archive.size)))  # the scatter made
    pickled = bytearray(archive.pieces[1][1])
    pickled[-5:-1] = b"\x00\x01\x02\x03"  # another pickle of the same length
    others = (archive.with_serialization_id("9" * 40), archive.with_pickle(bytes(pickled)))
    for other in others:
        assert other._scatter and other._scatter[0] is archive._scatter[0]
        _assert_scatter_writes_pieces(other)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_not_described(layout):
    """No column reads ``is_nested``: a strided nested tensor has no shape (the walk's read
    raises) and a jagged one another layout; either way the walk hands it to the flatten."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    assert describe({f"w{i}": torch.ones(2) for i in range(9)} | {"n": nested}) is None


def _assert_scatter_writes_pieces(archive: Any) -> None:
    """The archive's metadata written by its scatter equals its pieces written one by one."""
    scattered = bytearray(b"\xee" * archive.size)
    archive.write_metadata(memoryview(scattered))
    one_by_one = bytearray(b"\xee" * archive.size)
    for offset, data in archive.pieces:
        one_by_one[offset : offset + len(data)] = data
    assert scattered == one_by_one
