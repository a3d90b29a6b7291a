"""The tensor table's packed columns (dense tensors as packed arrays): tensors made in bulk keep
their own storages as the skeleton's path makes them, and any packed column that does not
check out leaves the load to the skeleton."""

from __future__ import annotations

import base64
import collections
import io
import pickle
import struct
from typing import Any

import numpy as np
import pytest
import torch

from ckptcache.codec.objectio import read_object
from ckptcache.codec.table import columns as table_columns
from ckptcache.codec.table import table as tensor_table
from tests.codec.test_tensor_table import _Boom, _places, _state, _written
from tests.helpers import assert_same

_HEAD = struct.Struct("<QQQ")


def _bulk_state() -> dict[str, Any]:
    """Many small tensors of several dtypes and shapes, beside views and tied weights."""
    tied = torch.randn(4, 3)
    base = torch.arange(40, dtype=torch.float32)
    state: dict[str, Any] = collections.OrderedDict()
    for i in range(300):
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        shape = ((5,), (2, 3), (), (1, 4, 2))[i % 4]
        state[f"layers.{i}"] = torch.randn(shape).to(dtype)
    state.update({"tied a": tied, "tied b": tied, "half": base[:20], "rest": base[20:].view(4, 5)})
    state["grad"] = torch.ones(3, requires_grad=True)
    return state


def test_bulk_tensors_own_exactly_their_storages():
    """Each tensor made from the packed columns has a storage of exactly its own bytes
    (``torch.save`` of one writes only those), over the mapping; views and tied weights
    still share one storage, as saved."""
    state = _bulk_state()
    mapping, offset, size, table = _written(state)
    assert base64.b64decode(table).startswith(table_columns.MAGIC)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    loaded = tensor_table.load_table(table, whole, _places(mapping, offset, size))
    assert loaded is not tensor_table.NOT_FAST
    assert_same(loaded, state, exact=True)
    assert_same(loaded, read_object(*_written(state, table="none")[:3]), exact=True)
    start, end = whole.ctypes.data, whole.ctypes.data + len(mapping)
    for key in (k for k in state if k.startswith("layers.")):
        tensor = loaded[key]
        assert tensor.untyped_storage().nbytes() == state[key].untyped_storage().nbytes()
        assert start <= tensor.data_ptr() < end  # zero copy
        assert tensor._base is None  # not a view of anything the load made
    alone = io.BytesIO()
    torch.save(loaded["layers.7"], alone)
    assert len(alone.getvalue()) < 2048  # its own 8 float16s, not the mapping's bytes
    assert loaded["tied a"] is loaded["tied b"]
    halves = loaded["half"].untyped_storage(), loaded["rest"].untyped_storage()
    assert halves[0].data_ptr() == halves[1].data_ptr() and halves[0].nbytes() == 160
    assert loaded["grad"].requires_grad and loaded["grad"].is_leaf


def _edit(table: str, change) -> str:
    """``table`` with its packed columns, strided columns and tree as ``change``
    returns them (given a dict of the columns as writable arrays, and the two byte strings)."""
    blob = memoryview(base64.b64decode(table))
    dense, strided, tree = table_columns.unpack_dense(blob)
    columns = {name: np.array(a) for name, a in dense._asdict().items()}
    columns, strided, tree = change(columns, bytes(strided), bytes(tree))
    head = table_columns.MAGIC + _HEAD.pack(
        len(columns["storage"]), len(columns["dims"]), len(strided)
    )
    packed = [columns["storage"].astype("<i8"), columns["dims"].astype("<i8")]
    packed += [columns[k].astype(np.uint8) for k in ("code", "ndim", "requires_grad")]
    body = b"".join(a.tobytes() for a in packed)
    return base64.b64encode(head + body + strided + tree).decode()


def _set(name: str, value: Any, at: int = 0):
    def change(columns, strided, tree):
        columns[name][at] = value
        return columns, strided, tree

    return lambda table: _edit(table, change)


def _strided_names_a_dense_storage(columns, strided, tree):
    fields = list(pickle.loads(strided))
    fields[4] = (int(columns["storage"][0]), *fields[4][1:])
    return columns, pickle.dumps(tuple(fields), protocol=5), tree


