"""Persist throughput vs a raw write of the same bytes, and vs torch.save to the destination.

    python benchmarks/persist/bench.py --size 1GiB

Destinations: a local file (with fsync) and S3 on loopback (moto's server; needs moto[server]).
Every figure is measured in this run; file figures are medians of 5 interleaved rounds. The
persist time is the daemon's own (``status(path).persist_seconds``: first attempt to rename).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import (
    Row,
    best_of,
    format_table,
    make_state,
    mixed_state,
    running_daemon,
    running_s3,
)
from ckptcache.client import Client
from ckptcache.server.persist.persister import lower_thread_priority


def _sync_file_range() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_WRITEBACK_EVERY = 8 << 20  # as the daemon's file backend
_WINDOW = 128 << 20  # written bytes let wait in the page cache (bounded mode), as the daemon's
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


def raw_file_write(data: memoryview, path: str, *, mode: str = "every") -> None:
    """The physical limit: one sequential write of the bytes plus fsync. ``mode``:
    ``every`` starts the write-back of each 8 MiB as soon as it is written
    (``sync_file_range``: the disk works while the rest is copied into the page cache);
    ``bounded`` does that and also waits for the range 128 MiB behind and drops its pages
    from the page cache (the daemon's file backend since the bounded write-back); ``plain``
    leaves the whole write-back to the fsync (what most writers do). Written here, not
    through the daemon's code, so the same script measures any version of the daemon."""
    sync_range = _sync_file_range() if mode != "plain" else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at = 0
        while at < len(data):
            view = data[at : at + _WRITEBACK_EVERY]
            while view:
                view = view[os.write(fd, view) :]
            end = min(at + _WRITEBACK_EVERY, len(data))
            if sync_range is not None:
                sync_range(fd, at, end - at, _SYNC_FILE_RANGE_WRITE)
                if mode == "bounded" and end > _WINDOW:
                    behind = end - _WINDOW - _WRITEBACK_EVERY
                    sync_range(fd, max(behind, 0), _WRITEBACK_EVERY, _SYNC_FILE_RANGE_WAIT)
                    os.posix_fadvise(fd, max(behind, 0), _WRITEBACK_EVERY,
                                     os.POSIX_FADV_DONTNEED)  # fmt: skip
            at = end
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_file_write_direct(data: memoryview, path: str) -> None:
    """The same bytes with ``O_DIRECT`` (no copy into the page cache) + fsync: ``data`` must
    be page-aligned (an ``mmap``); 8 MiB writes, the last block padded then cut off by
    ``ftruncate``. Part of the limit: a direct persist could beat a buffered raw write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        whole = len(data) // 4096 * 4096
        at = 0
        while at < whole:
            at += os.write(fd, data[at : min(at + _WRITEBACK_EVERY, whole)])
        if whole < len(data):
            tail = mmap.mmap(-1, 4096)
            tail[: len(data) - whole] = data[whole:]
            os.write(fd, tail)
            os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_file_write_low(data: memoryview, path: str) -> None:
    """The bounded write from a thread at the daemon's persist priority (CPU nice +10,
    best-effort I/O class level 7): what the disk gives a writer that yields to training."""
    error: list[BaseException] = []

    def run() -> None:
        lower_thread_priority()
        try:
            raw_file_write(data, path, mode="bounded")
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]


def torch_save_synced(obj: object, path: str) -> None:
    """What a user would otherwise do: torch.save straight to the destination (+ fsync)."""
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def persist_seconds(client: Client, obj: object, path: str) -> float:
    client.save(obj, path)
    client.wait(path, timeout=600)
    seconds = client.status(path).persist_seconds
    client.delete(path)  # its segment becomes the next save's spare
    os.unlink(path)  # the disk holds one copy at a time
    return seconds


def durable_seconds(client: Client, obj: object, path: str) -> float:
    """From the save call until the daemon reports the bytes on storage (fsynced). The
    client has mapped the daemon's spare first (``warmup``), as a trainer has by its second
    checkpoint: the save is the copy, not the page faults of a new segment."""
    client.warmup(wait=True)
    t0 = time.perf_counter()
    client.save(obj, path)
    client.wait(path, timeout=600)
    seconds = time.perf_counter() - t0
    client.delete(path)
    os.unlink(path)
    return seconds


def bench_file(nbytes: int, directory: str, rounds: int = 5, shape: str = "few") -> list[Row]:
    """Raw write, torch.save and the daemon's persist, interleaved round by round (the disk's
    fsync speed drifts, so each round measures all three under the same conditions); medians.
    ``shape``: ``few`` (16 tensors) or ``mix`` (thousands, see ``mixed_state``)."""
    state = make_state(nbytes) if shape == "few" else mixed_state(nbytes)
    blob = io.BytesIO()
    torch.save(state, blob)
    data = blob.getbuffer()
    size = len(data)
    aligned = mmap.mmap(-1, size)  # page-aligned copy for the O_DIRECT raw write
    aligned[:] = data
    raw, plain, bounded, low, direct = [], [], [], [], []
    saved, persisted, durable = [], [], []
    # Room for two generations and a spare of this size (the state is deleted after each
    # measurement, so the budget never fills with persisted copies).
    daemon_args = ("--persist-root", directory, "--memory-limit", str(3 * size + (256 << 20)),
                   "--pool-segments", "1", "--pool-bytes", str(size + (64 << 20)))  # fmt: skip
    with running_daemon(*daemon_args) as d, Client(d.socket, fallback="raise") as c:
        c.save(state, os.path.join(directory, "sizing.pt"))  # sizes the daemon's spare pool
        c.wait(os.path.join(directory, "sizing.pt"), timeout=600)
        c.delete(os.path.join(directory, "sizing.pt"))
        os.unlink(os.path.join(directory, "sizing.pt"))
        for i in range(rounds):
            target = os.path.join(directory, f"raw{i}.bin")
            raw.append(best_of(1, lambda t=target: raw_file_write(data, t)))
            os.unlink(target)
            plain.append(best_of(1, lambda t=target: raw_file_write(data, t, mode="plain")))
            os.unlink(target)
            bounded.append(best_of(1, lambda t=target: raw_file_write(data, t, mode="bounded")))
            os.unlink(target)
            low.append(best_of(1, lambda t=target: raw_file_write_low(data, t)))
            os.unlink(target)
            view = memoryview(aligned)
            direct.append(best_of(1, lambda t=target, v=view: raw_file_write_direct(v, t)))
            view.release()
            os.unlink(target)
            target = os.path.join(directory, f"t{i}.pt")
            saved.append(best_of(1, lambda t=target: torch_save_synced(state, t)))
            os.unlink(target)
            persisted.append(persist_seconds(c, state, os.path.join(directory, f"p{i}.pt")))
            durable.append(durable_seconds(c, state, os.path.join(directory, f"d{i}.pt")))
    return [
        # The disk's speed drifts between moments: the limit is, per round, the fastest of
        # the five raw writes, buffered and O_DIRECT (a limit beaten by the persist would be
        # mis-measured: the persist writes with O_DIRECT where the file system takes it).
        Row(
            "raw write + fsync, fastest of the five below (limit)",
            size,
            statistics.median(map(min, raw, plain, bounded, low, direct)),
        ),
        Row("raw write with O_DIRECT (no page cache), fsync", size, statistics.median(direct)),
        Row("raw write, write-back every 8 MiB, fsync", size, statistics.median(raw)),
        Row("raw write + fsync, write-back at the fsync", size, statistics.median(plain)),
        Row("raw write, bounded write-back (128 MiB), fsync", size, statistics.median(bounded)),
        Row("raw write, bounded, at the persist's priority", size, statistics.median(low)),
        Row("torch.save to the file (+ fsync)", size, statistics.median(saved)),
        Row("ckptcache persist (daemon, verified, CRC-32)", size, statistics.median(persisted)),
        Row("ckptcache save until persisted (time to durable)", size, statistics.median(durable)),
    ]


def bench_s3(nbytes: int) -> list[Row]:
    from boto3.s3.transfer import TransferConfig

    with running_s3("bench") as (endpoint, s3):
        state = make_state(nbytes)
        blob = io.BytesIO()
        torch.save(state, blob)
        size = blob.getbuffer().nbytes
        cfg = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=4)

        def raw_upload() -> None:
            s3.upload_fileobj(io.BytesIO(blob.getbuffer()), "bench", "raw.bin", Config=cfg)

        rows = [Row("raw boto3 upload (limit)", size, best_of(2, raw_upload))]

        def torch_save_upload() -> None:
            buf = io.BytesIO()
            torch.save(state, buf)
            buf.seek(0)
            s3.upload_fileobj(buf, "bench", "t.pt", Config=cfg)

        rows.append(Row("torch.save + upload", size, best_of(2, torch_save_upload)))
        daemon_args = ("--persist-root", "s3://bench/", "--s3-endpoint-url", endpoint,
                       "--memory-limit", str(4 * size))  # fmt: skip
        with running_daemon(*daemon_args) as d, Client(d.socket, fallback="raise") as c:
            secs = min(persist_seconds(c, state, f"s3://bench/p{i}.pt") for i in range(2))
        rows.append(Row("ckptcache persist (daemon, multipart)", size, secs))
        return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--s3-size", default="256MiB", help="moto is slow: keep S3 runs small")
    p.add_argument(
        "--shape",
        choices=["few", "mix"],
        default="few",
        help="few: 16 tensors; mix: 75%% of bytes in 16 MiB tensors, the rest 64 KiB",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument(
        "--dir", default=None, help="destination directory (default: a temp dir on disk)"
    )
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="ckptcache-persist-", dir="/var/tmp")
    try:
        rows = bench_file(parse_bytes(args.size), directory, args.rounds, args.shape)
        print(f"\n### local file ({args.size}, {args.shape}, {directory})\n")
        print(format_table(rows, limit=rows[0]))
        if args.no_s3:
            return
        try:
            rows = bench_s3(parse_bytes(args.s3_size))
        except ImportError as e:
            print(f"\n(S3 skipped: {e})")
        else:
            print(f"\n### S3 on loopback ({args.s3_size}, moto server)\n")
            print(format_table(rows, limit=rows[0]))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    time.sleep(0)


if __name__ == "__main__":
    main()
