"""The tensor table's dense tensors made by the C++ loop (``_tensors.cpp``) and by numpy: the
same tensors (bytes, dtypes, shapes, storages of exactly their bytes over the mapping), the
mapping kept alive by its tensors, and columns that do not check out refused by both."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

from ckptcache.codec.table import columns as table_columns
from ckptcache.codec.table import table as tensor_table
from ckptcache.codec.table import tensors as table_tensors
from tests.codec.test_table_columns import _bulk_state
from tests.codec.test_tensor_table import _places, _written
from tests.helpers import assert_same

_compiled = table_tensors._compiled
needs_compiled = pytest.mark.skipif(_compiled is None, reason="the C++ loop is not built here")
PATHS = [pytest.param("C++", marks=needs_compiled), "numpy"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each zero-copy load of the test on one path: the C++ loop, or numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(table_tensors, "_compiled", None)
    return str(request.param)


def _load(state: Any) -> tuple[Any, np.ndarray, Any]:
    mapping, offset, size, table = _written(state)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    offsets, sizes = _places(mapping, offset, size)
    loaded = tensor_table.load_table(table, whole, (offsets, sizes))
    assert loaded is not tensor_table.NOT_FAST
    return loaded, whole, mapping


def test_both_paths_make_the_saved_tensors_over_the_mapping(path):
    state = _bulk_state()
    state.update({f"bf16.{i}": torch.randn(3, 5).to(torch.bfloat16) for i in range(9)})
    state.update({f"flag.{i}": torch.rand(7) > 0.5 for i in range(9)})
    loaded, whole, _ = _load(state)
    assert_same(loaded, state, exact=True)
    start, end = whole.ctypes.data, whole.ctypes.data + len(whole)
    for key in (k for k in state if k.startswith(("layers.", "bf16.", "flag."))):
        tensor, saved = loaded[key], state[key]
        assert (tensor.dtype, tensor.shape, tensor.stride()) == (
            saved.dtype, saved.shape, saved.stride(),
        )  # fmt: skip
        assert tensor.untyped_storage().nbytes() == saved.untyped_storage().nbytes()
        assert start <= tensor.data_ptr() < end  # zero copy
        assert tensor._base is None and not tensor.requires_grad
        assert torch.equal(
            tensor.reshape(-1).view(torch.uint8), saved.reshape(-1).view(torch.uint8)
        )
    assert loaded["grad"].requires_grad


def test_the_paths_give_equal_tensors():
    state = _bulk_state()
    made = {}
    for name in ("C++", "numpy") if _compiled is not None else ("numpy",):
        saved = table_tensors._compiled
        table_tensors._compiled = None if name == "numpy" else _compiled
        try:
            made[name] = _load(state)[0]
        finally:
            table_tensors._compiled = saved
    for loaded in made.values():
        assert_same(loaded, state, exact=True)


def test_the_tensors_keep_the_mapping_alive(path):
    state = {f"w.{i}": torch.full((4, 8), float(i)) for i in range(64)}
    loaded, whole, mapping = _load(state)
    kept = loaded["w.63"]
    del loaded, whole, mapping
    gc.collect()
    assert torch.equal(kept, torch.full((4, 8), 63.0))


def _columns(n: int = 2) -> dict[str, Any]:
    """Columns of ``n`` float32 tensors of 4 elements, back to back in a 64-byte mapping."""
    return {
        "whole": torch.zeros(64, dtype=torch.uint8),
        "starts": torch.arange(n, dtype=torch.int64) * 16,
        "sizes": torch.full((n,), 16, dtype=torch.int64),
        "dims": torch.full((n,), 4, dtype=torch.int64),
        "ndim": torch.ones(n, dtype=torch.uint8),
        "code": torch.full((n,), table_columns.CODES.index(torch.float32), dtype=torch.uint8),
    }


def _over(columns: dict[str, Any]) -> list[torch.Tensor]:
    assert _compiled is not None
    kinds = [torch.empty(0, dtype=d) for d in table_columns.CODES]
    return _compiled.over_mapping(*columns.values(), kinds)


@needs_compiled
def test_the_loop_makes_what_its_columns_say():
    columns = _columns()
    columns["whole"][16:32] = torch.arange(4, dtype=torch.float32).view(torch.uint8)
    _, second = _over(columns)
    assert torch.equal(second, torch.arange(4, dtype=torch.float32))
    assert second.untyped_storage().nbytes() == 16
    assert second.data_ptr() == columns["whole"].data_ptr() + 16


@needs_compiled
@pytest.mark.parametrize(
    "column, value",
    [
        ("starts", [0, 56]),  # past the mapping's end
        ("starts", [0, 18]),  # off float32's alignment
        ("starts", [0, -16]),
        ("sizes", [16, 12]),  # not the shape's size
        ("dims", [4, 1 << 62]),
        ("dims", [4, -4]),
        ("code", [1, 200]),  # a dtype code off the list
        ("ndim", [1, 2]),  # more dims than the column holds
        ("ndim", [1, 0]),  # dims left over
    ],
)
def test_the_loop_refuses_columns_that_do_not_check_out(column, value):
    columns = _columns()
    columns[column] = torch.tensor(value, dtype=columns[column].dtype)
    with pytest.raises(ValueError):
        _over(columns)


@needs_compiled
def test_the_loop_refuses_columns_of_other_kinds():
    columns = _columns()
    columns["starts"] = columns["starts"].to(torch.int32)
    with pytest.raises(ValueError):
        _over(columns)
    columns = _columns()
    columns["code"] = columns["code"][:1]
    with pytest.raises(ValueError):
        _over(columns)


def test_the_loop_runs_only_under_the_torch_it_was_compiled_against():
    from ckptcache.codec.table.native import same_torch as _same_torch

    assert _same_torch((2, 13, 0), "2.13.0+cpu")
    assert _same_torch((2, 13, 0), "2.13.0")
    assert not _same_torch((2, 13, 0), "2.13.1")
    assert not _same_torch((2, 13, 0), "2.14.0.dev20261201+cu130")
    assert not _same_torch((2, 13, 0), "2.13")
    assert not _same_torch((2, 13, 0), "garbage")
