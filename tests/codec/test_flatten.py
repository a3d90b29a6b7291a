"""flatten and decode_skeleton: the torch.save object model, weights_only, and bad input."""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.codec.decode import decode_skeleton
from ckptcache.codec.flatten import flatten
from ckptcache.errors import SerializationError, UnsafeUnpickle
from ckptcache.format.manifest import Manifest, StorageRecord
from tests.helpers import assert_same

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def roundtrip(obj, **kw):
    flat = flatten(obj)
    data = {i.key: s for i, s in zip(flat.infos, flat.storages, strict=False)}

    def load(key, nbytes):
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.copy_(torch.empty(0, dtype=torch.uint8).set_(data[key]))
        return out.untyped_storage()

    return flat, decode_skeleton(flat.skeleton, load, **kw)


def sample(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) - 2).to(dtype)


def test_every_dtype_round_trips():
    obj = {str(d): sample(d) for d in DTYPES}
    _, out = roundtrip(obj)
    assert_same(obj, out)


def test_views_strides_and_shared_storage_are_preserved():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"base": base, "t": base.t(), "slice": base[1:3, ::2], "flat": base.view(-1)}
    flat, out = roundtrip(obj)
    assert len(flat.infos) == 1  # one storage, as torch.save
    assert out["t"].stride() == base.t().stride()
    assert out["slice"].storage_offset() == base[1:3, ::2].storage_offset()
    assert_same(obj, out)
    ptrs = {out[k].untyped_storage().data_ptr() for k in obj}
    assert len(ptrs) == 1
    out["base"][0, 0] = 100.0
    assert out["flat"][0].item() == 100.0


def test_containers_and_plain_values():
    obj = collections.OrderedDict(
        model={"w": torch.ones(2, 3), "layers": [torch.zeros(1), (torch.ones(1), 3)]},
        args=argparse.Namespace(lr=0.1, name="gpt", layers=[1, 2]),
        step=7, loss=0.25, name="run", nothing=None, flags={True, False},
        np_array=np.arange(5, dtype=np.int32), np_scalar=np.float64(2.5), raw=b"bytes",
        param=torch.nn.Parameter(torch.ones(3)),
    )  # fmt: skip
    _, out = roundtrip(obj, weights_only=True)
    assert_same(obj, out)
    assert isinstance(out["param"], torch.nn.Parameter)


def test_tensor_names_recorded_for_errors():
    flat = flatten({"model": {"layer1": {"weight": torch.ones(2)}}, "opt": [torch.zeros(3)]})
    assert [i.name for i in flat.infos] == ["model.layer1.weight", "opt.0"]


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_weights_only_refuses_code_and_false_trusts_it():
    flat = flatten({"x": Evil(), "t": torch.ones(1)})
    loader = lambda key, n: torch.UntypedStorage(n)  # noqa: E731
    with pytest.raises(UnsafeUnpickle, match="weights_only") as err:
        decode_skeleton(flat.skeleton, loader, weights_only=True)
    assert isinstance(err.value, pickle.UnpicklingError)
    # a trusted load runs the reduce; use a harmless callable to prove the path works
    safe = flatten({"x": collections.Counter("aab")})
    assert decode_skeleton(safe.skeleton, loader, weights_only=False)["x"]["a"] == 2


def test_unpicklable_values_raise_serialization_error():
    with pytest.raises(SerializationError, match="cannot save") as err:
        flatten({"fn": lambda x: x})
    assert isinstance(err.value, TypeError)
    with pytest.raises(SerializationError):
        flatten({"lock": threading.Lock()})


def test_same_data_viewed_as_two_dtypes_is_refused_like_torch_save():
    base = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(SerializationError, match="different dtypes"):
        flatten({"a": base, "b": base.view(torch.int32)})


def test_map_location_variants():
    obj = {"w": torch.arange(3.0)}
    for loc in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s):
        _, out = roundtrip(obj, map_location=loc)
        assert_same(obj, out)
    with pytest.raises(TypeError, match="map_location"):
        roundtrip(obj, map_location=3)


