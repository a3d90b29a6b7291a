"""The stall of ``Client.stage`` next to a copy into warm buffers and a copy into new ones.

    python benchmarks/frameworks/stage.py --mib 256 --rounds 10

The state is the DCP bench's (``bench._trained_state``: parameters and AdamW moments, 168
tensors). Each round, interleaved, after the daemon settled: a copy of every tensor into
buffers allocated once before the rounds (the limit: what a stager that keeps its buffers
pays), the same copy into buffers allocated in the round (what DCP's default stager does
at each ``async_save``), and ``Client.stage`` (given back at once). Medians and bests of the
rounds after two untimed ones, and the minor page faults each took (``getrusage``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

import bench
import torch


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of model state")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    tensors = bench.tensors_in(bench._trained_state(args.mib))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = tempfile.mkdtemp(prefix="ckptcache-bench-stage-")
    with bench.node(root, args.mib) as client:
        warm = [torch.empty_like(t) for t in tensors]

        def into_warm() -> None:
            for dst, src in zip(warm, tensors, strict=True):
                dst.copy_(src)

        def into_new() -> None:
            fresh = [torch.empty_like(t).copy_(t) for t in tensors]
            del fresh

        def stage() -> None:
            client.stage(tensors).release()

        rows: dict[str, tuple[Callable[[], None], list[float], list[int]]] = {
            "copy into warm buffers (limit)": (into_warm, [], []),
            "copy into new buffers (DCP's default stager)": (into_new, [], []),
            "Client.stage": (stage, [], []),
        }
        for i in range(args.rounds + 2):
            for fn, seconds, faults in rows.values():
                bench.settle(client)
                f0, t0 = _faults(), time.perf_counter()
                fn()
                if i >= 2:
                    seconds.append(time.perf_counter() - t0)
                    faults.append(_faults() - f0)
    print(f"{len(tensors)} tensors, {nbytes / 2**20:.0f} MiB, load {os.getloadavg()[0]:.2f}\n")
    print("| stall | median | best | minor faults (median) |\n|---|---:|---:|---:|")
    for name, (_, seconds, faults) in rows.items():
        med, best = statistics.median(seconds) * 1e3, min(seconds) * 1e3
        print(f"| {name} | {med:.1f} ms | {best:.1f} ms | {statistics.median(faults):.0f} |")


if __name__ == "__main__":
    main()
