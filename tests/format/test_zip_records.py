"""The central-directory reader of stored archives (``ckptcache.format.zip_records``) against
``zipfile``: the same records for every archive the project meets (``torch.save``'s, a
segment's, a persisted one, zip64 extra fields), and for damaged ones never an answer that
``zipfile`` would not give: every archive it accepts, ``zipfile`` reads the same way."""

from __future__ import annotations

import io
import mmap
import struct
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import PARSE_ERRORS, ViewReader, count_records, end_records
from ckptcache.format.persisted import stream_archive
from ckptcache.format.zip_records import ArchiveRecord, central_offset, list_records

_LOCAL = struct.Struct("<IHHHHHIIIHH")


def _reference(view: memoryview) -> tuple[list[ArchiveRecord], int]:
    """The records as ``zipfile`` reads them, with the local headers checked as the reader
    does (its earlier implementation); raises what ``zipfile`` raises."""
    infos = zipfile.ZipFile(io.BufferedReader(ViewReader(view))).infolist()
    if count_records(len(view), lambda o, n: bytes(view[o : o + n])) != len(infos):
        raise ValueError("count")
    infos.sort(key=lambda i: i.header_offset)
    size = len(view)
    (cd,) = struct.unpack_from("<I", view, size - 6)
    if cd == 0xFFFFFFFF:
        (eocd64,) = struct.unpack_from("<Q", view, size - 42 + 8)
        (cd,) = struct.unpack_from("<Q", view, eocd64 + 48)
    records = []
    for n, info in enumerate(infos):
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError("compressed")
        start = info.header_offset
        fields = _LOCAL.unpack(bytes(view[start : start + _LOCAL.size]))
        if fields[0] != 0x04034B50:
            raise ValueError("local")
        name = bytes(view[start + 30 : start + 30 + fields[9]])
        if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise ValueError("name")
        data = start + 30 + fields[9] + fields[10]
        end = infos[n + 1].header_offset if n + 1 < len(infos) else cd
        if data + info.file_size > end:
            raise ValueError("past end")
        records.append(ArchiveRecord(info.filename, start, data, info.file_size, info.CRC, end))
    return records, cd


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64),
            "e": torch.empty(0), "é": torch.zeros(3)}  # fmt: skip


def _torch_save() -> bytes:
    blob = io.BytesIO()
    torch.save(_state(), blob)
    return blob.getvalue()


def _segment() -> bytes:
    flat = flatten(_state())
    plan = plan_object(flat, "/ckpt/a.pt", "ns")
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    return bytes(mapping[4096 : 4096 + plan.archive.size])


def _persisted() -> bytes:
    out = bytearray()
    stream_archive(memoryview(_segment()), out.extend, path="mem")
    return bytes(out)


def _zip64_extras() -> bytes:
    """Three stored records whose central entries give size and offset in zip64 extra fields
    (saturated 32-bit fields), one with an unrelated extra field before it."""
    out = bytearray()
    central = bytearray()
    for n, (name, body) in enumerate([(b"a/x", b"hello"), (b"a/y", b""), (b"a/z", b"\0" * 99)]):
        offset = len(out)
        out += _LOCAL.pack(0x04034B50, 45, 0, 0, 0, 0, 0, len(body), len(body), len(name), 0)
        out += name + body
        extra = struct.pack("<HHQQQ", 0x0001, 24, len(body), len(body), offset)
        if n == 1:
            extra = struct.pack("<HH4s", 0x5455, 4, b"time") + extra
        central += struct.pack("<IBBBBHHHHIIIHHHHHII", 0x02014B50, 45, 3, 45, 0, 0, 0, 0, 0, 0,
                               0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0,
                               0xFFFFFFFF)  # fmt: skip
        central += name + extra
    cd = len(out)
    return bytes(out + central + end_records(3, cd, len(central)))


ARCHIVES = {"torch.save": _torch_save, "segment": _segment, "persisted": _persisted,
            "zip64 extras": _zip64_extras}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ARCHIVES))
def test_the_same_records_as_zipfile(name):
    view = memoryview(ARCHIVES[name]())
    records, cd = list_records(view)
    assert (records, cd) == _reference(view)
    assert central_offset(view) == cd
    assert len(records) >= 3 and all(r.data_offset <= r.end for r in records)


def _outcome(data: bytes) -> tuple[str, object]:
    view = memoryview(data)
    try:
        return "ok", list_records(view)
    except CorruptCheckpoint as e:
        return "refused", str(e)


def _reference_outcome(data: bytes) -> tuple[str, object]:
    try:
        return "ok", _reference(memoryview(data))
    except (CorruptCheckpoint, *PARSE_ERRORS):
        return "refused", None


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(ARCHIVES)),
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=3
    ),
    tail_bias=st.booleans(),
    cut=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
)
def test_a_damaged_archive_is_refused_or_read_as_zipfile_reads_it(name, edits, tail_bias, cut):
    """Bytes changed (most of them in the central directory and end records, where the
    structure lies) or cut off: the reader refuses with ``CorruptCheckpoint``, or gives the
    records ``zipfile`` gives."""
    data = bytearray(ARCHIVES[name]())
    for where, value in edits:
        if tail_bias:  # the last 300 bytes: central directory and end records
            at = len(data) - 1 - int(where * min(300, len(data)))
        else:
            at = int(where * len(data))
        data[at] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    ours = _outcome(bytes(data))
    if ours[0] == "ok":
        assert _reference_outcome(bytes(data)) == ours


@pytest.mark.parametrize("cut", [0, 1, 21, 22, 60, 98, 99, 150])
def test_a_truncated_archive_names_what_is_missing(cut):
    data = _segment()
    with pytest.raises(CorruptCheckpoint, match="corrupt in the storage tier") as info:
        list_records(memoryview(data[: len(data) - cut] if cut else data[:10]))
    assert info.value.tier == "storage"


@pytest.mark.parametrize("name", ["torch.save", "segment"])
def test_bytes_before_the_archive_are_refused_where_zipfile_would_shift_every_offset(name):
    archive = ARCHIVES[name]()
    data = b"prefix" + archive
    # zipfile reads it, every offset shifted by the prefix (a persist of it then failed on a
    # central entry whose offset named no record); a checkpoint never starts with other bytes
    assert len(zipfile.ZipFile(io.BytesIO(data)).namelist()) == len(
        list_records(memoryview(archive))[0]
    )
    refused = r"zip64 end record is not before its locator|does not end where the end records"
    with pytest.raises(CorruptCheckpoint, match=refused):
        list_records(memoryview(data))


def test_a_compressed_record_is_refused():
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/data.pkl", b"x" * 1000)
    with pytest.raises(CorruptCheckpoint, match=r"compressed record 'a/data\.pkl'"):
        list_records(memoryview(blob.getvalue()))


def test_a_local_header_that_names_another_record_is_refused():
    data = bytearray(_segment())
    records, _ = list_records(memoryview(data))
    record = records[1]
    data[record.header_offset + 30] ^= 0x01  # first byte of its local name
    with pytest.raises(CorruptCheckpoint, match="the local header of record"):
        list_records(memoryview(bytes(data)))
