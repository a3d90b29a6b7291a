"""Local writes start the kernel's write-back as they go (``sync_file_range``) and stay whole
where the file system refuses it: the file is complete, byte for byte, either way."""

from __future__ import annotations

import itertools
import os

import pytest

from ckptcache.storage import fs
from ckptcache.storage.fs import FileBackend

MIB = 1 << 20


def _pieces() -> list[bytes]:
    return [bytes([i]) * (3 * MIB + i) for i in range(7)]  # ~21 MiB in uneven pieces


def _write(path: str) -> None:
    def produce(sink) -> None:
        for piece in _pieces():
            sink(memoryview(piece))

    FileBackend().write_stream(path, produce)


@pytest.mark.skipif(fs._sync_file_range is None, reason="no sync_file_range here")
def test_write_back_starts_every_few_mib_and_the_file_is_whole(tmp_path, monkeypatch):
    calls: list[tuple[int, int]] = []
    real = fs._sync_file_range

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(fs, "_sync_file_range", recording)
    path = str(tmp_path / "a.pt")
    _write(path)
    with open(path, "rb") as f:
        assert f.read() == b"".join(_pieces())
    # Consecutive ranges from the start, each at least the granule, none past the end.
    assert calls and calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(calls))
    assert all(n >= fs._WRITEBACK for _, n in calls)
    assert calls[-1][0] + calls[-1][1] <= os.path.getsize(path)


def test_a_file_system_that_refuses_it_still_gets_the_whole_file(tmp_path, monkeypatch):
    calls: list[int] = []

    def refusing(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(offset)
        return -1  # as FUSE answers ENOSYS

    monkeypatch.setattr(fs, "_sync_file_range", refusing)
    path = str(tmp_path / "b.pt")
    _write(path)
    with open(path, "rb") as f:
        assert f.read() == b"".join(_pieces())
    assert calls == [0]  # asked once, then left to the fsync
