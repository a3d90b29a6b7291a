"""Files written with gaps that a kernel copy fills: the file is the one a plain stream writes,
direct or buffered, and the source is only read."""

from __future__ import annotations

import errno
import io
import os
import zlib

import pytest
import torch
import xxhash

from ckptcache.format.persisted import CopiedRange, stream_archive
from ckptcache.storage.direct import BLOCK, DIRECT_ENV, DirectWriter, open_direct
from ckptcache.storage.ranges import copy_range, gapped_stream_fill, read_back

MIB = 1 << 20


def _archive() -> memoryview:
    g = torch.Generator().manual_seed(3)
    blob = io.BytesIO()
    torch.save({f"t{i}": torch.randn(MIB // 4 + 7 * i, generator=g) for i in range(4)}, blob)
    return memoryview(blob.getvalue())


def _plain(view: memoryview) -> bytes:
    out = bytearray()
    stream_archive(view, out.extend, path="x")
    return bytes(out)


@pytest.mark.parametrize("direct", ["1", "0", "refused"])
def test_a_gapped_stream_filled_by_copies_is_the_plain_file(tmp_path, monkeypatch, direct):
    monkeypatch.setenv(DIRECT_ENV, "0" if direct == "0" else "1")
    if direct == "refused":  # the file system takes O_DIRECT but refuses the writes

        def refuse(*args, **kwargs):
            raise OSError(errno.EINVAL, "refused")

        monkeypatch.setattr(os, "pwritev", refuse)
    view = _archive()
    expected = _plain(view)
    source_path = tmp_path / "previous"
    source_path.write_bytes(expected)  # an earlier file holding the same records
    before = source_path.read_bytes()
    planned: dict[int, CopiedRange] = {}

    def reuse(records):
        for r in records:
            start = -(-r.data_offset // BLOCK) * BLOCK
            end = (r.data_offset + r.size) // BLOCK * BLOCK
            if r.size >= MIB // 4 and end > start:
                data = view[r.data_offset : r.data_offset + r.size]
                planned[r.data_offset] = CopiedRange(
                    start, end, xxhash.xxh3_64_intdigest(data), zlib.crc32(data)
                )
        return planned

    def produce(sink, skip):
        stream_archive(view, sink, path="x", reuse=reuse, skip=skip)

    source = os.open(source_path, os.O_RDONLY)

    def finish(fd):
        for copied in planned.values():
            copy_range(source, fd, copied.start, copied.start, copied.end - copied.start)

    target = tmp_path / "new"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        gapped_stream_fill(produce, finish)(fd)
    finally:
        os.close(fd)
        os.close(source)
    assert len(planned) == 4
    assert target.read_bytes() == expected
    assert source_path.read_bytes() == before
    source_path.unlink()  # the copy stands on its own
    assert target.read_bytes() == expected


def test_a_skip_must_cover_whole_blocks(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not open_direct(fd):
            pytest.skip("no O_DIRECT here")
        writer = DirectWriter(fd)
        writer.write(b"x" * 100)
        with pytest.raises(ValueError, match="whole blocks"):
            writer.skip(BLOCK)
        writer.abort()
    finally:
        os.close(fd)


def test_a_source_that_ends_early_is_reported(tmp_path):
    (tmp_path / "src").write_bytes(b"a" * BLOCK)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as err:
            copy_range(src, dst, 0, 0, 2 * BLOCK)
        assert err.value.errno == errno.ENODATA
        buf = memoryview(bytearray(100))
        assert b"".join(bytes(p) for p in read_back(dst, 0, BLOCK, buf)) == b"a" * BLOCK
    finally:
        os.close(src)
        os.close(dst)
