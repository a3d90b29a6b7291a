"""Property and fuzz tests of everything that parses bytes.

Round trips: a planned archive is what ``torch.load`` and :func:`parse_archive` read back
(views, shared storages, zip64 sizes and offsets). Fuzz: manifests, segment headers, archives
and wire messages decoded from random or mutated bytes either decode or raise the parser's
typed error (a :class:`CkptCacheError`), never anything else.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import mmap
import tempfile
import typing
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptcache.errors import CorruptCheckpoint, ProtocolMismatch
from ckptcache.format.archive import ParsedArchive, count_records, parse_archive, plan_archive
from ckptcache.format.flatten import flatten
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState
from ckptcache.format.manifest import Manifest
from ckptcache.format.objectio import plan_object, write_object
from ckptcache.wire import messages as m
from tests.helpers import assert_same

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ archive round trips

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64,
           torch.bool, torch.uint8]  # fmt: skip


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Named tensors where some are views of others (slices, transposes, shared storage)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(_DTYPES))
        rows, cols = draw(st.integers(0, 6)), draw(st.integers(1, 6))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        base = (torch.randn(rows, cols, generator=g) * 50).to(dtype)
        out[f"t{i}"] = base
        kind = draw(st.sampled_from(["none", "transpose", "slice", "same", "flat"]))
        if kind == "transpose":
            out[f"t{i}.T"] = base.t()
        elif kind == "slice" and rows > 1:
            out[f"t{i}[1:]"] = base[1:]
        elif kind == "same":
            out[f"t{i}.again"] = base  # the same tensor twice
        elif kind == "flat":
            out[f"t{i}.flat"] = base.view(-1)
    return out


def _write_segment(obj: Any) -> tuple[mmap.mmap, Any]:
    flat = flatten(obj)
    plan = plan_object(flat, "/ckpt/x.pt", "default")
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    return mapping, plan


@settings(max_examples=60, deadline=None)
@given(tensor_sets())
def test_property_planned_archive_is_read_by_torch_load_and_parse_archive(obj):
    mapping, plan = _write_segment(obj)
    payload = bytes(mapping[HEADER_SIZE : HEADER_SIZE + plan.archive.size])
    out = torch.load(io.BytesIO(payload), weights_only=True)
    assert_same(obj, out)
    for name, t in obj.items():  # storage sharing survives like with torch.save
        for other, u in obj.items():
            shared = t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
            got = out[name].untyped_storage().data_ptr() == out[other].untyped_storage().data_ptr()
            assert shared == got, (name, other)
    parsed = parse_archive(memoryview(payload))
    manifest = plan.manifest
    assert parsed.pickle_offset + HEADER_SIZE == manifest.pickle_offset
    assert parsed.pickle_size == manifest.pickle_size
    assert list(parsed.storages.values()) == [
        (s.offset - HEADER_SIZE, s.nbytes) for s in manifest.storages
    ]
    assert count_records(len(payload), lambda off, n: payload[off : off + n]) == (
        6 + len(manifest.storages)
    )


_BIG = [0, 1, 63, 64, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 5, 5 << 30]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(_BIG), min_size=1, max_size=3))
def test_property_zip64_sizes_and_offsets_parse_back(sizes):
    """Storages and offsets around and past 4 GiB, in a sparse file (only metadata written)."""
    plan = plan_archive(b"\x80\x02}q\x00.", sizes)
    with tempfile.TemporaryFile() as f:
        f.truncate(plan.size)
        for off, data in plan.pieces:
            f.seek(off)
            f.write(data)
        f.flush()
        with mmap.mmap(f.fileno(), plan.size, prot=mmap.PROT_READ) as mm:
            parsed = parse_archive(memoryview(mm))
            assert list(parsed.storages.values()) == list(
                zip(plan.storage_offsets, sizes, strict=True)
            )
            assert (parsed.pickle_offset, parsed.pickle_size) == (
                plan.pickle_offset,
                plan.pickle_size,
            )
            assert count_records(plan.size, lambda off, n: mm[off : off + n]) == 6 + len(sizes)


# ------------------------------------------------------------------ fuzzing the parsers


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and ``valid`` with bytes flipped, cut off, or spliced in."""

    def flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
        buf = bytearray(data)
        for pos, value in edits:
            buf[pos % len(buf)] = value
        return bytes(buf)

    edits = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=8)
    return st.one_of(
        st.binary(max_size=2 * len(valid)),
        st.builds(flip, st.just(valid), edits),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=16)).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0] :]
        ),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)


def _replace_field(raw: Any, path: list[str | int], value: Any) -> Any:
    """``raw`` with the entry at ``path`` (keys or indices, wrapped around) set to ``value``."""
    if not path or not isinstance(raw, (dict, list)) or not raw:
        return value
    step, rest = path[0], path[1:]
    if isinstance(raw, dict):
        key = (
            step if step in raw else sorted(raw)[(step if isinstance(step, int) else 0) % len(raw)]
        )
        return {**raw, key: _replace_field(raw[key], rest, value)}
    i = step % len(raw) if isinstance(step, int) else 0
    return [*raw[:i], _replace_field(raw[i], rest, value), *raw[i + 1 :]]


