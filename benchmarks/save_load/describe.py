"""The save-plan cache's walk alone (``ckptcache.codec.plan.cache.describe``): microseconds per
tensor for the states of ``tensor_count.py`` and a MoE-like state, in one process, no daemon.

    python benchmarks/save_load/describe.py --rounds 9

The walk is the whole per-tensor cost of planning a repeated save (a plan-cache hit); this
isolates it from the copy and the round trips, whose noise on a shared machine hides it in a
whole save. Best of ``--rounds`` calls per state.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ckptcache.codec.plan.cache import describe


def states() -> dict[str, dict[str, torch.Tensor]]:
    """Flat states of small tensors (the walk's cost does not depend on the bytes)."""
    return {
        "mix (2,072 tensors)": {f"layers.{i}.w": torch.empty(16) for i in range(2072)},
        "many (8,288 tensors)": {f"layers.{i}.bias": torch.empty(16) for i in range(8288)},
        "moe (20,000 tensors)": {
            f"experts.{i // 8}.{i % 8}.w": torch.empty(4, 4) for i in range(20000)
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    print(f"torch {torch.__version__}, load {os.getloadavg()[0]:.2f}\n")
    print("| state | describe, best | per tensor |\n|---|---:|---:|")
    for name, state in states().items():
        assert describe(state) is not None  # the cached path, not the fallback
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            describe(state)
            best = min(best, time.perf_counter() - t0)
        print(f"| {name} | {best * 1e3:.1f} ms | {best / len(state) * 1e6:.2f} us |")


if __name__ == "__main__":
    main()
