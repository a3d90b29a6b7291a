"""Property and fuzz tests of the format's parsers.

Round trips: a planned archive is what ``torch.load`` and :func:`parse_archive` read back
(views, shared storages, zip64 sizes and offsets). Fuzz: manifests, segment headers and
archives decoded from random or mutated bytes either decode or raise the parser's typed error
(a :class:`CkptCacheError`), never anything else (wire messages: ``tests/wire/``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import ParsedArchive, count_records, parse_archive, plan_archive
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState
from ckptcache.format.manifest import Manifest
from tests.fuzzing import FUZZ, json_paths, json_values, mutations, replace_field
from tests.helpers import assert_same

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
    blob = data.draw(mutations(VALID_MANIFEST))
    try:
        _check_manifest(Manifest.from_json(blob, segment_size=4096))
    except CorruptCheckpoint:
        pass


@FUZZ
@given(json_paths, json_values)
def test_fuzz_manifest_fields(path, value):
    blob = json.dumps(replace_field(json.loads(VALID_MANIFEST), path, value)).encode()
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
    blob = data.draw(mutations(_valid_header()))
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
    blob = data.draw(mutations(VALID_ARCHIVE))
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
