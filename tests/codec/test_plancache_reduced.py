"""Save plans reused for states that hold objects beyond plain containers (``torch.Size``,
enum members, dataclasses, plain objects, named tuples, ``argparse.Namespace``): what
DeepSpeed's ZeRO 1/2 files and Megatron's ``args`` hold.

For each kind: a new object of the same description reuses the plan, and the archive written
from the reused plan is byte for byte the one a fresh flatten writes; a change of any field
misses the cache, and the checkpoint reloads equal to the state saved. Objects whose pickling
the walk cannot predict stay on the slow path."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import mmap
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import ObjectPlan, plan_object, read_object, write_object
from ckptcache.codec.plan.cache import PlanCache, describe
from tests.helpers import assert_same


class Stage(int, enum.Enum):  # as DeepSpeed's ZeroStageEnum
    disabled = 0
    optimizer_states = 1
    gradients = 2


class OtherStage(int, enum.Enum):
    disabled = 0
    optimizer_states = 1


class Color(enum.Enum):
    red = "r"
    blue = "b"


@dataclasses.dataclass
class Address:  # as DeepSpeed's fragment_address
    numel: int
    start: int


@dataclasses.dataclass
class OtherAddress:
    numel: int
    start: int


class Scaler:  # as DeepSpeed's LossScaler: a plain object pickled by its __dict__
    def __init__(self, scale: float, dynamic: bool):
        self.cur_scale = scale
        self.dynamic = dynamic


Pair = collections.namedtuple("Pair", "first second")
OtherPair = collections.namedtuple("OtherPair", "first second")


def _state() -> dict[str, Any]:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    scaler = Scaler(65536.0, True)
    scaler.history = torch.ones(2)  # a tensor inside an object's state
    return {
        "module": {"w": weight, "b": torch.zeros(4)},
        "param_shapes": [{"w": weight.shape, "b": torch.Size([4])}],
        "zero_stage": Stage.optimizer_states,
        "color": Color.red,
        "loss_scaler": scaler,
        "param_slice_mappings": [{"w": Address(12, 0), "b": Address(4, 12)}],
        "pair": Pair(1, "x"),
        "args": argparse.Namespace(lr=0.1, seq=(1, 2), name="run"),
    }


def _with_id(plan: ObjectPlan) -> ObjectPlan:
    """``plan`` with a fixed serialization id (each plan gets a new one), for comparing."""
    return dataclasses.replace(plan, archive=plan.archive.with_serialization_id("7" * 40))


def _archive(flat: Any, plan: ObjectPlan) -> tuple[bytes, Any]:
    """The archive bytes a segment written from ``flat``/``plan`` holds, and what it loads."""
    plan = _with_id(plan)
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    loaded = read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), zero_copy=False,
        weights_only=False,
    )  # fmt: skip
    return bytes(mapping[4096 : 4096 + plan.archive.size]), loaded


def _assert_cached_is_fresh(cache: PlanCache, state: Any) -> Any:
    """A save of ``state`` through ``cache`` writes the archive a fresh flatten writes, byte
    for byte, and it reloads equal to ``state``; returns what it loaded."""
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns")
    fresh = flatten(state)
    assert flat.skeleton == fresh.skeleton
    cached_bytes, loaded = _archive(flat, plan)
    fresh_bytes, _ = _archive(fresh, plan_object(fresh, "/ckpt/a.pt", "ns"))
    assert cached_bytes == fresh_bytes
    assert_same(loaded, state)
    return loaded


def test_a_state_of_these_objects_reuses_its_plan_byte_for_byte():
    cache = PlanCache()
    assert describe(_state()) is not None
    cache.prepare(_state(), "/ckpt/a.pt", "ns")
    again = _state()  # new objects of every kind, equal fields, new tensor bytes
    again["module"]["w"].add_(100)
    again["loss_scaler"].history.mul_(3)
    loaded = _assert_cached_is_fresh(cache, again)
    assert (cache.hits, cache.misses) == (1, 1)
    assert loaded["zero_stage"] is Stage.optimizer_states
    assert type(loaded["param_shapes"][0]["w"]) is torch.Size
    assert type(loaded["pair"]) is Pair
    assert torch.equal(loaded["loss_scaler"].history, torch.full((2,), 3.0))


def _set(key: str, value: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state[key] = value(state)

    return change


def _scaler(change: Callable[[Scaler], None]) -> Callable[[dict[str, Any]], None]:
    return lambda s: change(s["loss_scaler"])


def _address(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["param_slice_mappings"][0].update(
        w=Address(**{"numel": 12, "start": 0, **fields})
    )


def _first(state: dict[str, Any], key: str, value: Any) -> None:
    rest = dict(state)
    state.clear()
    state[key] = value
    state.update(rest)


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    # torch.Size
    "a Size's dimension": lambda s: s["param_shapes"][0].update(b=torch.Size([5])),
    "a Size's rank": lambda s: s["param_shapes"][0].update(b=torch.Size([4, 1])),
    "a Size become a tuple": lambda s: s["param_shapes"][0].update(b=(4,)),
    "a Size held twice": lambda s: s["param_shapes"][0].update(b=s["param_shapes"][0]["w"]),
    # enum members
    "another member": _set("zero_stage", lambda s: Stage.gradients),
    "an equal member of another enum": _set("zero_stage", lambda s: OtherStage.optimizer_states),
    "a member become its value": _set("zero_stage", lambda s: 1),
    "a member of a str enum": _set("color", lambda s: Color.blue),
    # dataclasses
    "a dataclass field": _address(start=1),
    "a dataclass field's type": _address(start=0.0),
    "another dataclass of equal fields": lambda s: s["param_slice_mappings"][0].update(
        w=OtherAddress(12, 0)
    ),
    "a dataclass held twice": lambda s: s["param_slice_mappings"][0].update(
        b=s["param_slice_mappings"][0]["w"]
    ),
    # plain objects (their __dict__)
    "an attribute's value": _scaler(lambda o: setattr(o, "cur_scale", 32768.0)),
    "an attribute's type": _scaler(lambda o: setattr(o, "dynamic", 1)),
    "an attribute added": _scaler(lambda o: setattr(o, "extra", None)),
    "an attribute removed": _scaler(lambda o: delattr(o, "dynamic")),
    "attributes reordered": _scaler(lambda o: setattr(o, "cur_scale", vars(o).pop("cur_scale"))),
    "a tensor attribute's shape": _scaler(lambda o: setattr(o, "history", torch.ones(3))),
    "an object's dict held before it": lambda s: _first(s, "its_dict", vars(s["loss_scaler"])),
    # named tuples and Namespaces
    "a named tuple's field": _set("pair", lambda s: Pair(2, "x")),
    "an equal named tuple of another class": _set("pair", lambda s: OtherPair(1, "x")),
    "a named tuple become a tuple": _set("pair", lambda s: (1, "x")),
    "a Namespace's value": lambda s: setattr(s["args"], "lr", 0.2),
    "a Namespace's tuple": lambda s: setattr(s["args"], "seq", (1, 3)),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_changed_field_misses_the_cache_and_reloads_what_was_saved(change):
    cache = PlanCache()
    cache.prepare(_state(), "/ckpt/a.pt", "ns")
    state = _state()
    CHANGES[change](state)
    structure = describe(state)
    assert structure is not None
    old = describe(_state())
    assert (structure.key, structure.ints) != (old.key, old.ints)
    _assert_cached_is_fresh(cache, state)
    assert (cache.hits, cache.misses) == (0, 2)  # a miss: flattened afresh
    again = _state()
    CHANGES[change](again)
    _assert_cached_is_fresh(cache, again)  # and now known
    assert cache.hits == 1


def test_an_object_holding_itself_reuses_its_plan():
    cache = PlanCache()
    for _ in range(2):
        state = _state()
        state["loss_scaler"].me = state["loss_scaler"]
        flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns")
        assert flat.skeleton == flatten(state).skeleton
    assert (cache.hits, cache.misses) == (1, 1)
    _, loaded = _archive(flat, plan)
    assert loaded["loss_scaler"].me is loaded["loss_scaler"]
    assert loaded["loss_scaler"].cur_scale == 65536.0


class WithReduce:
    def __init__(self) -> None:
        self.calls = 0

    def __reduce__(self) -> Any:
        self.calls += 1  # a reduction the walk cannot predict
        return (WithReduce, ())


class WithGetstate:
    def __getstate__(self) -> dict[str, Any]:
        return {"at": id(self)}


class WithSlots:
    __slots__ = ("a",)

    def __init__(self) -> None:
        self.a = 1


class WithGetattr:
    def __getattr__(self, name: str) -> Any:
        return 1


class Listish(list):  # type: ignore[type-arg]
    pass


class Dictish(dict):  # type: ignore[type-arg]
    pass


class Meta(type):
    pass


class WithMeta(metaclass=Meta):
    pass


class CustomEnum(enum.Enum):
    a = 1

    def __reduce_ex__(self, proto: int) -> Any:
        return getattr, (CustomEnum, "a")


def _instance_override() -> Scaler:
    scaler = Scaler(1.0, False)
    scaler.__reduce_ex__ = lambda proto: (Scaler, (2.0, True))  # type: ignore[method-assign]
    return scaler


UNPREDICTABLE: dict[str, Callable[[], Any]] = {
    "__reduce__": WithReduce,
    "__getstate__": WithGetstate,
    "__slots__": WithSlots,
    "__getattr__": WithGetattr,
    "a list subclass": lambda: Listish([1]),
    "a dict subclass": lambda: Dictish(a=1),
    "a metaclass": WithMeta,
    "a class of a metaclass": lambda: WithMeta,
    "an enum's own __reduce_ex__": lambda: CustomEnum.a,
    "an instance's __reduce_ex__": _instance_override,
    "a set in an object's state": lambda: Scaler({1.0}, False),  # type: ignore[arg-type]
    "a Parameter": lambda: torch.nn.Parameter(torch.ones(2)),
}


@pytest.mark.parametrize("make", list(UNPREDICTABLE), ids=list(UNPREDICTABLE))
def test_objects_whose_pickling_is_not_predictable_are_flattened_every_time(make):
    cache = PlanCache()
    state = {"odd": UNPREDICTABLE[make](), "t": torch.ones(2)}
    assert describe(state) is None
    for _ in range(2):
        flat, _ = cache.prepare(state, "/ckpt/a.pt", "ns")
    assert (cache.hits, cache.misses) == (0, 2)
    assert flat.skeleton == flatten(state).skeleton


def test_the_deepspeed_shapes_of_an_optimizer_file_reuse_their_plan():
    """The types of a DeepSpeed ZeRO 1/2 optimizer file, where DeepSpeed is installed."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    del deepspeed

    def optim() -> dict[str, Any]:
        return {
            "loss_scaler": LossScaler(1.0),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [{"w": fragment_address(numel=12, start=0)}],
            "single_partition_of_fp32_groups": [torch.ones(12)],
        }

    cache = PlanCache()
    cache.prepare(optim(), "/ckpt/a.pt", "ns")
    loaded = _assert_cached_is_fresh(cache, optim())
    assert cache.hits == 1
    assert loaded["zero_stage"] is ZeroStageEnum.gradients
    changed = optim()
    changed["loss_scaler"].cur_scale = 2.0
    _assert_cached_is_fresh(cache, changed)
    assert cache.hits == 1


def test_a_reused_plan_still_catches_a_tensor_changed_inside_an_object():
    """A non-blocking save's check covers the tensors held by described objects (a
    Namespace, a plain object's ``__dict__``) when the plan is reused."""
    from ckptcache.client._async import VersionCheck
    from ckptcache.errors import TensorMutated

    cache = PlanCache()
    cache.prepare(_state(), "/ckpt/a.pt", "ns")
    state = _state()
    state["args"].mask = torch.ones(3)
    cache.prepare(state, "/ckpt/a.pt", "ns")
    flat, _ = cache.prepare(state, "/ckpt/a.pt", "ns")
    assert cache.hits == 1
    assert any(t is state["loss_scaler"].history for t in flat.tensors)
    assert any(t is state["args"].mask for t in flat.tensors)
    for holder, name in ((state["loss_scaler"], "history"), (state["args"], "mask")):
        check = VersionCheck(state, "/ckpt/a.pt", flat)
        getattr(holder, name).add_(1)
        with pytest.raises(TensorMutated, match="modified in place"):
            check.check()
