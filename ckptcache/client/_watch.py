"""Which pages of this process's memory were written: the kernel's own record, not a counter.

A range is watched through ``userfaultfd`` write protection in asynchronous mode
(``UFFD_FEATURE_WP_ASYNC``, Linux 6.7): the first write to a protected page, from user space
or by the kernel on the process's behalf (``read()``, ``process_vm_writev``, ``/proc/pid/mem``),
lifts the page's protection in the kernel, with no signal and no thread of ours woken. A
``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap`` then lists the pages written since and
protects them again, in one call (``PM_SCAN_WP_MATCHING``).

This module answers only with what the kernel proves:

* only private anonymous memory is watched: a file's pages or a shared mapping may be written
  by another process through its own page tables;
* a page dropped without a write (``MADV_DONTNEED``, which reads back zeros) is reported as
  written by the next scan (the kernel leaves no protected entry behind); a page swapped out
  keeps its protection;
* a range no longer registered (unmapped and mapped anew) fails the scan (``EPERM``,
  ``PM_SCAN_CHECK_WPASYNC``): all of it counts as written, as any error does.

What it cannot see at all, and callers must not watch: memory a device writes by DMA without
the CPU's page tables (CUDA host-registered or RDMA-registered buffers).

The scan asks only for written pages: the kernel then reads the page-table entries alone,
where asking whether pages are present or a file's costs a look at every page
(``benchmarks/incremental/README.md``). A save's scans of all its watched ranges are one call
into the scan extension (``_pagescan.c``) where it is built, a loop here otherwise.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import struct
import threading

import numpy as np

__all__ = ["PAGE", "SCAN_IMPLEMENTATION", "WriteWatch", "edges_equal", "interior"]

PAGE = os.sysconf("SC_PAGE_SIZE")

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFD_USER_MODE_ONLY = 1  # unprivileged processes may only open this kind
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_REGISTER_MODE_WP = 1 << 1


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


def _ior(kind: int, nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ior(0xAA, 0x01, 16)
_PM_SCAN_ARG = struct.Struct("12Q")
_PAGEMAP_SCAN = _iowr(ord("f"), 16, _PM_SCAN_ARG.size)
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 64


def _extension() -> ctypes.CDLL | None:
    try:
        import ckptcache.client._pagescan as _pagescan
    except ImportError:  # not built here (no C compiler at install): the loop in Python
        return None
    lib = ctypes.CDLL(_pagescan.__file__)
    lib.ckptcache_scan_written.argtypes = [
        ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p
    ]  # fmt: skip
    lib.ckptcache_scan_written.restype = ctypes.c_int
    lib.ckptcache_edges_equal.argtypes = [
        ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64
    ]  # fmt: skip
    lib.ckptcache_edges_equal.restype = None
    return lib


_LIB = _extension()
#: Which loops :meth:`WriteWatch.written_many` and :func:`edges_equal` run: ``extension``
#: or ``python``.
SCAN_IMPLEMENTATION = "python" if _LIB is None else "extension"
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def interior(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages of the ``nbytes`` at ``address``: the part of a storage that is
    watched (its partial first and last pages may be shared with other allocations)."""
    return -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE


def edges_equal(rows: list[tuple[int, int, int]]) -> list[bool]:
    """For each ``(held, address, nbytes)``: whether the storage of ``nbytes`` at ``address``
    has the bytes at ``held`` (an address in a mapping of at least ``nbytes``) on its partial
    first and last pages, the bytes outside its page-aligned interior."""
    if not rows:
        return []
    if _LIB is None:
        return [_edges_equal(*row) for row in rows]
    table = np.array(rows, dtype=np.uint64)
    out = np.zeros(len(rows), dtype=np.uint8)
    _LIB.ckptcache_edges_equal(len(rows), table.ctypes.data, out.ctypes.data, PAGE)
    return out.astype(bool).tolist()


def _edges_equal(held: int, address: int, nbytes: int) -> bool:
    start, end = interior(address, nbytes)
    head, tail = start - address, address + nbytes - end
    return _memcmp(held, address, head) == 0 and _memcmp(held + nbytes - tail, end, tail) == 0