_paths = st.lists(st.integers(0, 20) | st.sampled_from(["storages", "path", "offset"]), max_size=3)


# Fixed valid inputs (hypothesis needs the same strategy on every run: no fresh timestamps).
_, _PLAN = _write_segment({"a": torch.ones(3), "b": torch.arange(4)})
VALID_MANIFEST = dataclasses.replace(_PLAN.manifest, created=1.0).to_json()


def _check_manifest(m_: Manifest) -> None:
    assert isinstance(m_.path, str) and isinstance(m_.namespace, str)
    for s in m_.storages:
        assert all(isinstance(v, str) for v in (s.key, s.dtype, s.location, s.name))
        assert isinstance(s.offset, int) and isinstance(s.nbytes, int)


@FUZZ
@given(st.data())
def test_fuzz_manifest_from_bytes(data):
    blob = data.draw(_mutations(VALID_MANIFEST))
    try:
        _check_manifest(Manifest.from_json(blob, segment_size=4096))
    except CorruptCheckpoint:
        pass


@FUZZ
@given(_paths, json_values)
def test_fuzz_manifest_fields(path, value):
    blob = json.dumps(_replace_field(json.loads(VALID_MANIFEST), path, value)).encode()
    try:
        _check_manifest(Manifest.from_json(blob))
    except CorruptCheckpoint:
        pass


def test_deeply_nested_manifest_is_a_typed_error():
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_json(b"[" * 100_000)


def _valid_header() -> bytes:
    header = SegmentHeader(
        state=SegmentState.COMMITTED, generation=3, payload_offset=HEADER_SIZE,
        payload_size=100, manifest_offset=8192, manifest_size=50, digest_offset=9000,
        n_storages=2, digest_state=DigestState.VALID, created_ns=1, committed_ns=2, persisted=1,
    )  # fmt: skip
    return header.pack()


@FUZZ
@given(st.data())
def test_fuzz_segment_header(data):
    blob = data.draw(_mutations(_valid_header()))
    try:
        header = SegmentHeader.unpack(blob)
    except CorruptCheckpoint:
        return
    assert isinstance(header.state, SegmentState) and isinstance(header.digest_state, DigestState)


_MAPPING, _ARCHIVE_PLAN = _write_segment({"w": torch.arange(10), "v": torch.ones(2, 2)})
VALID_ARCHIVE = bytes(_MAPPING[HEADER_SIZE : HEADER_SIZE + _ARCHIVE_PLAN.archive.size])


@FUZZ
@given(st.data())
def test_fuzz_archive(data):
    blob = data.draw(_mutations(VALID_ARCHIVE))
    try:
        parsed = parse_archive(memoryview(blob))
    except CorruptCheckpoint:
        pass
    else:
        assert isinstance(parsed, ParsedArchive)
        for off, n in [(parsed.pickle_offset, parsed.pickle_size), *parsed.storages.values()]:
            assert off >= 0 and off + n <= len(blob)
    try:
        n = count_records(len(blob), lambda off, k: blob[off : off + k])
    except CorruptCheckpoint:
        return
    assert 0 <= n <= len(blob)


_MESSAGES = [getattr(m, n) for n in m.__all__ if dataclasses.is_dataclass(getattr(m, n))]


def _sample(cls: type) -> Any:
    """A valid instance of message ``cls`` (every field filled in by its type)."""
    values: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        text = str(hint)
        nested = [c for c in ("ObjectInfo", "PeerClock") if c in text]
        if nested:  # a tuple of nested messages
            values[name] = (_sample(getattr(m, nested[0])),)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            values[name] = next(iter(hint))
        elif "tuple" in text:
            values[name] = (1, 2) if "int" in text else ("a", "b")
        elif hint is bool:
            values[name] = True
        elif hint is float or "float" in text:
            values[name] = 1.5
        elif "int" in text:
            values[name] = 7
        else:
            values[name] = "x"
    return cls(**values)


@FUZZ
@given(st.sampled_from(_MESSAGES), st.data())
def test_fuzz_wire_messages(cls, data):
    valid = m.encode(_sample(cls))
    assert m.decode(cls, valid) == _sample(cls)
    text = data.draw(
        _mutations(valid.encode()).map(lambda b: b.decode("utf-8", "replace"))
        | st.builds(
            lambda p, v: json.dumps(_replace_field(json.loads(valid), p, v)), _paths, json_values
        )
    )
    try:
        message = m.decode(cls, text)
    except ProtocolMismatch:
        return
    _check_types(message)


def _check_types(message: Any) -> None:
    for name, hint in typing.get_type_hints(type(message)).items():
        value = getattr(message, name)
        text = str(hint)
        if "tuple" in text:
            assert isinstance(value, tuple), (name, value)
        elif hint is float:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
        elif hint is int or text == "int | None":
            assert value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif hint is str or text == "str | None":
            assert value is None or isinstance(value, str), (name, value)
        elif hint is bool:
            assert isinstance(value, bool), (name, value)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            assert type(value) is hint, (name, value)


def test_deeply_nested_message_is_a_typed_error():
    with pytest.raises(ProtocolMismatch):
        m.decode(m.ReserveRequest, "[" * 100_000)
