"""The archive laid out in bulk is the one laid out a record at a time, byte for byte.

``_reference_plan`` is the layout as it was written before the bulk path (one record at a
time, zip64 fields where needed): every offset, name, header, descriptor and central
directory entry of :func:`plan_archive` must equal it, for any sizes (empty records, sizes
either side of the alignment, records and offsets past 4 GiB) and alignment.
"""

from __future__ import annotations

import struct
import sys
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.codec.flatten import flatten
from ckptcache.format.archive import (
    ARCHIVE_ALIGNMENT,
    ArchivePlan,
    central_record,
    end_records,
    layout_records,
    plan_archive,
)

_U32_MAX = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")


def _extra(offset: int, name_len: int, alignment: int) -> bytes:
    pad = (-(offset + _LOCAL.size + name_len)) % alignment
    if pad == 0:
        return b""
    if pad < 4:
        pad += alignment
    return b"FB" + struct.pack("<H", pad - 4) + b"Z" * (pad - 4)


def _reference_plan(
    pickle_bytes: bytes, sizes: list[int], serialization_id: str, alignment: int
) -> tuple[object, ...]:
    """The fields of the plan the one-record-at-a-time layout gives."""
    records: list[tuple[str, bytes | int]] = [
        ("data.pkl", pickle_bytes),
        (".format_version", b"1"),
        (".storage_alignment", str(alignment).encode()),
        ("byteorder", sys.byteorder.encode()),
        *((f"data/{i}", s) for i, s in enumerate(sizes)),
        ("version", b"3\n"),
        (".data/serialization_id", serialization_id.encode()),
    ]
    pieces: list[tuple[int, bytes]] = []
    central = b""
    data_offsets = []
    offset = 0
    id_piece = -1
    for name, content in records:
        full = f"archive/{name}".encode()
        extra = _extra(offset, len(full), alignment)
        size = content if isinstance(content, int) else len(content)
        local = _LOCAL.pack(0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        data = offset + len(local) + len(full) + len(extra)
        pieces.append((offset, local + full + extra))
        data_offsets.append(data)
        if not isinstance(content, int):
            if name == ".data/serialization_id":
                id_piece = len(pieces)
            pieces.append((data, content))
        descriptor = b""
        if size > 0:
            fmt = "<IIQQ" if offset >= _U32_MAX or size >= _U32_MAX else "<IIII"
            descriptor = struct.pack(fmt, 0x08074B50, 0, size, size)
            pieces.append((data + size, descriptor))
        central += central_record(full, offset, size)
        offset = data + size + len(descriptor)
    pieces.append((offset, central + end_records(len(records), offset, len(central))))
    return (
        offset + len(central) + 98,
        tuple(pieces),
        tuple(data_offsets[4 : 4 + len(sizes)]),
        data_offsets[0],
        len(pickle_bytes),
        id_piece,
    )


def _fields(plan: ArchivePlan) -> tuple[object, ...]:
    return (plan.size, plan.pieces, plan.storage_offsets, plan.pickle_offset,
            plan.pickle_size, plan.id_piece)  # fmt: skip


_EDGE_SIZES = st.sampled_from([0, 1, 2, 3, 4, 60, 61, 62, 63, 64, 65, 127, 128, 129, 4096])
_SIZES = st.one_of(_EDGE_SIZES, st.integers(0, 70_000))
_ALIGNMENTS = st.sampled_from([1, 4, 8, 16, 64, 128, 4096])


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(_SIZES, max_size=80),
    pickle_len=st.integers(0, 300),
    id_len=st.integers(0, 60),
    alignment=_ALIGNMENTS,
)
def test_bulk_layout_is_the_reference(
    sizes: list[int], pickle_len: int, id_len: int, alignment: int
) -> None:
    pickle_bytes = b"p" * pickle_len
    sid = "7" * id_len
    plan = plan_archive(pickle_bytes, sizes, serialization_id=sid, alignment=alignment)
    assert _fields(plan) == _reference_plan(pickle_bytes, sizes, sid, alignment)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 63, 64, 65, 1 << 30, _U32_MAX - 1, _U32_MAX,
                                       _U32_MAX + 1, 5 << 30]), max_size=12))  # fmt: skip
def test_past_4gib_is_the_reference(sizes: list[int]) -> None:
    """Records of 4 GiB or more, or past 4 GiB (zip64 descriptors), lay out as before."""
    plan = plan_archive(b"pkl", sizes)
    assert _fields(plan) == _reference_plan(b"pkl", sizes, "0" * 40, ARCHIVE_ALIGNMENT)


def test_many_records_are_the_reference() -> None:
    sizes = [16 << 20] * 24 + [65536] * 2048 + [0, 1, 63, 64, 65] * 40
    plan = plan_archive(b"x" * 100_000, sizes)
    assert _fields(plan) == _reference_plan(b"x" * 100_000, sizes, "0" * 40, 64)


def test_layout_records_leaves_zip64_to_the_one_by_one_path() -> None:
    assert layout_records([b"a"], [_U32_MAX]) is None
    assert layout_records([b"a", b"b"], [_U32_MAX - 1, 5]) is None
    assert layout_records([], []) is None
    assert layout_records([b"a"], [0]) == ([0], [64])


@pytest.mark.parametrize("sizes", [[], [0], [1, 63, 64, 65], [0, 0, 3] * 50, [64 << 10] * 100])
def test_bulk_archive_reads_with_torch_load(tmp_path, sizes: list[int]) -> None:
    """A state saved through the bulk layout is what plain ``torch.load`` reads back."""
    state = {f"t{i}": torch.arange(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    flat = flatten(state)
    plan = plan_archive(flat.skeleton, [i.nbytes for i in flat.infos])
    buf = bytearray(plan.size)
    plan.write_metadata(memoryview(buf))
    for off, storage in zip(plan.storage_offsets, flat.storages, strict=True):
        data = bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        buf[off : off + len(data)] = data
    (tmp_path / "a.pt").write_bytes(buf)
    names = zipfile.ZipFile(tmp_path / "a.pt").namelist()  # CRCs are 0, as torch.save's
    assert names[4 : 4 + len(sizes)] == [f"archive/data/{i}" for i in range(len(sizes))]
    out = torch.load(tmp_path / "a.pt", mmap=True)
    assert out.keys() == state.keys()
    assert all(torch.equal(out[k], v) for k, v in state.items())
