"""The storage reader that checks an archive as it lands: same answers as the two-pass check.

Real archives (``torch.save``'s, and the persisted form with its digest record) on a real
file-system backend, read into a buffer the size of the object with several reader threads
and ranges that cut records at unaligned places.
"""

from __future__ import annotations

import io
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive_read import BLOCK, read_archive
from ckptcache.format.crc import CRC32_IMPLEMENTATION, crc32, crc32_combine
from ckptcache.format.persisted import check_archive, list_records, stream_archive
from ckptcache.storage import backend_for
from ckptcache.storage.reporting import ReportingReads, read_into_reporting
from ckptcache.storage.s3 import READ_PIECE


def torch_archive() -> bytes:
    """A plain ``torch.save`` archive (CRC-32s, no digest record) whose tensors straddle
    block and range boundaries."""
    g = torch.Generator().manual_seed(7)
    state = {
        "a": torch.randn(340_000, generator=g),  # 1.3 MiB
        "b": torch.randn(800_000, generator=g),  # 3.05 MiB
        "small": torch.arange(10),
        "c": torch.randn(262_144, generator=g),  # exactly 1 MiB
        "step": 5,
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def persisted_archive() -> bytes:
    """The same archive in its persisted form (real CRC-32s and the digest record)."""
    out = bytearray()
    stream_archive(memoryview(torch_archive()), out.extend, path="mem")
    return bytes(out)


def read(tmp_path, data: bytes, **kwargs) -> tuple[dict[int, int], bytearray, list[int]]:
    path = tmp_path / "model.pt"
    path.write_bytes(data)
    view = bytearray(len(data))
    landed: list[int] = []
    digests = read_archive(backend_for(str(path)), str(path), memoryview(view),
                           advance=landed.append, **kwargs)  # fmt: skip
    return digests, view, landed


@pytest.mark.parametrize("prefix_first", [False, True])
@pytest.mark.parametrize("make", [torch_archive, persisted_archive])
@pytest.mark.parametrize(
    "concurrency,chunk", [(1, BLOCK), (4, BLOCK), (3, 2 * BLOCK), (2, 64 << 20)]
)
def test_same_bytes_and_digests_as_the_two_pass_check(
    tmp_path, make, concurrency, chunk, prefix_first
):
    data = make()
    digests, view, landed = read(tmp_path, data, concurrency=concurrency, chunk=chunk,
                                 prefix_first=prefix_first)  # fmt: skip
    assert bytes(view) == data
    assert digests == check_archive(memoryview(data), "ref", deep=True)
    records, _ = list_records(memoryview(data))
    assert len(digests) == len([r for r in records if "digests.json" not in r.name])
    assert landed == sorted(landed) and landed[-1] == len(data)


@pytest.mark.parametrize("prefix_first", [False, True])
@pytest.mark.parametrize("make", [torch_archive, persisted_archive])
def test_a_flipped_byte_in_a_tensor_is_refused_naming_it(tmp_path, make, prefix_first):
    data = bytearray(make())
    record = next(r for r in list_records(memoryview(bytes(data)))[0] if r.name.endswith("/0"))
    data[record.data_offset + record.size // 2] ^= 0x10
    against = "CRC-32" if make is torch_archive else "digest"
    with pytest.raises(CorruptCheckpoint, match=f"does not match its {against}") as info:
        read(tmp_path, bytes(data), concurrency=4, chunk=BLOCK, prefix_first=prefix_first)
    # Named as the state-dict path of the tensor (from the skeleton), with its record.
    assert info.value.tensor == "a" and record.name in str(info.value)


def test_a_flipped_byte_in_a_small_record_is_refused(tmp_path):
    data = bytearray(torch_archive())
    record = next(
        r for r in list_records(memoryview(bytes(data)))[0] if r.name.endswith("data.pkl")
    )
    data[record.data_offset + 3] ^= 0x01
    with pytest.raises(CorruptCheckpoint, match=r"data\.pkl"):
        read(tmp_path, bytes(data), concurrency=2, chunk=BLOCK)


@pytest.mark.parametrize("prefix_first", [False, True])
@pytest.mark.parametrize("cut", [1, 22, 1000, BLOCK + 5])
def test_a_truncated_file_is_refused(tmp_path, cut, prefix_first):
    data = torch_archive()
    with pytest.raises(CorruptCheckpoint, match="corrupt"):
        read(tmp_path, data[:-cut], concurrency=2, chunk=BLOCK, prefix_first=prefix_first)


def test_a_file_that_is_not_an_archive_is_refused(tmp_path):
    with pytest.raises(CorruptCheckpoint, match="corrupt"):
        read(tmp_path, b"x" * (3 * BLOCK), concurrency=2, chunk=BLOCK)
    with pytest.raises(CorruptCheckpoint, match="too short"):
        read(tmp_path, b"PK", concurrency=1)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.binary(max_size=5000))
def test_crc32_combine_matches_zlib(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1))
def test_the_crc32_in_use_is_zlibs_function(data, start):
    """ISA-L's CRC-32 (where installed) is zip's, continued from any running value as zlib's."""
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, start) == zlib.crc32(data, start)
    assert crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])


