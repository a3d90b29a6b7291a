"""The tensor table: a zero-copy load that makes the tensors from columns and unpickles a tree
without a tensor reduction in it must give exactly the object the skeleton's path gives, and
any table that does not check out must leave the load to the skeleton."""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import io
import json
import mmap
import pickle
import struct
from typing import Any

import pytest
import torch

from ckptcache.codec.objectio import read_object, replan, write_object
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.codec.table import table as tensor_table
from ckptcache.codec.table.columns import MAGIC, unpack_dense
from tests.helpers import assert_same


def _written(state: Any, *, table: str = "written") -> tuple[mmap.mmap, int, int, str]:
    """``state`` saved into a private mapping as a client would, its manifest with the table
    the save writes (``"written"``), with none (``"none"``) or with a table of the layout
    before the packed columns (``"unpacked"``); the mapping, the manifest's place and the
    table."""
    flat, plan = PlanCache().prepare(state, "/ckpt/t.pt", "ns")
    if table != "written":
        text = _unpacked(state) if table == "unpacked" else ""
        plan = replan(
            dataclasses.replace(plan, manifest=dataclasses.replace(plan.manifest, table=text)),
            "/ckpt/t.pt", "ns",
        )  # fmt: skip
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    return mapping, plan.layout.manifest_offset, len(plan.manifest_bytes), plan.manifest.table


def _unpacked(state: Any) -> str:
    """The table of ``state`` in the layout before the packed columns, never released: its
    length, every tensor's columns pickled as tuples, then the tree."""
    structure = describe(state)
    assert structure is not None
    names = tuple(str(d).removeprefix("torch.") for d in structure.columns[0])
    shapes, strides, offsets, indices, requires_grad = structure.columns[1:6]
    fields = (names, tuple(map(tuple, shapes)), strides, offsets, indices, requires_grad)
    meta = pickle.dumps(fields, protocol=5)
    tree = io.BytesIO()
    index = {id(t): i for i, t in enumerate(structure.tensors)}
    tensor_table._TreePickler(tree, index).dump(state)
    return base64.b64encode(struct.pack("<Q", len(meta)) + meta + tree.getvalue()).decode()


def _places(mapping: mmap.mmap, offset: int, size: int) -> tuple[tuple[int, ...], ...]:
    """The storages' offsets and sizes, as the manifest at ``offset`` gives them."""
    from ckptcache.format.manifest import Manifest

    manifest = Manifest.from_json(memoryview(mapping)[offset : offset + size])
    return tuple(r.offset for r in manifest.storages), tuple(r.nbytes for r in manifest.storages)


