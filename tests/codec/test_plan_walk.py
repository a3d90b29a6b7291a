"""The plan cache's compiled walk (``codec/table/_walk.cpp``) against the Python one
(``describe``): the same key token for token, the same tensors, storages, integers, version
counters and columns on many shapes; objects it does not describe left to the Python walk;
compact keys equal exactly when the Python keys are; and through the plan cache, a save that
always writes the trainer's current bytes, a changed structure always planned afresh, on the
compiled walk and on the Python one alone (where the module is not built)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import math
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ckptcache.codec.objectio import read_object, write_object
from ckptcache.codec.plan import walk as plan_walk
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.codec.plan.walk import Sources, reference_key, walk
from ckptcache.errors import TensorMutated
from ckptcache.format.layout import HEADER_SIZE
from tests.helpers import assert_same

needs_compiled = pytest.mark.skipif(
    plan_walk.COMPILED is None, reason="the C++ module is not built here"
)


@pytest.fixture(params=[pytest.param("C++", marks=needs_compiled), "Python"])
def walked_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plan cache's walk: the compiled one, or the Python one alone (as where the
    module is not built)."""
    if request.param == "Python":
        monkeypatch.setattr(plan_walk, "COMPILED", None)
    return str(request.param)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


#: The dtypes ``torch.save`` writes through ``_rebuild_tensor_v2``.
SAVED = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip


def _dtypes(kind: str) -> list[torch.dtype]:
    """This torch's dtypes: ``saved`` (:data:`SAVED`), ``v3`` (those torch saves through
    ``_rebuild_tensor_v3``: float8s, uint16-64, complex32...) or ``other`` (the rest, bar
    the quantized: sub-byte ints, which ``torch.save`` cannot write)."""
    v3 = torch.storage._new_dtypes()
    every = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    quantized = {d for d in every if str(d).startswith(("torch.qint", "torch.quint"))}
    chosen = {"saved": set(SAVED), "v3": every & v3}.get(kind, every - v3 - quantized - set(SAVED))
    return sorted(chosen, key=str)


def _every_dtype(kind: str = "saved") -> dict[str, torch.Tensor]:
    out = {}
    for d in _dtypes(kind):
        try:
            out[str(d)] = torch.zeros(3, 2, dtype=torch.uint8).view(d)
        except (RuntimeError, TypeError):  # an item size other than a byte's
            out[str(d)] = torch.zeros(3, 2 * d.itemsize, dtype=torch.uint8).view(d)
    return out


def _model() -> collections.OrderedDict[str, Any]:
    sd = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).state_dict()
    return sd


def _moved() -> collections.OrderedDict[str, Any]:
    od = collections.OrderedDict((f"k{i}", torch.full((2,), float(i))) for i in range(10))
    od.move_to_end("k2")
    od.move_to_end("k0", last=False)
    return od


def _optimizer() -> dict[str, Any]:
    p = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))]
    opt = torch.optim.AdamW(p, lr=1e-3)
    for q in p:
        q.grad = torch.ones_like(q)
    opt.step()
    return opt.state_dict()


def _shared() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    matrix = base.view(4, 6)
    return {
        "base": base, "matrix": matrix, "t": matrix.t(), "tail": base[5:], "cols": matrix[:, ::2],
        "again": base, "tied": {"w": matrix}, "offset": base[7:19].view(3, 4),
    }  # fmt: skip


def _leaves() -> dict[Any, Any]:
    same = {"x": torch.ones(1)}
    listed = [torch.zeros(2), 3]
    return {
        "int": 7, "wide": 70_000, "neg": -5, "int32max": 2**31 - 1, "int64": 2**40,
        "negwide": -(2**40), "float": 0.5, "negzero": -0.0, "inf": math.inf,
        "true": True, "false": False, "none": None, "str": "héllo ✓", "astral": "\U0001f600",
        "bytes": b"\x00\xff", "tuple": (1, (2.0, "x")), "empty": [], "emptyd": {}, "emptyt": (),
        "same": same, "same2": same, "listed": listed, "listed2": listed,
        1: "int key", (1, 2): "tuple key", None: "none key", 2.5: "float key",
    }  # fmt: skip


def _flat(n: int = 12) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((2, i + 1), float(i)) for i in range(n)}


def _inference() -> dict[str, Any]:
    with torch.inference_mode():
        made = torch.ones(3)
    return {"made": made, "normal": torch.ones(2)}


