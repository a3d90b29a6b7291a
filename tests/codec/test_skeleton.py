"""The skeleton written from the plan cache's walk is the pickler's, byte for byte, and
everything the encoder does not write falls back to the pickler."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptcache.codec.flatten import flatten
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.codec.skeleton import encode_flattened, encode_skeleton

_BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)
#: Tensors drawn from one pool: shared tensors, views of one storage, odd shapes and dtypes.
_POOL = [
    _BASE,
    _BASE[1:],
    _BASE.t(),
    _BASE[:, 2],
    _BASE.view(-1)[3:7],
    torch.zeros(()),
    torch.ones(3, dtype=torch.bfloat16),
    torch.arange(5, dtype=torch.int64),
    torch.zeros(2, 2, requires_grad=True),
    torch.zeros(0),
    torch.ones(1, 1, 1, 1, dtype=torch.float16),
    torch.tensor([True, False]),
    torch.zeros(300, dtype=torch.uint8)[::7],
    *(torch.ones(2, dtype=d) for d in (torch.int8, torch.int16, torch.int32, torch.float64)),
    torch.ones(2, dtype=torch.complex64),
    torch.ones(2, dtype=torch.complex128),
]
_STRINGS = ["w", "é", "ключ", "\U0001f600", "", "storage", "cpu", "0", "1", "latin1"]
_INTS = [0, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**64, -(2**70)]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, math.nan, math.inf]),
    st.text(max_size=6),
    st.sampled_from(_STRINGS),  # the same string objects: memoized
    st.sampled_from(_POOL),
)
keys = st.one_of(st.text(max_size=4), st.sampled_from(_STRINGS), st.integers(-3, 300))


def _ordered(items: list[tuple[Any, Any]], metadata: Any) -> collections.OrderedDict:
    value = collections.OrderedDict(items)
    if metadata is not None:
        value._metadata = metadata  # type: ignore[attr-defined]
    return value


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=5).map(tuple),
        st.dictionaries(keys, children, max_size=5),
        st.builds(
            _ordered,
            st.lists(st.tuples(keys, children), max_size=5),
            st.one_of(st.none(), st.dictionaries(st.text(max_size=3), children, max_size=2)),
        ),
        children.map(lambda c: [c, c]),  # one container (or tensor) held twice
        children.map(lambda c: {"a": c, "b": (c, c)}),
    )


values = st.recursive(scalars, _containers, max_leaves=25)


def _same_as_pickler(obj: Any) -> None:
    structure = describe(obj)
    assert structure is not None and structure.plain
    fast = encode_flattened(
        obj, structure.tensors, structure.storages, structure.columns, structure.storage_ids
    )
    flat = flatten(obj)
    assert fast is not None
    assert fast.skeleton == flat.skeleton
    assert fast.infos == flat.infos
    assert [s._cdata for s in fast.storages] == [s._cdata for s in flat.storages]
    assert all(a is b for a, b in zip(fast.tensors, flat.tensors, strict=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_the_encoder_writes_the_picklers_bytes(value: Any) -> None:
    _same_as_pickler({"root": value, "last": _POOL[0]})


@pytest.mark.parametrize("n", [2, 999, 1000, 1001, 2000, 2001])
def test_batches_of_a_thousand_items(n: int) -> None:
    # dict: a full last batch is followed by an empty one; lists and OrderedDicts: not, and
    # an OrderedDict's last batch of one item is a SETITEM.
    tensors = {f"t{i}": torch.zeros(1) for i in range(n)}
    ordered = collections.OrderedDict(tensors)
    ordered._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    _same_as_pickler({"d": tensors, "o": ordered, "l": list(tensors.values()), "i": list(range(n))})


def test_a_state_dict_with_a_thousand_and_more_memo_entries() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(300)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()
    _same_as_pickler({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


@dataclasses.dataclass
class _Point:
    x: int


def _recursive_tuple() -> Any:
    inner: list[Any] = []
    outer = (inner, torch.zeros(1))
    inner.append(outer)
    return outer


class _Dict(dict):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    "value",
    [
        b"bytes",
        b"",
        bytearray(b"x"),
        _Dict(a=1),
        {1, 2},
        _Point(1),
        argparse.Namespace(a=1),
        torch.nn.Parameter(torch.zeros(2)),
        torch.zeros(2).to_sparse(),
        torch.float32,
        _recursive_tuple(),
    ],
    ids=lambda v: type(v).__name__,
)
def test_what_the_encoder_does_not_write_falls_back(value: Any) -> None:
    obj = {"x": value, "t": torch.ones(2)}
    structure = describe(obj)
    if structure is not None and structure.plain:
        assert (
            encode_flattened(
                obj, structure.tensors, structure.storages, structure.columns,
                structure.storage_ids,
            )
            is None
        )  # fmt: skip
    # Whatever path it takes, a first save's skeleton is the pickler's.
    flat, _ = PlanCache().prepare(obj, "/o", "ns")
    assert flat.skeleton == flatten(obj).skeleton


def test_tensors_in_another_order_than_the_walks_fall_back() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    structure = describe({"a": a, "b": b})
    assert structure is not None
    swapped = {"b": b, "a": a}
    assert encode_skeleton(swapped, structure.tensors, structure.columns, "cpu") is None


def test_a_first_save_through_the_cache_is_the_picklers() -> None:
    obj = {"model": {"w": _BASE, "v": _BASE[1:]}, "step": 3, "name": "run"}
    cache = PlanCache()
    flat, _ = cache.prepare(obj, "/o", "ns")
    assert flat.skeleton == flatten(obj).skeleton
