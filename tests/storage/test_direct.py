"""Direct writes (``O_DIRECT``) of a persisted archive: the file is byte for byte what the
buffered path writes, a refusal falls back to buffered writes, an I/O error fails the write
and names nothing."""

from __future__ import annotations

import errno
import hashlib
import io
import mmap
import os
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

from ckptcache.cli.benchmarking import make_state, mixed_state
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.persisted import check_archive, stream_archive
from ckptcache.storage import direct, fs
from ckptcache.storage.direct import BLOCK, DIRECT_ENV, DirectWriter, open_direct
from ckptcache.storage.fs import FileBackend
from ckptcache.storage.handoff import QUEUED

MIB = 1 << 20


def _segment(state: object) -> tuple[mmap.mmap, memoryview]:
    """The archive of ``state`` as a segment holds it: page-aligned mapping, payload after
    the segment header."""
    blob = io.BytesIO()
    torch.save(state, blob)
    data = blob.getbuffer()
    mapping = mmap.mmap(-1, HEADER_SIZE + len(data))
    mapping[HEADER_SIZE : HEADER_SIZE + len(data)] = data
    return mapping, memoryview(mapping)[HEADER_SIZE : HEADER_SIZE + len(data)]


def _persist(view: memoryview, path: str) -> str:
    FileBackend().write_stream(path, lambda sink: stream_archive(view, sink, path=path))
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class _Spy(DirectWriter):
    made: list[DirectWriter] = []

    def __init__(self, fd: int):
        super().__init__(fd)
        _Spy.made.append(self)


@pytest.fixture
def spy(monkeypatch):
    _Spy.made = []
    monkeypatch.setattr(fs, "DirectWriter", _Spy)
    return _Spy.made


STATES = {
    "few large": lambda: make_state(24 * MIB, n_tensors=4),
    # 2,072 tensors, the benchmark's 512 MiB mix at 1/8 of its size
    "mixed": lambda: mixed_state(64 * MIB, big=2 * MIB, small=8 << 10),
    "straddling": lambda: {
        f"t{i}": torch.arange(n, dtype=torch.uint8)
        for i, n in enumerate([1, 4095, 4097, MIB + 13, 2 * MIB - 7, 3 * MIB + 4096 + 1])
    },
    "empty tensor": lambda: {"empty": torch.empty(0), "big": torch.ones(MIB + 100)},
}


@pytest.mark.parametrize("name", sorted(STATES))
def test_the_direct_file_is_the_buffered_file(tmp_path, monkeypatch, spy, name):
    state = STATES[name]()
    mapping, view = _segment(state)
    direct_sha = _persist(view, str(tmp_path / "direct.pt"))
    monkeypatch.setenv(DIRECT_ENV, "0")
    buffered_sha = _persist(view, str(tmp_path / "buffered.pt"))
    assert direct_sha == buffered_sha
    assert len(spy) == 1 and not spy[0].buffered
    assert spy[0].direct_bytes > 0  # the large runs went straight from the segment
    loaded = torch.load(str(tmp_path / "direct.pt"), weights_only=True)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    with open(tmp_path / "direct.pt", "rb") as f:
        data = f.read()
    check_archive(memoryview(data), "direct.pt", deep=True)
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every CRC-32
    view.release()
    mapping.close()


def _pieces(total: int) -> list[bytes | memoryview]:
    """Pieces of mixed sizes, some large and aligned with their file offset (they come from
    a page-aligned buffer at that offset), some copies, ``total`` bytes in all."""
    source = mmap.mmap(-1, total + BLOCK)
    source[:total] = os.urandom(total)
    whole = memoryview(source)
    out: list[bytes | memoryview] = []
    at = 0
    sizes = [30, 4066, 2 * MIB + 5, 100, MIB, 3 * MIB + 4095, 1]
    n = 0
    while at < total:
        size = min(sizes[n % len(sizes)], total - at)
        out.append(whole[at : at + size] if size >= MIB else bytes(whole[at : at + size]))
        at += size
        n += 1
    return out


@pytest.mark.parametrize("total", [16 * MIB, 16 * MIB + 123, 9 * MIB + BLOCK, 1000, 0])
def test_the_writer_writes_every_byte_at_its_place(tmp_path, total):
    pieces = _pieces(total)
    path = str(tmp_path / "w.bin")
    writer = _write_pieces(path, pieces)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(p) for p in pieces)
    if total >= 16 * MIB:
        assert writer.direct_bytes > 8 * MIB


def _write_pieces(path: str, pieces: list[bytes | memoryview]) -> DirectWriter:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert open_direct(fd)
        writer = DirectWriter(fd)
        for piece in pieces:
            writer.write(piece)
        writer.close()
    finally:
        os.close(fd)
    return writer


def test_a_slow_disk_gets_every_byte_and_the_bounce_buffers_stay_few(tmp_path, monkeypatch):
    """The writer thread lags (each write sleeps) while the caller copies on: no bounce buffer
    is refilled before it is written, and the buffers in use stay bounded by the queue."""
    real = os.pwritev

    def slow(fd: int, views: list[memoryview], offset: int) -> int:
        time.sleep(0.005)
        return real(fd, views, offset)

    monkeypatch.setattr(direct.os, "pwritev", slow)
    made: list[object] = []
    real_take = DirectWriter._take

    def take(self: DirectWriter) -> object:
        bounce = real_take(self)
        if bounce not in made:
            made.append(bounce)
        return bounce

    monkeypatch.setattr(DirectWriter, "_take", take)
    # 160 MiB of small pieces (copied: twenty bounce buffers' worth) and some large ones
    pieces = [os.urandom(64 << 10) for _ in range(2048)] + _pieces(24 * MIB)
    path = str(tmp_path / "slow.bin")
    _write_pieces(path, pieces)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(p) for p in pieces)
    assert 2 <= len(made) <= QUEUED // direct.BOUNCE + 1


