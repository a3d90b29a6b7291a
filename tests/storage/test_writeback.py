"""Local writes start the kernel's write-back as they go, wait for it a window behind and drop
what the disk has finished (``ckptcache.storage.writeback``), and stay whole where the file
system refuses it: the file is complete, byte for byte, either way, and still ends with the
fsync of the file, its naming and the fsync of its directory."""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from ckptcache.storage import writeback
from ckptcache.storage.direct import DIRECT_ENV
from ckptcache.storage.fs import FileBackend
from ckptcache.storage.writeback import MIN_WINDOW, WINDOW, BoundedWriteback, window_for

MIB = 1 << 20
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_sync_file_range = pytest.mark.skipif(
    writeback._sync_file_range is None, reason="no sync_file_range here"
)


@pytest.fixture(autouse=True)
def _buffered(monkeypatch):
    """These tests are about the buffered path (direct writes have their own tests)."""
    monkeypatch.setenv(DIRECT_ENV, "0")


def _pieces() -> list[bytes]:
    return [bytes([i]) * (3 * MIB + i) for i in range(7)]  # ~21 MiB in uneven pieces


def _write(path: str) -> None:
    def produce(sink) -> None:
        for piece in _pieces():
            sink(memoryview(piece))

    FileBackend().write_stream(path, produce)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize(
    ("background", "window"),
    [
        (None, WINDOW),  # unknown: the default
        (0, WINDOW),
        (20 << 30, WINDOW),  # a large node: the default, not an eighth of 20 GiB
        (2 << 30, WINDOW),  # this project's test VM (about 2 GiB)
        (512 * MIB, 64 * MIB),  # a small node: an eighth of its threshold
        (64 * MIB, MIN_WINDOW),  # a tiny one: never under the floor
    ],
)
def test_the_window_follows_the_kernels_background_threshold(background, window):
    assert window_for(background) == window


def test_an_explicit_window_is_still_bounded_by_the_threshold():
    assert window_for(None, window=32 * MIB) == 32 * MIB
    assert window_for(1 << 30, window=512 * MIB) == 128 * MIB
    assert window_for(1 << 30, window=MIB) == MIN_WINDOW


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/vmstat")
def test_the_threshold_is_read_from_the_kernel():
    background = writeback.background_threshold()
    assert background is not None and background > 0
    assert background % os.sysconf("SC_PAGE_SIZE") == 0


def _record(monkeypatch) -> list[tuple[int, int, int]]:
    """Every sync_file_range call (offset, length, flags), passed on to the real one."""
    calls: list[tuple[int, int, int]] = []
    real = writeback._sync_file_range

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_sync_file_range", recording)
    return calls


@needs_sync_file_range
def test_write_back_starts_every_step_and_waits_a_window_behind(tmp_path, monkeypatch):
    calls = _record(monkeypatch)
    path = str(tmp_path / "a.pt")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        sink = BoundedWriteback(fd, step=2 * MIB, window=6 * MIB)
        for piece in _pieces():
            sink.write(piece)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert _read(path) == b"".join(_pieces())
    starts = [(a, n) for a, n, flags in calls if flags == 2]
    waits = [(a, n) for a, n, flags in calls if flags == 7]
    # Started in consecutive ranges from the start, each at least a step, none past the end.
    assert starts[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(starts))
    assert all(n >= 2 * MIB for _, n in starts)
    assert starts[-1][0] + starts[-1][1] <= os.path.getsize(path)
    # Waited for in consecutive ranges too, each ending a window behind the write-back
    # started at that moment: never more than a window of started bytes unfinished.
    assert waits and waits[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(waits))
    for offset, nbytes in waits:
        started = max(a + n for a, n, _ in calls[: calls.index((offset, nbytes, 7))])
        assert offset + nbytes == started - 6 * MIB


def _resident(path: str) -> list[bool]:
    """Which pages of the file are in the page cache now (``mincore`` of a mapping that is
    never touched: mapping a file loads nothing)."""
    size = os.path.getsize(path)
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
        anchor = ctypes.c_char.from_buffer(m)  # the mapping's address, without reading it
        try:
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
        finally:
            del anchor
    return [bool(b & 1) for b in vec]


