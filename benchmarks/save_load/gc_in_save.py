"""Cyclic garbage collections inside a save, in a process with a trainer's heap.

    python benchmarks/save_load/gc_in_save.py --heap 2000000 --saves 12

A trainer's process holds millions of Python objects (modules, configs, a framework's
bookkeeping). CPython's collector runs when enough new objects were made since the last run,
and now and then scans the whole heap. A save of a state of thousands of tensors makes tens of
thousands of short-lived tuples (its plan), and the collections they set off land inside the
save. This keeps ``--heap`` objects alive (small dicts in a list), then saves the ``mix``
state (2,072 tensors at 512 MiB) to a real daemon: the first save of the process (a plan-cache
miss), then ``--saves`` saves of new paths (the plan reused), each waited for the daemon to be
idle. It reports, over all saves, the collections that ran while ``save`` did (by
``gc.callbacks``), their generations and time, and the saves' stalls.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

from ckptcache._units import format_bytes, parse_bytes
from ckptcache.cli.bench import wait_idle
from ckptcache.cli.benchmarking import mixed_state, running_daemon
from ckptcache.client import Client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--heap", type=int, default=2_000_000, help="objects kept alive")
    p.add_argument("--saves", type=int, default=12)
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    state = mixed_state(nbytes)
    heap = [{"i": i} for i in range(args.heap)]  # a trainer's long-lived objects
    gc.collect()
    inside = [False]
    runs: list[tuple[int, float]] = []  # (generation, seconds) of collections inside a save
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if not inside[0]:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            runs.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(watch)
    root = tempfile.mkdtemp(prefix="ckptcache-gc-")
    stalls: list[float] = []
    budget = str(4 * nbytes + (512 << 20))
    with (
        running_daemon("--memory-limit", budget, "--keep", "1") as d,
        Client(d.socket, fallback="raise") as c,
    ):
        c.warmup(wait=True)
        for i in range(args.saves + 1):
            path = os.path.join(root, f"iter_{i}", "model.pt")
            inside[0] = True
            t0 = time.perf_counter()
            c.save(state, path, durability="memory")
            stalls.append(time.perf_counter() - t0)
            inside[0] = False
            wait_idle(c, path)
            if i:
                c.delete(os.path.join(root, f"iter_{i - 1}", "model.pt"))
    gc.callbacks.remove(watch)
    per_gen = {g: [s for gg, s in runs if gg == g] for g in (0, 1, 2)}
    print(
        f"{format_bytes(nbytes)}, 2,072 tensors, heap {len(heap):,} objects, "
        f"{args.saves + 1} saves, load average {os.getloadavg()[0]:.2f}"
    )
    print("| | gen 0 | gen 1 | gen 2 | first save | later saves, median | later saves, max |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    cells = [f"{len(v)} ({sum(v) * 1e3:.1f} ms)" for v in per_gen.values()]
    later = stalls[1:]
    print(
        f"| collections inside saves (time) | {' | '.join(cells)} | {stalls[0] * 1e3:.1f} ms | "
        f"{statistics.median(later) * 1e3:.1f} ms | {max(later) * 1e3:.1f} ms |"
    )


if __name__ == "__main__":
    main()
