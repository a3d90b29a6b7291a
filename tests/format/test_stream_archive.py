"""The persisted form written with hashing beside the writes and small pieces gathered: the
same bytes as a record-by-record pass, fewer and larger writes, and a bad record refused."""

from __future__ import annotations

import io
import struct
import threading
import zlib

import pytest
import torch
import xxhash

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format import persisted
from ckptcache.format.persisted import check_archive, list_records, stream_archive
from ckptcache.storage.handoff import Gather


def _archive(state: dict) -> tuple[memoryview, dict]:
    """The archive a segment holds for ``state`` (CRC-32 = 0), and its plan's records."""
    import mmap

    flat = flatten(state)
    plan = plan_object(flat, "/ckpt/a.pt", "ns")
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    archive = memoryview(mapping)[4096 : 4096 + plan.archive.size]
    return archive, {r.offset - 4096: r for r in plan.manifest.storages}


def _reference(view: memoryview) -> bytes:
    """What the persisted form is, written the plain way: record by record, CRC and xxh3
    before each descriptor, the digest record and patched central directory at the end."""
    records, cd_offset = list_records(view)
    out = bytearray()
    meta = xxhash.xxh3_64()
    digests, crcs = {}, {}
    for record in records:
        head = view[record.header_offset : record.data_offset]
        data = view[record.data_offset : record.data_offset + record.size]
        meta.update(head)
        crc, digest = zlib.crc32(data), xxhash.xxh3_64_intdigest(data)
        descriptor = persisted._descriptor(view, record, crc)
        meta.update(descriptor)
        out += head
        out += data
        out += descriptor
        crcs[record.header_offset] = crc
        digests[record.name] = digest
    central = persisted._patched_central(view, cd_offset, len(records), crcs)
    meta.update(central)
    body = persisted._digest_body(digests, meta.intdigest())
    member = persisted._member(persisted._top_folder(records), body, cd_offset)
    out += member.local
    central += member.central
    out += central + persisted.end_records(len(records) + 1, cd_offset + len(member.local),
                                           len(central))  # fmt: skip
    return bytes(out)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    state = {f"small.{i}": torch.randn(16_384, generator=g) for i in range(300)}  # 64 KiB each
    state["big"] = torch.randn(5_000_000, generator=g)  # 19 MiB: three chunks of its own
    state["empty"] = torch.empty(0)
    state["scalar"] = torch.tensor(1.5)
    return state


def test_same_bytes_as_a_record_by_record_pass_gathered_into_fewer_larger_writes():
    """The stream hands each record's pieces as they lie; a sink that writes at a cost per
    call gathers them (the buffered file path does, through ``Gather``)."""
    view, _ = _archive(_state())
    writes: list[int] = []
    out = bytearray()

    def sink(piece):
        writes.append(len(piece))
        out.extend(piece)

    gather = Gather(sink)
    digests = stream_archive(view, gather.write, path="mem")
    gather.flush()
    assert bytes(out) == _reference(view)
    assert len(digests) == len(list_records(view)[0])
    check_archive(memoryview(bytes(out)), "mem", deep=True)
    loaded = torch.load(io.BytesIO(bytes(out)), weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())
    # 300 small records were 900 writes: gathered, every write but the last few is large.
    assert len(writes) < 20
    assert sum(1 for n in writes if n < 1 << 20) <= 4


def test_a_record_that_changed_is_refused_and_the_hashing_thread_ends():
    view, records = _archive(_state())
    offset = next(o for o, r in records.items() if r.name == "small.7")
    expected = {o: (xxhash.xxh3_64_intdigest(view[o : o + r.nbytes]), r.name)
                for o, r in records.items()}  # fmt: skip
    expected[offset] = (expected[offset][0] ^ 1, "small.7")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(CorruptCheckpoint, match=r"'small\.7'") as err:
        stream_archive(view, lambda piece: None, path="mem", expected=expected)
    assert err.value.tensor == "small.7" and err.value.tier == "local"
    assert {t.name for t in threading.enumerate()} <= before


def test_descriptor_crcs_are_the_records_own():
    view, records = _archive(_state())
    out = bytearray()
    stream_archive(view, out.extend, path="mem")
    persisted_records, _ = list_records(memoryview(bytes(out)))
    by_name = {r.name: r for r in persisted_records}
    for offset, record in records.items():
        rec = by_name[f"archive/data/{record.key}"]
        data = view[offset : offset + record.nbytes]
        assert rec.crc == zlib.crc32(data)
        tail = bytes(out[rec.data_offset + rec.size : rec.data_offset + rec.size + 8])
        if record.nbytes:
            assert struct.unpack_from("<I", tail, 4)[0] == zlib.crc32(data)