def _deep(depth: int) -> Any:
    obj: Any = torch.ones(1)
    for i in range(depth):
        obj = {"d": obj, "i": i} if i % 2 else [obj]
    return obj


#: States both walks describe: the compiled walk's key must be the Python walk's.
DESCRIBED: dict[str, Callable[[], Any]] = {
    "flat state dict": _flat,
    "nested dicts": lambda: {"a": {"b": {"c": torch.ones(2)}, "d": [torch.zeros(3)]}},
    "model OrderedDict with _metadata": _model,
    "OrderedDict in its own order": _moved,
    "optimizer state": _optimizer,
    "shared storages, views, offsets, non-contiguous": _shared,
    "non-tensor leaves": _leaves,
    "every dtype": _every_dtype,
    "zero-size": lambda: {"e": torch.empty(0), "e2": torch.empty(3, 0), "s": torch.tensor(1.0)},
    "requires_grad": lambda: {"g": torch.ones(2, requires_grad=True), "n": torch.ones(2)},
    "inference tensor": _inference,
    "a list at the top": lambda: [torch.ones(2), {"x": torch.ones(3)}, (torch.ones(1),)],
    "a tensor at the top": lambda: torch.arange(6).view(2, 3).t(),
    "deep": lambda: _deep(60),
    "empty": dict,
    "the MoE shape": lambda: {
        f"layers.{i}": {
            f"experts.{e}": {"w1": torch.ones(4), "w2": torch.ones(4)} for e in range(5)
        }
        for i in range(3)
    },
}

#: States the Python walk describes through reductions, or refuses: the compiled walk leaves
#: them to it (``None``).
LEFT_TO_PYTHON: dict[str, Callable[[], Any]] = {
    "torch.Size": lambda: {"shape": torch.Size([2, 3]), "w": torch.ones(2)},
    "enum": lambda: {"c": Color.RED, "w": torch.ones(2)},
    "dataclass": lambda: {"cfg": Config(), "w": torch.ones(2)},
    "a class": lambda: {"cls": Config, "w": torch.ones(2)},
    "parameter": lambda: {"p": torch.nn.Parameter(torch.ones(2))},
    "sparse": lambda: {"s": torch.eye(3).to_sparse()},
    "meta": lambda: {"m": torch.empty(2, device="meta")},
    "conj": lambda: {"c": torch.ones(2, dtype=torch.complex64).conj()},
    "neg": lambda: {"n": torch.ones(2, dtype=torch.complex64)._neg_view()},
    "quantized": lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)},
    "attribute": lambda: {"a": _with_attribute(torch.ones(2))},
    "hook": lambda: {"h": _with_hook(torch.ones(2, requires_grad=True))},
    "str subclass key": lambda: {_Name("k"): torch.ones(1)},
    "dict subclass": lambda: {"d": collections.defaultdict(int, a=1)},
    "set": lambda: {"s": {1, 2}},
    "one storage as two dtypes": lambda: _two_dtypes(),
    "float8, uint16-64, complex32 (torch's v3 rebuild)": lambda: _every_dtype("v3"),
}

#: States the Python walk describes as plain ones where the compiled walk stops: they are
#: still planned once and reused, by the Python walk's key.
PLAIN_LEFT_TO_PYTHON: dict[str, Callable[[], Any]] = {
    "beyond 64 bits": lambda: {"big": 2**70, "w": torch.ones(1)},
    "deeper than the compiled walk goes": lambda: _deep(450),
}


class _Name(str):
    pass


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "kept by the pickle"  # type: ignore[attr-defined]
    return t


def _with_hook(t: torch.Tensor) -> torch.Tensor:
    t.register_hook(lambda grad: grad)
    return t


def _two_dtypes() -> dict[str, torch.Tensor]:
    base = torch.zeros(4, dtype=torch.float32)
    return {"f": base, "i": base.view(torch.int32)}


