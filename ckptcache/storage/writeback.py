"""Bounded write-back for local files: the disk starts at the first few MiB, at most a window of
written bytes waits in the page cache, and what the disk has finished is dropped from it.

A file written and left to the final ``fsync`` keeps every page dirty until then (far below
the kernel's background threshold, the kernel starts nothing by itself): the disk idles while
the bytes are copied, and the page cache grows by the file's size. Starting write-back every
few MiB (``sync_file_range(SYNC_FILE_RANGE_WRITE)``) keeps the disk busy but still grows the
page cache by the whole file. Here the writer also waits for the range a window behind it and
drops those clean pages (``POSIX_FADV_DONTNEED``), so the cache holds about one window of the
file and its pages are reused for the next ones: faster than either
(``benchmarks/persist/README.md``).

Durability is unchanged: none of this makes anything durable; the caller's ``fsync`` still
waits for every page and the metadata before anything is named. An I/O error seen while
waiting is raised at once (the wait consumes it: a later ``fsync`` on this descriptor would
not report it again).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

__all__ = ["STEP", "WINDOW", "BoundedWriteback", "background_threshold", "window_for"]

#: Bytes written between two starts of write-back: small steps keep the disk busy while the
#: writer goes on (benchmarks/persist/README.md has the figures).
STEP = 8 << 20
#: Written bytes let wait in the page cache, at most (the fastest window measured; see
#: benchmarks/persist/README.md).
WINDOW = 128 << 20
#: Never below this: the disk needs several steps queued to stay busy.
MIN_WINDOW = 4 * STEP

_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER
#: Answers that mean "not here" (FUSE, some network file systems), not a failed write.
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE})


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux: the fsync does all of it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load_sync_file_range()


def window_for(background_bytes: int | None, *, window: int | None = None) -> int:
    """Bytes a writer may leave in the page cache ahead of the disk: ``window`` (default
    :data:`WINDOW`), but at most an eighth of the kernel's background write-back threshold
    (a node with little memory gets a smaller window, one that several persists at once
    stay below), and never under :data:`MIN_WINDOW`. ``background_bytes`` None: unknown."""
    window = WINDOW if window is None else window
    if background_bytes is None or background_bytes <= 0:
        return window
    return max(MIN_WINDOW, min(window, background_bytes // 8))


def background_threshold() -> int | None:
    """The kernel's background write-back threshold in bytes now (``/proc/vmstat``), or None
    where it cannot be read. It follows ``vm.dirty_background_bytes``/``_ratio`` and the
    memory available, so it is read per file, not once."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"nr_dirty_background_threshold "):
                    return int(line.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    return None


def _check(result: int, what: str) -> bool:
    """True where the call worked, False where the file system has no such call; raises the
    I/O error otherwise (disk full, EIO) so the write fails as its ``fsync`` would."""
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, f"{what}: {os.strerror(code)}")


class BoundedWriteback:
    """Writes in order; every :data:`STEP` bytes starts the write-back of what it wrote, and
    once more than ``window`` bytes are started and not yet finished, waits for the oldest
    of them and drops those pages from the page cache. Where the file system refuses
    ``sync_file_range``, it writes plainly and the caller's ``fsync`` does all of it."""

    def __init__(self, fd: int, *, step: int | None = None, window: int | None = None):
        self.fd = fd
        self.step = STEP if step is None else step
        self.window = window_for(background_threshold()) if window is None else window
        self.offset = 0  # bytes written
        self.started = 0  # write-back started up to here
        self.settled = 0  # written back and dropped up to here
        self.enabled = _sync_file_range is not None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.offset += len(data)
        if self.enabled and self.offset - self.started >= self.step:
            self._start()
            if self.enabled and self.started - self.settled > self.window:
                self._settle(self.started - self.window)

    def _start(self) -> None:
        assert _sync_file_range is not None
        # ctypes drops the interpreter lock for the call: the hashing thread runs on.
        result = _sync_file_range(self.fd, self.started, self.offset - self.started, _WRITE)
        self.enabled = _check(result, "starting write-back")
        self.started = self.offset

    def _settle(self, end: int) -> None:
        """Wait until the write-back of ``[settled, end)`` has finished, then drop those pages
        (clean now: dropping them loses nothing)."""
        assert _sync_file_range is not None
        result = _sync_file_range(self.fd, self.settled, end - self.settled, _WAIT)
        self.enabled = _check(result, "waiting for write-back")
        if self.enabled:
            try:
                os.posix_fadvise(self.fd, self.settled, end - self.settled,
                                 os.POSIX_FADV_DONTNEED)  # fmt: skip
            except OSError:
                pass  # advice only: the pages stay cached, nothing is lost
        self.settled = end
