"""The fill of a load into given tensors (:mod:`ckptcache.client._into`), without a daemon:
the bytes end as ``copy_`` calls in order would leave them, whichever path each tensor takes."""

from __future__ import annotations

import torch

from ckptcache.client._into import _by_path, fill


def test_overlapping_destinations_end_as_copies_in_order_would_leave_them():
    base = torch.full((100,), -1.0)
    into = {"a": base, "b": base[10:20], "c": base[50:60], "d": torch.zeros(64), "e": base[90:]}
    loaded = {"a": torch.zeros(100), "b": torch.ones(10), "c": torch.full((10,), 2.0),
              "d": torch.arange(64.0), "e": torch.full((10,), 3.0), "step": 7}  # fmt: skip
    expected_base = torch.full((100,), -1.0)
    for key in ("a", "b", "c", "e"):  # in order, over one buffer
        view = {"a": expected_base, "b": expected_base[10:20], "c": expected_base[50:60],
                "e": expected_base[90:]}[key]  # fmt: skip
        view.copy_(loaded[key])
    pairs = [(k, into[k], loaded[k]) for k in into]
    fast, slow = _by_path(pairs)
    assert [run[3] for run in fast] == [into["d"]]  # the only destination apart from others
    assert len(slow) == 4
    out = fill(into, loaded)
    assert torch.equal(base, expected_base)
    assert torch.equal(into["d"], loaded["d"])
    assert out["step"] == 7 and out["a"] is base


def test_a_filled_tensor_has_moved_its_version_as_an_in_place_write_would():
    dst = torch.zeros(1 << 16)
    before = dst._version
    fill({"w": dst}, {"w": torch.ones(1 << 16)})
    assert dst._version > before and torch.equal(dst, torch.ones(1 << 16))