def _assert_same_walk(obj: Any) -> None:
    """The compiled walker's reference key, tensors, integers, counters and columns are the
    Python walk's; its compact walk found the same tensors and storages."""
    python = describe(obj, versions=True)
    assert python is not None
    ref = reference_key(obj, versions=True)
    assert ref is not None
    assert ref.key == python.key
    assert type(ref.key) is tuple and len(ref.key) == len(python.key)
    assert [id(t) for t in ref.tensors] == [id(t) for t in python.tensors]
    assert tuple(ref.ints) == python.ints
    assert tuple(ref.versions) == python.versions
    assert tuple(ref.storage_ids) == python.storage_ids
    assert ref.columns == python.columns
    assert ref.on_cpu == python.on_cpu
    counted = walk(obj, versions=True)
    assert counted is not None and type(counted.key) is bytes
    assert [id(t) for t in counted.tensors] == [id(t) for t in python.tensors]
    assert counted.versions == python.versions and counted.storage_ids == python.storage_ids
    compact = walk(obj, versions=False)  # a blocking save's: no tensors, no counters
    assert compact is not None and compact.key == counted.key
    assert compact.ints == python.ints and compact.on_cpu == python.on_cpu
    assert compact.tensors == () and compact.versions == () and compact.storage_ids == ()
    assert [s._cdata for s in compact.storages] == [s._cdata for s in python.storages]
    addresses, sizes = compact.storages.columns()
    assert addresses.tolist() == [s.data_ptr() for s in python.storages]
    assert sizes.tolist() == [s.nbytes() for s in python.storages]


@needs_compiled
@pytest.mark.parametrize("make", list(DESCRIBED.values()), ids=list(DESCRIBED))
def test_the_compiled_walk_is_the_python_walk(make):
    _assert_same_walk(make())


@needs_compiled
@pytest.mark.parametrize("make", list(LEFT_TO_PYTHON.values()), ids=list(LEFT_TO_PYTHON))
def test_what_the_compiled_walk_does_not_describe_is_left_to_the_python_walk(make):
    obj = make()
    assert walk(obj) is None and reference_key(obj) is None
    python = describe(obj)
    # Described by the Python walk only through a reduction (never a plain structure).
    assert python is None or not python.plain


@needs_compiled
@pytest.mark.parametrize(
    "make", list(PLAIN_LEFT_TO_PYTHON.values()), ids=list(PLAIN_LEFT_TO_PYTHON)
)
def test_a_plain_state_the_compiled_walk_stops_at_is_planned_by_the_python_walk(make):
    obj = make()
    assert walk(obj) is None
    cache = PlanCache()
    for _ in range(2):
        flat, plan = cache.prepare(obj, "/ckpt/a.pt", "ns")
    assert (cache.hits, cache.misses) == (1, 1)
    assert_same(_write(flat, plan), obj)


@needs_compiled
def test_dtypes_torch_cannot_save_get_the_same_walk_or_none_from_both():
    obj = _every_dtype("other")
    if describe(obj) is None:
        assert walk(obj) is None
    else:
        _assert_same_walk(obj)


@needs_compiled
def test_a_nan_s_sign_is_in_both_keys():
    # The pickler writes a float's bits: NaNs of two signs pickle differently.
    plus, minus = {"x": math.nan}, {"x": -math.nan}
    assert describe(plus).key != describe(minus).key  # type: ignore[union-attr]
    assert walk(plus).key != walk(minus).key  # type: ignore[union-attr]


def _mutations() -> dict[str, Callable[[dict[str, Any]], Any]]:
    def set_(key: str, make: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        return lambda s: s.__setitem__(key, make(s))

    return {
        "nothing": lambda s: None,
        "same structure, new tensors": lambda s: s.update(_base()),
        "bytes changed in place": lambda s: s["base"].add_(1),
        "a key renamed": lambda s: s.__setitem__("other", s.pop("name")),
        "keys reordered": lambda s: s.update(name=s.pop("name")),
        "nesting": set_("nest", lambda s: {"inner": s["nest"]}),
        "dtype": set_("base", lambda s: s["base"].double()),
        "dtype, same itemsize": set_("base", lambda s: s["base"].to(torch.int32)),
        "shape": set_("base", lambda s: s["base"].reshape(4, 3)),
        "stride": set_("t", lambda s: s["t"].contiguous()),
        "storage shared": set_("view", lambda s: s["base"][2:]),
        "storage own": set_("view", lambda s: s["view"].clone()),
        "storage size": set_("base", lambda s: torch.zeros(20)[:12].view(3, 4)),
        "offset": set_("view", lambda s: s["base"].view(-1)[2:10].view(2, 4)),
        "requires_grad": set_("base", lambda s: s["base"].clone().requires_grad_()),
        "int width": set_("step", lambda s: 300),
        "int value, same width": set_("step", lambda s: 8),
        "int become bool": set_("step", lambda s: True),
        "float": set_("loss", lambda s: 0.25),
        "float sign": set_("loss", lambda s: 0.0),
        "str": set_("name", lambda s: "rum"),
        "bytes": set_("raw", lambda s: b"\x01"),
        "None become 0": set_("nothing", lambda s: 0),
        "tuple become list": set_("pair", lambda s: list(s["pair"])),
        "list longer": lambda s: s["list"].append(1),
        "dict held twice": set_("nothing", lambda s: s["nest"]),
        "tensor held twice": set_("nothing", lambda s: s["base"]),
        "a dict become an OrderedDict": set_("nest", lambda s: collections.OrderedDict(s["nest"])),
        "OrderedDict attribute": lambda s: setattr(s["model"], "_metadata", {"": {"v": 2}}),
        "OrderedDict order": lambda s: s["model"].move_to_end("w"),
    }


def _base() -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"base": base, "view": base[1:], "t": base.t()}