def test_the_fast_crc32_is_installed():
    """The project depends on ``isal``: a persist at zlib's CRC rate is bound by the CPU."""
    assert CRC32_IMPLEMENTATION == "isal"


def test_a_damaged_local_header_is_refused(tmp_path):
    data = bytearray(torch_archive())
    record = next(r for r in list_records(memoryview(bytes(data)))[0] if r.name.endswith("/1"))
    data[record.header_offset : record.header_offset + 4] = b"XXXX"
    with pytest.raises(CorruptCheckpoint, match="bad local header"):
        read(tmp_path, bytes(data), concurrency=3, chunk=BLOCK)


def test_the_prefix_moves_inside_a_range_read_from_s3(s3_server, s3_bucket):
    """Read from S3 (moto's server over HTTP), the landed prefix the relays follow moves every
    :data:`READ_PIECE` bytes inside a range, not only when a whole range has landed: with
    several ranges sharing a link the first lands last, and a relay that waited for whole
    ranges trailed the read by that many. The bytes and the digests are those of the
    two-pass check."""
    data = persisted_archive()
    s3_server.client().put_object(Bucket=s3_bucket, Key="m.pt", Body=data)  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/m.pt"
    view = bytearray(len(data))
    landed: list[int] = []
    chunk = 4 * BLOCK  # one range of 4 MiB, then tapered ones (plan_ranges)
    digests = read_archive(backend_for(url), url, memoryview(view), advance=landed.append,
                           concurrency=1, chunk=chunk, prefix_first=True)  # fmt: skip
    assert bytes(view) == data
    assert digests == check_archive(memoryview(data), "mem", deep=True)
    assert landed == sorted(set(landed)) and landed[-1] == len(data)
    assert {READ_PIECE, 2 * READ_PIECE, 3 * READ_PIECE} <= set(landed)  # inside range 0


def test_an_s3_ranged_read_reports_each_piece_as_it_lands(s3_server, s3_bucket):
    data = bytes(range(256)) * ((3 * READ_PIECE + 5000) // 256)
    s3_server.client().put_object(Bucket=s3_bucket, Key="r", Body=data)  # type: ignore[attr-defined]
    backend = backend_for(f"s3://{s3_bucket}/r")
    assert isinstance(backend, ReportingReads)
    view = bytearray(len(data) - 100)
    reported: list[int] = []
    read_into_reporting(backend, f"s3://{s3_bucket}/r", 100, memoryview(view), reported.append)
    assert bytes(view) == data[100:]
    assert reported == [READ_PIECE, 2 * READ_PIECE, 3 * READ_PIECE, len(view)]
    local = backend_for("/tmp/x")  # no reporting read: the whole view, once, at the end
    assert not isinstance(local, ReportingReads)


def big_archive() -> bytes:
    """A plain ``torch.save`` archive large enough for probe rounds of 1, 2 and 3 ranges."""
    g = torch.Generator().manual_seed(11)
    buf = io.BytesIO()
    torch.save({"w": torch.randn(6_000_000, generator=g), "b": torch.arange(7)}, buf)  # 23 MiB
    return buf.getvalue()


@pytest.mark.parametrize("make", [torch_archive, big_archive])
def test_a_read_that_chooses_its_streams_gives_the_same_bytes_and_digests(tmp_path, make):
    data = make()
    chosen: list[int] = []
    digests, view, landed = read(tmp_path, data, concurrency=4, chunk=lambda k: k * BLOCK,
                                 prefix_first=True, adapt=True, chosen=chosen.append)  # fmt: skip
    assert bytes(view) == data
    assert digests == check_archive(memoryview(data), "ref", deep=True)
    assert landed == sorted(landed) and landed[-1] == len(data)
    assert len(chosen) == 1 and 1 <= chosen[0] <= 4


def test_a_flipped_byte_in_the_probed_bytes_is_refused(tmp_path):
    data = bytearray(big_archive())
    record = next(r for r in list_records(memoryview(bytes(data)))[0] if r.name.endswith("/0"))
    data[record.data_offset + 100] ^= 0x10  # in the probe's first range
    with pytest.raises(CorruptCheckpoint, match="does not match its CRC-32"):
        read(tmp_path, bytes(data), concurrency=4, chunk=BLOCK, prefix_first=True, adapt=True)