class WriteWatch:
    """Write protection of page ranges of this process, and scans of what was written since.

    Methods are thread-safe; ranges must be page-aligned. :meth:`open` returns ``None`` where
    the kernel lacks the feature or the process may not use it (a container's seccomp
    profile, ``vm.unprivileged_userfaultfd`` for a process that needs kernel faults)."""

    def __init__(self, uffd: int, pagemap: int):
        self._uffd, self._pagemap = uffd, pagemap
        self._vec = (ctypes.c_uint64 * (3 * _REGIONS))()
        self._lock = threading.Lock()

    @classmethod
    def open(cls) -> WriteWatch | None:
        """A watch, or ``None`` where this kernel or process cannot have one."""
        if _NR_USERFAULTFD is None:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        flags = os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY
        uffd = libc.syscall(_NR_USERFAULTFD, flags)
        if uffd < 0:
            return None
        try:
            api = bytearray(struct.pack("QQQ", _UFFD_API, _UFFD_FEATURE_WP_ASYNC, 0))
            fcntl.ioctl(uffd, _UFFDIO_API, api)
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(uffd)
            return None
        watch = cls(uffd, pagemap)
        try:  # PAGEMAP_SCAN exists (Linux 6.7): an empty scan of no range
            watch.written_or_raise(0, 0)
        except OSError as e:
            if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                watch.close()
                return None
        return watch

    def watch(self, ranges: list[tuple[int, int]]) -> list[bool]:
        """Register each ``(start, end)`` for write protection (its pages are protected by the
        next :meth:`written` of the range, which reports them all as written); ``False`` for a
        range that is not all private anonymous memory, or that the kernel refuses (a
        registration of someone else's)."""
        private = _private_anonymous(ranges)
        done = []
        with self._lock:
            for (start, end), ok in zip(ranges, private, strict=True):
                if ok:
                    arg = struct.pack("QQQQ", start, end - start, _UFFDIO_REGISTER_MODE_WP, 0)
                    try:
                        fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, bytearray(arg))
                    except OSError:
                        ok = False
                done.append(ok)
        return done

    def unwatch(self, start: int, end: int) -> None:
        """Stop watching ``[start, end)`` (best effort: the range may be gone)."""
        with self._lock, contextlib.suppress(OSError):
            arg = bytearray(struct.pack("QQ", start, end - start))
            fcntl.ioctl(self._uffd, _UFFDIO_UNREGISTER, arg)

    def written(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """The ranges of ``[start, end)`` written since the last scan of them, protected
        again as they are reported; ``None`` where the scan failed (a page no longer
        registered: all of it counts as written)."""
        try:
            return self.written_or_raise(start, end)
        except OSError:
            return None

    def written_many(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
        """:meth:`written` of each ``(start, end)``, as one span per range: the lowest start
        and highest end of the pages found written (``(0, 0)``: none), or ``None`` where
        the scan failed (all of it counts as written)."""
        if not ranges:
            return []
        with self._lock:
            if _LIB is None:
                return [self._span_or_none(start, end) for start, end in ranges]
            table = np.array(ranges, dtype=np.uint64)
            out = np.zeros((len(ranges), 3), dtype=np.uint64)
            _LIB.ckptcache_scan_written(self._pagemap, len(ranges), table.ctypes.data,
                                        out.ctypes.data)  # fmt: skip
            return [None if status else (lo, hi) for status, lo, hi in out.tolist()]

    def _span_or_none(self, start: int, end: int) -> tuple[int, int] | None:
        try:
            found = self._scan(start, end)
        except OSError:
            return None
        return (min(s for s, _ in found), max(e for _, e in found)) if found else (0, 0)

    def written_or_raise(self, start: int, end: int) -> list[tuple[int, int]]:
        """:meth:`written`, raising the scan's ``OSError``."""
        with self._lock:
            return self._scan(start, end)

    def _scan(self, start: int, end: int) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        vec = self._vec
        flags = _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC
        while True:
            arg = bytearray(
                _PM_SCAN_ARG.pack(
                    _PM_SCAN_ARG.size, flags, start, end, 0, ctypes.addressof(vec), _REGIONS, 0,
                    0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN,
                )
            )  # fmt: skip
            n = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            found.extend((vec[3 * i], vec[3 * i + 1]) for i in range(n))
            walk_end = _PM_SCAN_ARG.unpack(arg)[4]
            if walk_end >= end or walk_end <= start:
                return found
            start = walk_end  # the regions' table was full: go on from where the walk stopped

    def close(self) -> None:
        """Stop every watch (the kernel lifts the protections with the descriptor's last
        reference: a forked child closing its copies leaves the parent's watch alone)."""
        with self._lock:
            for fd in (self._uffd, self._pagemap):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._uffd = self._pagemap = -1


def _private_anonymous(ranges: list[tuple[int, int]]) -> list[bool]:
    """Whether each range lies in private anonymous mappings only (``/proc/self/maps``, read
    once): no file's pages, and no mapping another process shares.

    A process whose storages are watched has a mapping per watched storage (a registration
    splits its mapping), often a thousand lines: only the lines that cover a range are
    parsed whole, found by their start address (the kernel lists mappings in order)."""
    if not ranges:
        return []
    with open("/proc/self/maps", "rb") as f:
        lines = f.read().splitlines()
    starts = [int(line[: line.index(b"-")], 16) for line in lines]
    found = []
    for start, end in ranges:
        i = bisect.bisect_right(starts, start) - 1
        at = start
        while 0 <= i < len(lines):
            span = _private_anonymous_span(lines[i])
            if span is None or not span[0] <= at < span[1]:
                break
            at = span[1]
            if at >= end:
                break
            i += 1
        found.append(at >= end)
    return found


def _private_anonymous_span(line: bytes) -> tuple[int, int] | None:
    """The addresses of a ``/proc/self/maps`` line's mapping if it is private and
    anonymous (``None`` if shared, or a file's)."""
    fields = line.split(None, 5)
    name = fields[5].strip() if len(fields) > 5 else b""
    if fields[1][3:4] != b"p" or fields[4] != b"0":
        return None
    if name and not (name in (b"[heap]", b"[stack]") or name.startswith(b"[anon:")):
        return None
    lo, hi = fields[0].split(b"-")
    return int(lo, 16), int(hi, 16)