def _state() -> dict[str, Any]:
    model = collections.OrderedDict(w=torch.ones(2, 2), b=torch.zeros(2))
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        **_base(), "model": model, "nest": {"a": torch.ones(3)}, "step": 7, "name": "run",
        "raw": b"\x00", "nothing": None, "loss": -0.0, "pair": (1, 2), "list": [torch.ones(1)],
    }  # fmt: skip


MUTATIONS = _mutations()
#: What leaves the key as it was: the bytes, the tensor objects, an integer of the same width.
SAME_KEY = {"nothing", "same structure, new tensors", "bytes changed in place",
            "int value, same width"}  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("change", list(MUTATIONS), ids=list(MUTATIONS))
def test_compact_keys_are_equal_exactly_when_python_keys_are(change):
    before = _state()
    after = _state()
    MUTATIONS[change](after)
    python = describe(before), describe(after)
    compact = walk(before), walk(after)
    assert None not in python and None not in compact
    same_python = python[0].key == python[1].key  # type: ignore[union-attr]
    same_compact = compact[0].key == compact[1].key  # type: ignore[union-attr]
    assert same_python == same_compact == (change in SAME_KEY)
    _assert_same_walk(after)


def _write(flat: Any, plan: Any, *, by_torch: bool = False) -> Any:
    """The object a segment written from ``flat``/``plan`` holds (``by_torch``: as
    ``torch.load`` reads its archive, the file a persist writes)."""
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    if by_torch:
        archive = io.BytesIO(mapping[HEADER_SIZE : HEADER_SIZE + plan.archive.size])
        return torch.load(archive, weights_only=True)
    return read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), zero_copy=False
    )


@pytest.mark.parametrize("change", list(MUTATIONS), ids=list(MUTATIONS))
def test_a_repeated_save_writes_the_current_bytes_and_replans_a_new_structure(walked_by, change):
    cache = PlanCache()
    state = _state()
    for _ in range(2):
        flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
        assert_same(_write(flat, plan), state)
    assert (cache.hits, cache.misses) == (1, 1)
    assert isinstance(flat.storages, Sources) == (walked_by == "C++")
    MUTATIONS[change](state)
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    assert_same(_write(flat, plan), state)  # the trainer's bytes as they are now
    # A new integer of the same width is planned afresh once, to learn where it lies.
    replanned = change not in SAME_KEY or change == "int value, same width"
    assert cache.misses == 1 + replanned
    for t in state.values():  # bytes changed after the plan: the save has them
        if isinstance(t, torch.Tensor) and not t.requires_grad and t.dtype.is_floating_point:
            t.add_(0.5)
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    assert cache.misses == 1 + replanned
    assert_same(_write(flat, plan), state)
    assert_same(_write(flat, plan, by_torch=True), state)


@pytest.mark.parametrize("make", list(DESCRIBED.values()), ids=list(DESCRIBED))
def test_every_shape_round_trips_through_a_reused_plan(walked_by, make):
    obj = make()
    cache = PlanCache()
    for versions in (False, True, False):
        flat, plan = cache.prepare(obj, "/ckpt/a.pt", "ns", versions=versions)
        assert_same(_write(flat, plan), obj)
    assert cache.hits == 2