def _drops_pages(directory: str) -> bool:
    """Whether this file system gives clean pages back on ``POSIX_FADV_DONTNEED`` (tmpfs
    does not: its pages are the file)."""
    probe = os.path.join(directory, "probe")
    with open(probe, "wb") as f:
        f.write(b"x" * (1 * MIB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dropped = not any(_resident(probe))
    os.unlink(probe)
    return dropped


@needs_sync_file_range
def test_what_the_disk_finished_leaves_the_page_cache(tmp_path):
    if not _drops_pages(str(tmp_path)):
        pytest.skip("this file system keeps its pages (tmpfs)")
    path = str(tmp_path / "c.pt")
    data = os.urandom(24 * MIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        sink = BoundedWriteback(fd, step=2 * MIB, window=8 * MIB)
        for start in range(0, len(data), MIB):
            sink.write(data[start : start + MIB])
        settled = sink.settled
        os.fsync(fd)
    finally:
        os.close(fd)
    page = os.sysconf("SC_PAGE_SIZE")
    resident = _resident(path)
    assert settled >= len(data) - 8 * MIB - 2 * MIB
    assert not any(resident[: settled // page])  # written back and dropped
    assert all(resident[-(8 * MIB) // page :])  # the last window: still cached
    assert _read(path) == data


@needs_sync_file_range
def test_a_file_system_that_refuses_it_still_gets_the_whole_file(tmp_path, monkeypatch):
    calls: list[int] = []

    def refusing(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(offset)
        ctypes.set_errno(errno.ENOSYS)  # as FUSE answers
        return -1

    monkeypatch.setattr(writeback, "_sync_file_range", refusing)
    path = str(tmp_path / "b.pt")
    _write(path)
    assert _read(path) == b"".join(_pieces())
    assert calls == [0]  # asked once, then left to the fsync


@needs_sync_file_range
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_an_io_error_while_waiting_fails_the_write_and_names_nothing(tmp_path, monkeypatch, code):
    """The wait consumes the error (a later fsync on the descriptor would not see it again),
    so it must fail the write itself: here the kernel's answer is stood in for, after the
    real call."""
    real = writeback._sync_file_range

    def failing_wait(fd: int, offset: int, nbytes: int, flags: int) -> int:
        real(fd, offset, nbytes, flags)
        if flags != 7:
            return 0
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(writeback, "_sync_file_range", failing_wait)
    monkeypatch.setattr(writeback, "WINDOW", MIN_WINDOW)
    monkeypatch.setattr(writeback, "STEP", 2 * MIB)
    data = memoryview(os.urandom(MIN_WINDOW + 8 * MIB))

    def produce(sink) -> None:
        for start in range(0, len(data), MIB):
            sink(data[start : start + MIB])

    path = str(tmp_path / "d.pt")
    with pytest.raises(OSError) as raised:
        FileBackend().write_stream(path, produce)
    assert raised.value.errno == code
    assert os.listdir(tmp_path) == []  # nothing named, no temp file left


_STRACED = textwrap.dedent(
    """
    import os, sys
    from ckptcache.storage import writeback
    from ckptcache.storage.fs import FileBackend
    writeback.STEP, writeback.WINDOW, writeback.MIN_WINDOW = 1 << 20, 4 << 20, 4 << 20
    piece = bytes(range(256)) * 4096  # 1 MiB
    def produce(sink):
        for _ in range(16):
            sink(memoryview(piece))
    FileBackend().write_stream(sys.argv[1], produce)
    """
)


@needs_sync_file_range
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_the_kernel_sees_write_back_then_one_fsync_the_name_and_the_directorys_fsync(tmp_path):
    """Counted by the kernel's own record of the calls (strace), on a real file system."""
    path = str(tmp_path / "e.pt")
    trace = str(tmp_path / "trace")
    calls = "fsync,fdatasync,sync_file_range,fadvise64,rename,renameat,renameat2,linkat"
    strace = ["strace", "-f", "-qq", "-o", trace, "-e", f"trace={calls}"]
    run = subprocess.run(
        [*strace, sys.executable, "-c", _STRACED, path],
        env={**os.environ, "PYTHONPATH": _ROOT, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert _read(path) == (bytes(range(256)) * 4096) * 16
    same = {"renameat": "rename", "renameat2": "rename", "fdatasync": "fsync"}
    with open(trace) as f:
        names = [line.split("(", 1)[0].split()[-1] for line in f if "(" in line]
    names = [same.get(n, n) for n in names]
    # Write-back started 16 times, waited for 12 times (16 MiB, a 4 MiB window), dropped
    # as often; then one fsync of the file, its name, the rename, one fsync of the directory.
    assert names.count("sync_file_range") == 16 + 12
    assert names.count("fadvise64") == 12
    rest = [n for n in names if n not in ("sync_file_range", "fadvise64")]
    assert rest == ["fsync", "linkat", "rename", "fsync"], rest
    assert names.index("fsync") > max(i for i, n in enumerate(names) if n == "sync_file_range")