def _tensor(dtype, shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


tensors = st.builds(
    _tensor,
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
    st.integers(0, 1000),
)
values = st.recursive(
    tensors | st.integers() | st.text(max_size=5) | st.none() | st.floats(allow_nan=False),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(values)
def test_property_round_trip(obj):
    _, out = roundtrip(obj)
    assert_same(obj, out)


def _varied_state() -> dict:
    """Tensors that take torch's reduction paths: plain, views, conj/neg bits, requires_grad,
    a Parameter, a tensor with a Python attribute, new dtypes, empty, shared storage."""
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    tagged = torch.ones(3)
    tagged.note = "kept"  # Python state: torch's own reduction keeps it
    return {
        "plain": base,
        "view": base[:, 1:3],
        "transposed": base.t(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag,
        "grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2)),
        "tagged": tagged,
        "u16": torch.zeros(3, dtype=torch.uint16),
        "empty": torch.empty(0),
        "scalar": torch.tensor(7.5),
        "shared": [base.view(-1)[:4], base],
        **{str(d).removeprefix("torch."): sample(d) for d in DTYPES},
    }


def test_fast_tensor_reduction_writes_torch_own_records(monkeypatch):
    """flatten's shortcut for plain tensors gives byte-identical skeletons to torch's
    ``Tensor.__reduce_ex__``, and the result loads back equal (also with torch.load)."""
    import io

    import ckptcache.codec.flatten as flatten_module

    state = _varied_state()
    fast = flatten(state)
    monkeypatch.setattr(flatten_module, "_reduce_tensor", lambda obj: NotImplemented)
    slow = flatten(state)
    assert fast.skeleton == slow.skeleton
    assert fast.infos == slow.infos
    monkeypatch.undo()

    _, back = roundtrip(state, weights_only=False)
    assert back["tagged"].note == "kept"
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["grad"].requires_grad and not back["plain"].requires_grad
    assert back["shared"][0].untyped_storage().data_ptr() == back["plain"].untyped_storage(
    ).data_ptr()  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    expected = torch.load(buf, weights_only=False)
    for key in state:
        assert_same(back[key], expected[key])


def test_manifest_json_packs_records():
    """The manifest packs the storage records (numbers as base64 int64 arrays, strings as one
    text per column or a dictionary of values; the other fields as ``dataclasses.asdict``)."""
    import base64
    import dataclasses
    import json

    from ckptcache.codec.objectio import plan_object

    plan = plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns")
    records = plan.manifest.storages
    raw = json.loads(plan.manifest_bytes)
    expected = dataclasses.asdict(plan.manifest)
    expected.pop("storages")
    packed = raw.pop("storages")
    assert raw == expected and raw["format"] == 3
    assert packed["n"] == len(records) and packed["key"] is None  # keys "0", "1", ...
    offsets = np.frombuffer(base64.b64decode(packed["offset"]), dtype="<i8").tolist()
    assert offsets == [r.offset for r in records]
    assert packed["name"]["text"] == "".join(r.name for r in records)
    dtypes = packed["dtype"]["values"]
    codes = np.frombuffer(base64.b64decode(packed["dtype"]["codes"]), dtype="<u4").tolist()
    assert [dtypes[c] for c in codes] == [r.dtype for r in records]
    for lazy in (False, True):
        assert Manifest.from_json(plan.manifest_bytes, keep_columns=lazy) == plan.manifest
    # The bytes are one ``json.dumps`` of the fields in order (the table's text is cached
    # between encodes, so a table of its own and one seen before must both come out so).
    for table in ("", "QUJD", 'é"\\ \ud800', plan.manifest.table, "QUJD"):
        manifest = dataclasses.replace(plan.manifest, table=table)
        head = {**dataclasses.asdict(manifest), "storages": None}
        whole = json.dumps(head, separators=(",", ":")).encode()
        columns = json.dumps(packed, separators=(",", ":")).encode()
        assert manifest.to_json() == whole.replace(b'"storages":null', b'"storages":' + columns)


def test_packed_records_keep_names_with_any_characters_and_other_keys():
    """Names (and keys that are not ``"0"``, ``"1"``, ...) with separators, quotes, non-ASCII
    and lone surrogates, and empty ones, come back as they were; so do no records at all."""
    import dataclasses

    from ckptcache.codec.objectio import plan_object

    plan = plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns")
    names = ["a\nb", "", 'q"uote', "\u00e9t\u00e9 \ud800", "x" * 300, "\x00"]
    odd = tuple(
        StorageRecord(f"k{i}\n", r.offset, r.nbytes, r.dtype, r.location, names[i % len(names)])
        for i, r in enumerate(plan.manifest.storages)
    )
    for storages in (odd, ()):
        manifest = dataclasses.replace(plan.manifest, storages=storages)
        for lazy in (False, True):
            back = Manifest.from_json(manifest.to_json(), keep_columns=lazy)
            assert tuple(back.storages) == storages and back == manifest
            assert [list(c) for c in back.columns()] == [
                list(c) for c in (zip(*storages, strict=True) if storages else [()] * 6)
            ]


def _b64_ints(values, dtype="<i8"):
    import base64

    return base64.b64encode(np.array(values, dtype=dtype).tobytes()).decode()


def test_packed_records_past_any_real_payload_are_refused_without_wrapping_around():
    """Offsets and sizes near int64's end, with a payload that claims to be larger still (the
    bounds then checked in Python ints): a sum that would wrap around is still outside."""
    import dataclasses

    from ckptcache.codec.objectio import plan_object
    from ckptcache.errors import CorruptCheckpoint

    plan = plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns")
    half = 1 << 62  # offset + nbytes is 1 << 63: negative, wrapped around in int64
    record = plan.manifest.storages[0]._replace(offset=half, nbytes=half)
    for payload_size in (half, half + 12345):
        manifest = dataclasses.replace(
            plan.manifest, storages=(record, *plan.manifest.storages[1:]),
            payload_size=payload_size,
        )  # fmt: skip
        with pytest.raises(CorruptCheckpoint, match="outside the payload"):
            Manifest.from_json(manifest.to_json(), keep_columns=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.__setitem__("offset", _b64_ints([-1] * s["n"])), "negative or non-integer"),
        (lambda s: s.__setitem__("nbytes", _b64_ints([-1] * s["n"])), "negative or non-integer"),
        (lambda s: s.__setitem__("offset", _b64_ints([1 << 40] * s["n"])), "outside the payload"),
        (lambda s: s.__setitem__("offset", _b64_ints([(1 << 63) - 1] * s["n"])), "outside"),
        (lambda s: s.__setitem__("nbytes", _b64_ints([(1 << 63) - 1] * s["n"])), "outside"),
        (lambda s: s.__setitem__("offset", _b64_ints([0] * (s["n"] - 1))), "wrong length"),
        (lambda s: s.__setitem__("offset", "not base64!"), "offsets are not valid base64"),
        (lambda s: s.__setitem__("offset", 3), "not a base64 string"),
        (lambda s: s.__setitem__("n", -1), "non-negative integer"),
        (lambda s: s.__setitem__("n", True), "non-negative integer"),
        (lambda s: s["dtype"].__setitem__("values", [3]), "not a string"),
        (lambda s: s["dtype"].__setitem__("values", []), "code out of range"),
        (lambda s: s["location"].__setitem__("codes", _b64_ints([9] * s["n"], "<u4")), "range"),
        (lambda s: s["name"].__setitem__("text", s["name"]["text"] + "x"), "name column"),
        (lambda s: s["name"].__setitem__("ends", _b64_ints(range(s["n"], 0, -1))), "name column"),
        (lambda s: s["name"].__setitem__("text", 5), "name column"),
        (lambda s: s.__setitem__("key", {"text": "", "ends": ""}), "wrong length"),
        (lambda s: s.pop("location"), "missing or unknown"),
        (lambda s: s.__setitem__("extra", []), "missing or unknown"),
    ],
)
def test_malformed_packed_records_are_refused(change, message):
    import json

    from ckptcache.codec.objectio import plan_object
    from ckptcache.errors import CorruptCheckpoint

    plan = plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns")
    for lazy in (False, True):
        raw = json.loads(plan.manifest_bytes)
        change(raw["storages"])
        with pytest.raises(CorruptCheckpoint, match=message):
            Manifest.from_json(json.dumps(raw).encode(), keep_columns=lazy)


@pytest.mark.parametrize("fmt", [1, 2, 4, None, "3"])
def test_a_manifest_of_another_format_is_refused(fmt):
    """One manifest format is read: one of another (an unreleased layout, a newer one, none)
    is refused as corrupt, naming the format, and never read as this one."""
    import json

    from ckptcache.codec.objectio import plan_object
    from ckptcache.errors import CorruptCheckpoint

    raw = json.loads(plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns").manifest_bytes)
    raw["format"] = fmt
    with pytest.raises(CorruptCheckpoint, match=f"unknown manifest format {fmt!r}"):
        Manifest.from_json(json.dumps(raw).encode())


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(max_size=6),
            st.integers(0, 1 << 40),
            st.integers(0, 1 << 20),
            st.sampled_from(["float32", "bfloat16", "int64", "é"]),
            st.text(max_size=4),
            st.text(max_size=12),
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_packed_records_round_trip_any_records(rows, numbered):
    """Any records (keys numbered as an archive numbers them or not; any text in names,
    locations and dtypes) come back from a format 3 manifest field for field, decoded eagerly
    or lazily."""
    import dataclasses

    from ckptcache.codec.objectio import plan_object

    plan = plan_object(flatten(_varied_state()), "/ckpt/a.pt", "ns")
    records = tuple(
        StorageRecord(str(i) if numbered else key, offset, nbytes, dtype, location, name)
        for i, (key, offset, nbytes, dtype, location, name) in enumerate(rows)
    )
    manifest = dataclasses.replace(plan.manifest, storages=records, payload_offset=0,
                                   payload_size=1 << 42)  # fmt: skip
    for lazy in (False, True):
        back = Manifest.from_json(manifest.to_json(), keep_columns=lazy)
        assert tuple(back.storages) == records and back == manifest