#: Tables that must not load (the state's first dense tensor is 3 x 4 float32).
BAD_TABLES_2 = {
    "a dtype code off the list": _set("code", 200),
    "a storage index past the storages": _set("storage", 1000),
    "a negative storage index": _set("storage", -1),
    "a storage used twice": _set("storage", 0, at=1),
    "a shape past its storage": _set("dims", 30),
    "a negative dim": _set("dims", -3),
    "a dim past the mapping": _set("dims", 1 << 62),
    "one dimension too many": _set("ndim", 3),
    "a requires_grad flag that is not one": _set("requires_grad", 2),
    "more dims than the tensors have": lambda t: _edit(
        t, lambda c, s, tr: ({**c, "dims": np.append(c["dims"], 1)}, s, tr)
    ),
    "cut short": lambda t: base64.b64encode(base64.b64decode(t)[:60]).decode(),
    "a view that names a dense tensor's storage": lambda t: _edit(
        t, _strided_names_a_dense_storage
    ),
    "a tree that calls a function": lambda t: _edit(
        t, lambda c, s, tr: (c, s, pickle.dumps({"w": _Boom()}, protocol=5))
    ),
}


@pytest.mark.parametrize("bad", list(BAD_TABLES_2), ids=list(BAD_TABLES_2))
def test_packed_columns_that_do_not_check_out_leave_the_load_to_the_skeleton(bad, capsys):
    state = _state()
    mapping, offset, size, table = _written(state)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    places = _places(mapping, offset, size)
    assert tensor_table.load_table(table, whole, places) is not tensor_table.NOT_FAST
    broken = BAD_TABLES_2[bad](table)
    assert tensor_table.load_table(broken, whole, places) is tensor_table.NOT_FAST
    assert "ran code" not in capsys.readouterr().out


def test_a_state_of_views_only_and_an_empty_state():
    """No dense tensor (every one a view of one storage), and no tensor at all."""
    base = torch.arange(12.0)
    for state in ({"a": base[:6], "b": base[6:]}, {"step": 3, "name": "x"}):
        mapping, offset, size, table = _written(state)
        whole = np.frombuffer(mapping, dtype=np.uint8)
        loaded = tensor_table.load_table(table, whole, _places(mapping, offset, size))
        assert loaded is not tensor_table.NOT_FAST
        assert_same(loaded, state, exact=True)


def test_a_manifests_columns_are_its_records_fields():
    """Kept as decoded (a load) or made from the records, the columns are the same."""
    from ckptcache.format.manifest import Manifest

    mapping, offset, size, _ = _written(_bulk_state())
    data = memoryview(mapping)[offset : offset + size]
    kept = Manifest.from_json(data, keep_columns=True)
    plain = Manifest.from_json(data)
    assert kept == plain and "_columns" not in vars(plain)
    assert [tuple(c) for c in kept.columns()] == [tuple(c) for c in plain.columns()]
    assert [tuple(c) for c in plain.columns()] == list(zip(*plain.storages, strict=True))


def test_a_loads_manifest_makes_its_records_on_first_use():
    """A manifest read for a load (``keep_columns``) makes its records only when something
    reads them, and they are then the eager decode's, one by one and as a whole; the columns
    are checked all the same (a bad one is refused before any record is made)."""
    import json

    from ckptcache.errors import CorruptCheckpoint
    from ckptcache.format.manifest import LazyRecords, Manifest

    mapping, offset, size, _ = _written(_bulk_state())
    data = bytes(memoryview(mapping)[offset : offset + size])
    kept = Manifest.from_json(data, keep_columns=True)
    plain = Manifest.from_json(data)
    records = kept.storages
    assert isinstance(records, LazyRecords) and type(plain.storages) is tuple
    assert len(records) == len(plain.storages) and records._rows is None
    assert records[0] == plain.storages[0] and records[-2:] == plain.storages[-2:]
    assert list(records) == list(plain.storages) and hash(records) == hash(plain.storages)
    assert kept == plain and plain == kept
    raw = json.loads(data)
    raw["storages"]["dtype"]["values"][0] = 7
    with pytest.raises(CorruptCheckpoint, match="not a string"):
        Manifest.from_json(json.dumps(raw).encode(), keep_columns=True)
