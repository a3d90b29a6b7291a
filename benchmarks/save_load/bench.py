"""Save stall and load time of ckptcache vs memcpy and torch.save/torch.load, in one run.

    python benchmarks/save_load/bench.py --sizes 256MiB 1GiB 2GiB

For each size a fresh daemon (keep=1) is started; every figure is measured in this process.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch

from ckptcache._units import parse_bytes
from ckptcache.cli.bench import load_stalls, save_stalls
from ckptcache.cli.benchmarking import (
    Row,
    format_table,
    make_state,
    memcpy_seconds,
    running_daemon,
    torch_baselines,
)
from ckptcache.client import Client


def measure(nbytes: int, file_dir: str, repeats: int) -> list[Row]:
    state = make_state(nbytes)
    rows = [Row("memcpy (physical limit)", nbytes, memcpy_seconds(state))]
    budget = f"{3 * nbytes + (64 << 20)}"
    pool = ("--pool-segments", "1", "--pool-bytes", str(nbytes + (16 << 20)))
    daemon_args = ("--memory-limit", budget, "--keep", "1", *pool)
    with running_daemon(*daemon_args) as daemon, Client(daemon.socket, fallback="raise") as c:
        c.warmup(wait=True)  # what a trainer does at start: the spare segment gets mapped
        path = os.path.join(file_dir, "bench", "model.pt")
        first, repeated = save_stalls(c, state, path, repeats)
        rows.append(Row("ckptcache.save, first (new path, spare segment)", nbytes, first))
        rows.append(Row("ckptcache.save, repeated", nbytes, repeated))
        zero_copy, private, matched = load_stalls(c, path, state, repeats)
        assert matched, "reloaded bytes differ"
        rows.append(Row("ckptcache.load, zero-copy", nbytes, zero_copy))
        rows.append(Row("ckptcache.load, private copy", nbytes, private))
    # The same first save against a daemon without a spare pool: what the pool saves.
    no_pool = ("--memory-limit", budget, "--keep", "1", "--pool-bytes", "0")
    with running_daemon(*no_pool) as daemon, Client(daemon.socket, fallback="raise") as c:
        first, _ = save_stalls(c, state, os.path.join(file_dir, "bench", "new.pt"), 0)
        rows.insert(2, Row("ckptcache.save, first (new path, --pool-bytes 0)", nbytes, first))
    gc.collect()
    rows += torch_baselines(state, nbytes, {"/dev/shm": "/dev/shm", "local file": file_dir})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["256MiB", "1GiB", "2GiB"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--file-dir", default=tempfile.gettempdir(), help="directory on local disk")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    for size in args.sizes:
        nbytes = parse_bytes(size)
        rows = measure(nbytes, args.file_dir, args.repeats)
        print(f"\n### {size}\n")
        print(format_table(rows, limit=rows[0]))
        by = {r.what: r for r in rows}
        stall = by["ckptcache.save, repeated"].seconds
        speedup = by["torch.save to local file"].seconds / stall
        print(f"\nrepeated save vs torch.save to a local file: {speedup:.1f}x faster")
        gc.collect()


if __name__ == "__main__":
    main()