def _state() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    model: collections.OrderedDict[str, Any] = collections.OrderedDict(
        w=torch.randn(3, 4), b=torch.zeros(2, dtype=torch.bfloat16)
    )
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": model,
        "same model": model,
        "view": base.view(4, 6),
        "transposed": base.view(4, 6).t(),
        "slice": base[3:9],
        "leaf": torch.ones(2, requires_grad=True),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "halves": torch.randn(2, 3).half(),
        "opt": {
            "state": {0: {"step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
        },
        "values": [1, 2.5, None, "text", b"raw", (1, 2), True],
    }


def test_the_table_gives_the_object_the_skeleton_gives():
    state = _state()
    mapping, offset, size, table = _written(state)
    assert table  # a plain state gets one
    assert base64.b64decode(table).startswith(MAGIC)
    whole = tensor_table.np.frombuffer(mapping, dtype=tensor_table.np.uint8)
    fast = tensor_table.load_table(table, whole, _places(mapping, offset, size))
    assert fast is not tensor_table.NOT_FAST  # the table itself made it
    plain = read_object(*_written(state, table="none")[:3])
    assert_same(fast, plain, exact=True)
    assert_same(fast, state, exact=True)
    assert_same(read_object(mapping, offset, size), state, exact=True)
    # What a pickle keeps: one object held twice, storages shared between views, the
    # tensors over the mapping (zero copy).
    assert fast["same model"] is fast["model"]
    shared = {fast[k].untyped_storage().data_ptr() for k in ("view", "transposed", "slice")}
    assert len(shared) == 1
    start = tensor_table.np.frombuffer(mapping, dtype=tensor_table.np.uint8).ctypes.data
    assert start <= fast["model"]["w"].data_ptr() < start + len(mapping)


def test_a_table_of_another_layout_is_not_read():
    """A table without the packed columns' magic (the layout before them, never released) is
    not read: the load takes the skeleton's path and gives the object all the same."""
    state = _state()
    mapping, offset, size, table = _written(state, table="unpacked")
    whole = tensor_table.np.frombuffer(mapping, dtype=tensor_table.np.uint8)
    places = _places(mapping, offset, size)
    assert tensor_table.load_table(table, whole, places) is tensor_table.NOT_FAST
    assert_same(read_object(mapping, offset, size), state, exact=True)


def _with_table(table: str, change) -> str:
    """``table`` with its pickled (strided) columns and its tree as ``change`` returns them."""
    blob = base64.b64decode(table)
    _, strided, tree = unpack_dense(memoryview(blob))
    arrays = blob[len(MAGIC) + 24 : len(blob) - len(strided) - len(tree)]
    n_dense, n_dims, _ = struct.unpack_from("<QQQ", blob, len(MAGIC))
    meta, tree = change(list(pickle.loads(strided)), bytes(tree))
    new_meta = pickle.dumps(tuple(meta), protocol=5)
    head = MAGIC + struct.pack("<QQQ", n_dense, n_dims, len(new_meta))
    return base64.b64encode(head + arrays + new_meta + tree).decode()


class _Boom:
    def __reduce__(self):
        return (print, ("a tensor table ran code",))


def _hostile_tree(meta, tree):
    return meta, pickle.dumps({"w": _Boom()}, protocol=5)


def _column(index: int, change: Any) -> Any:
    """A bad table: ``table`` with pickled column ``index`` (names, shapes, strides,
    offsets, storage indices, requires_grad) changed entry by entry."""

    def bad(table: str) -> str:
        def edit(meta: list[Any], tree: bytes) -> tuple[list[Any], bytes]:
            meta[index] = tuple(map(change, meta[index]))
            return meta, tree

        return _with_table(table, edit)

    return bad


#: Tables whose pickled columns (the tensors that are not dense) must not load.
BAD_TABLES = {
    "not base64": lambda t: "!" + t[1:],
    "cut short": lambda t: t[: len(t) // 2 // 4 * 4],
    "a shape past its storage": _column(1, lambda s: (s[0] * 1000, *s[1:]) if s else s),
    "an index past the storages": _column(4, lambda i: i + 1000),
    "a negative offset": _column(3, lambda o: -1),
    "an unknown dtype": _column(0, lambda n: "float8_e4m3fn"),
    "a tree that calls a function": lambda t: _with_table(t, _hostile_tree),
}


@pytest.mark.parametrize("bad", list(BAD_TABLES), ids=list(BAD_TABLES))
def test_a_table_that_does_not_check_out_leaves_the_load_to_the_skeleton(bad, capsys):
    state = _state()
    mapping, offset, size, table = _written(state)
    whole = tensor_table.np.frombuffer(mapping, dtype=tensor_table.np.uint8)
    places = _places(mapping, offset, size)
    assert tensor_table.load_table(table, whole, places) is not tensor_table.NOT_FAST
    assert tensor_table.load_table(BAD_TABLES[bad](table), whole, places) is tensor_table.NOT_FAST
    assert "ran code" not in capsys.readouterr().out


def test_no_table_for_what_it_cannot_stand_for():
    # An object the plan cache describes by its reduction.
    assert _written({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)})[3] == ""
    # A step counter patched into a reused plan: the tree would hold the old value.
    cache = PlanCache()
    for step in (1, 2, 3):
        _, plan = cache.prepare({"w": torch.ones(2), "step": step}, "/ckpt/t.pt", "ns")
    assert cache.hits == 1 and plan.manifest.table == ""


def test_no_table_past_its_size_cap(monkeypatch):
    """A table longer than the cap is left out (the manifest travels whole between peers);
    the object still loads, by its skeleton."""
    state = _state()
    monkeypatch.setattr(tensor_table, "MAX_TABLE_CHARS", 100)
    mapping, offset, size, table = _written(state)
    assert table == ""
    assert_same(read_object(mapping, offset, size), state, exact=True)


def test_a_manifest_whose_table_is_not_a_string_is_corrupt():
    from ckptcache.errors import CorruptCheckpoint
    from ckptcache.format.manifest import Manifest

    mapping, offset, size, _ = _written(_state())
    raw = json.loads(bytes(memoryview(mapping)[offset : offset + size]))
    raw["table"] = 5
    with pytest.raises(CorruptCheckpoint, match="tensor table that is not a string"):
        Manifest.from_json(json.dumps(raw).encode())