def test_a_non_blocking_save_s_counters_come_with_a_reused_plan(walked_by):
    cache = PlanCache()
    state = _state()
    cache.prepare(state, "/ckpt/a.pt", "ns")
    flat, _ = cache.prepare(state, "/ckpt/a.pt", "ns", versions=True)
    assert cache.hits == 1
    assert flat.versions == tuple(t._version for t in flat.tensors)
    assert flat.storage_ids == tuple(t.untyped_storage()._cdata for t in flat.tensors)
    described = describe(state)
    assert described is not None
    assert [s._cdata for s in flat.storages] == [s._cdata for s in described.storages]


@needs_compiled
def test_released_storages_are_let_go_and_not_read_again():
    state = {"a": torch.ones(1000), "b": torch.ones(3)}
    cdata = state["a"].untyped_storage()._cdata

    def users() -> int:
        return int(torch._C._storage_Use_Count(cdata))

    alone = users()  # the tensor's
    found = walk(state, versions=False)
    assert found is not None and users() == alone + 1  # held while the copy may read it
    found.storages.release()
    plan_walk._releaser().submit(lambda: None).result()  # the release has run
    assert users() == alone and len(found.storages) == 2
    with pytest.raises(RuntimeError, match="released"):
        found.storages.columns()


def test_a_storage_resized_after_the_walk_is_refused_not_read(walked_by):
    cache = PlanCache()
    state = {"a": torch.ones(1000), "b": torch.ones(3)}
    cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    flat, plan = cache.prepare(state, "/ckpt/a.pt", "ns", versions=False)
    state["a"].untyped_storage().resize_(16)  # after the walk, before the copy
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    with pytest.raises(TensorMutated):
        write_object(mapping, plan, flat)


@needs_compiled
def test_a_miss_keeps_the_compact_key_only_where_the_walks_agree(monkeypatch):
    from ckptcache.codec.plan import cache as plan_cache

    state = _state()
    cache = PlanCache()
    monkeypatch.setattr(plan_cache, "_walks_agree", lambda *a: False)
    for _ in range(2):
        cache.prepare(state, "/ckpt/a.pt", "ns")
    assert (cache.hits, cache.misses) == (0, 2)  # never cached: flattened every time
    monkeypatch.undo()
    for _ in range(2):
        cache.prepare(state, "/ckpt/a.pt", "ns")
    assert (cache.hits, cache.misses) == (1, 3)


@pytest.mark.parametrize("extension", [True, False], ids=["copy extension", "memmove"])
def test_copy_sources_lands_every_byte_and_refuses_runs_outside(monkeypatch, extension):
    from ckptcache.codec import shm
    from ckptcache.format import fastcopy

    if not extension:
        monkeypatch.setattr(fastcopy, "_LIB", None)

    rng = np.random.default_rng(0)
    sources = [torch.from_numpy(rng.integers(0, 255, n, dtype=np.uint8)) for n in (0, 5, 4096, 3)]
    sizes = np.array([t.numel() for t in sources], dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes + 7
    addresses = np.array([t.data_ptr() for t in sources], dtype=np.uint64)
    dst = torch.zeros(int(sizes.sum()) + 10, dtype=torch.uint8)
    shm.copy_sources(dst, offsets, addresses, sizes)
    for t, o in zip(sources, offsets.tolist(), strict=True):
        assert torch.equal(dst[o : o + t.numel()], t)
    with pytest.raises(ValueError, match="outside"):
        shm.copy_sources(dst[:20], offsets, addresses, sizes)


@pytest.mark.parametrize("parts", [1, 2, 3, 16])
def test_the_table_split_is_the_run_split(parts):
    from ckptcache.codec import shm

    rng = np.random.default_rng(parts)
    sizes = [*rng.integers(1, 5000, 40).tolist(), 20_000, 3]
    runs = [(1 << 20) * i for i in range(len(sizes))]
    listed = [(d, d + 7, n) for d, n in zip(runs, sizes, strict=True)]
    table = np.array(listed, dtype=np.uint64)
    want = [p for p in shm._split(listed, parts) if p]
    got = [p.tolist() for p in shm._split_table(table, parts) if len(p)]
    assert got == [[list(r) for r in p] for p in want]


def test_the_module_is_not_used_where_it_cannot_be_imported(monkeypatch):
    # Then ``COMPILED`` is None, and both paths are Python's (the ``walked_by`` fixture's
    # "Python" runs each test that way).
    import sys

    from ckptcache.codec import table
    from ckptcache.codec.table import native

    monkeypatch.delattr(table, "_tensors", raising=False)
    monkeypatch.setitem(sys.modules, "ckptcache.codec.table._tensors", None)  # not built
    assert native._load() is None