def test_a_short_direct_write_is_finished(tmp_path, monkeypatch):
    """``pwritev`` may write less than asked (a signal, a device limit): the rest follows."""
    real = os.pwritev

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        first = views[0]
        if len(first) > BLOCK:  # one block of the first view only
            return real(fd, [first[:BLOCK]], offset)
        return real(fd, views, offset)

    monkeypatch.setattr(direct.os, "pwritev", short)
    pieces = _pieces(16 * MIB + 123)
    path = str(tmp_path / "short.bin")
    writer = _write_pieces(path, pieces)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(p) for p in pieces)
    assert writer.direct_bytes > 8 * MIB and not writer.buffered


def _refusing_pwritev(after: int):
    real = os.pwritev
    calls = [0]

    def pwritev(fd: int, views: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, views, offset)

    return pwritev


@pytest.mark.parametrize("after", [0, 1, 3])
def test_a_refused_direct_write_falls_back_to_the_same_bytes(tmp_path, monkeypatch, spy, after):
    """EINVAL on the first direct write (or a later one): the rest of the file goes buffered."""
    mapping, view = _segment(STATES["straddling"]())
    monkeypatch.setenv(DIRECT_ENV, "0")
    want = _persist(view, str(tmp_path / "buffered.pt"))
    monkeypatch.setenv(DIRECT_ENV, "1")
    before = direct.fallbacks
    monkeypatch.setattr(direct.os, "pwritev", _refusing_pwritev(after))
    assert _persist(view, str(tmp_path / "fallback.pt")) == want
    assert direct.fallbacks == before + 1
    assert spy[-1].buffered
    view.release()
    mapping.close()


def test_a_refused_o_direct_on_open_writes_buffered(tmp_path, monkeypatch, spy):
    mapping, view = _segment(STATES["few large"]())
    monkeypatch.setenv(DIRECT_ENV, "0")
    want = _persist(view, str(tmp_path / "buffered.pt"))
    monkeypatch.setenv(DIRECT_ENV, "1")
    real = direct.fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == direct.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    before = direct.fallbacks
    assert _persist(view, str(tmp_path / "fallback.pt")) == want
    assert direct.fallbacks == before + 1
    assert spy == []  # never tried
    view.release()
    mapping.close()


def test_direct_writes_can_be_turned_off(tmp_path, monkeypatch, spy):
    monkeypatch.setenv(DIRECT_ENV, "0")
    mapping, view = _segment(STATES["few large"]())
    _persist(view, str(tmp_path / "off.pt"))
    assert spy == []
    view.release()
    mapping.close()


def test_an_io_error_in_a_direct_write_fails_and_names_nothing(tmp_path, monkeypatch):
    real = os.pwritev
    calls = [0]

    def failing(fd: int, views: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, views, offset)

    monkeypatch.setattr(direct.os, "pwritev", failing)
    _mapping, view = _segment(STATES["few large"]())
    with pytest.raises(OSError) as info:
        _persist(view, str(tmp_path / "full.pt"))
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # the segment's mapping is left to the collector


def test_a_file_size_limit_mid_write_fails_the_persist_and_names_nothing(tmp_path):
    """A real kernel error mid-file (EFBIG past ``RLIMIT_FSIZE``), in a child process."""
    script = textwrap.dedent(f"""
        import errno, resource, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.storage.test_direct import STATES, _persist, _segment
        mapping, view = _segment(STATES["few large"]())
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))
        try:
            _persist(view, {str(tmp_path / "big.pt")!r})
        except OSError as e:
            sys.exit(0 if e.errno == errno.EFBIG else 3)
        sys.exit(2)
    """)
    env = dict(os.environ, **{DIRECT_ENV: "1"})
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path) == []


def test_a_bad_record_mid_persist_stops_the_writer_and_names_nothing(tmp_path):
    """The persist's producer fails halfway (a record's digest does not match): the writer
    thread is stopped with what it had queued, no file is named, no thread is left."""
    import threading

    import xxhash

    from ckptcache.errors import CorruptCheckpoint
    from ckptcache.format.persisted import list_records

    mapping, view = _segment(STATES["mixed"]())
    records, _ = list_records(view)
    data = [r for r in records if r.size > 0]
    bad = data[len(data) // 2]
    expected = {r.data_offset: (xxhash.xxh3_64_intdigest(view[r.data_offset : r.data_offset
                                                              + r.size]), r.name)
                for r in data}  # fmt: skip
    expected[bad.data_offset] = (expected[bad.data_offset][0] ^ 1, bad.name)
    before = {t.ident for t in threading.enumerate()}
    path = str(tmp_path / "bad.pt")
    with pytest.raises(CorruptCheckpoint, match="it was not persisted") as info:
        FileBackend().write_stream(
            path, lambda sink: stream_archive(view, sink, path=path, expected=expected)
        )
    assert info.value.tensor == bad.name and info.value.tier == "local"
    assert os.listdir(tmp_path) == []
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
    view.release()
    mapping.close()
