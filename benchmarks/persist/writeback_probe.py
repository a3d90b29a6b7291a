"""The write alone: ways to start the kernel's write-back of one large file, interleaved.

    python benchmarks/persist/writeback_probe.py --size 2GiB --rounds 3 \\
        --modes none,every,cap:1024,window:256,drop:32,drop:128,drop:512

Each round writes random bytes in 8 MiB writes and fsyncs, once per mode (the page cache is
synced and settled for a second before each write). Modes: ``none`` (all left to the fsync),
``every`` (``sync_file_range`` start after each 8 MiB, the daemon's old way), ``cap:N`` (as
``every`` for the first N MiB, then left to the kernel: an early write-back that stops),
``window:N`` (as ``every``, and wait for the range N MiB behind), ``drop:N`` (as
``window:N``, and drop the waited-for pages from the page cache: the daemon's way now, with
N = 128). Prints each write's total, the time to the last ``write`` returning, and medians.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time

import numpy as np

from ckptcache._units import parse_bytes

MIB = 1 << 20
STEP = 8 * MIB
_WRITE, _WAIT = 2, 1 | 2 | 4


def _sync_file_range() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def write(data: memoryview, path: str, mode: str) -> tuple[float, float]:
    """(total seconds with the fsync, seconds to the last write returning)."""
    sfr = _sync_file_range()
    kind, _, arg = mode.partition(":")
    behind = int(arg) * MIB if arg else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    at = started = done = 0
    while at < len(data):
        view = data[at : at + STEP]
        while view:
            view = view[os.write(fd, view) :]
        at = min(at + STEP, len(data))
        if kind == "every" or (kind == "cap" and at <= behind) or kind in ("window", "drop"):
            sfr(fd, started, at - started, _WRITE)
            started = at
        if kind in ("window", "drop") and at - behind > done:
            sfr(fd, done, at - behind - done, _WAIT)
            if kind == "drop":
                os.posix_fadvise(fd, done, at - behind - done, os.POSIX_FADV_DONTNEED)
            done = at - behind
    written = time.perf_counter() - t0
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0, written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="none,every,drop:128")
    p.add_argument("--dir", default="/var/tmp")
    args = p.parse_args()
    size, modes = parse_bytes(args.size), args.modes.split(",")
    data = memoryview(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).data)
    totals: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            os.sync()
            time.sleep(1)
            fd, path = tempfile.mkstemp(dir=args.dir, prefix="ckptcache-probe-")
            os.close(fd)
            try:
                total, written = write(data, path, mode)
            finally:
                os.unlink(path)
            totals[mode].append(total)
            print(f"round {r} {mode:12s} total {total:.2f} s (write {written:.2f} s)", flush=True)
    for mode in modes:
        runs = ", ".join(f"{t:.2f}" for t in totals[mode])
        print(f"{mode:12s} median {statistics.median(totals[mode]):.2f} s ({runs})")


if __name__ == "__main__":
    main()
