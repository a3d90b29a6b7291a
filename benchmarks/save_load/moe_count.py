"""A fine-grained mixture-of-experts state (tens of thousands of small tensors): a repeated
save's stall against a memcpy of the same tensors, with its plan key walked in C++ and in
Python, and a zero-copy load per tensor with its dense tensors made by the C++ loop and by
numpy; each pair alternated round by round (which goes first alternates too) in one process
against one daemon.

    python benchmarks/save_load/moe_count.py --size 512MiB --tensors 50000 --rounds 7

The state: float32 tensors of equal size in nested dicts, ``layers.L`` / ``experts.E`` /
``w1``, ``w2`` (as ``benchmarks/peers/states.py``'s ``moe`` shapes). Every load is compared
with the saved state byte for byte (outside the timing).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from ckptcache._units import parse_bytes
from ckptcache.cli.bench import wait_idle
from ckptcache.cli.benchmarking import memcpy_seconds, running_daemon
from ckptcache.client import Client
from ckptcache.codec.plan import walk as plan_walk
from ckptcache.codec.table import tensors as table_tensors


def make_moe(nbytes: int, n_tensors: int) -> dict[str, Any]:
    """``n_tensors`` float32 tensors of about ``nbytes`` in all: 100 layers of experts with
    two weights each (a seeded value per tensor)."""
    layers = 100
    experts = max(1, n_tensors // layers // 2)
    numel = max(1, nbytes // (layers * experts * 2) // 4)
    g = torch.Generator().manual_seed(0)
    return {
        f"layers.{layer}": {
            f"experts.{e}": {w: torch.randn(numel, generator=g) for w in ("w1", "w2")}
            for e in range(experts)
        }
        for layer in range(layers)
    }


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of the nested state, by dotted key."""
    return {
        f"{layer}.{expert}.{w}": t
        for layer, experts in state.items()
        for expert, weights in experts.items()
        for w, t in weights.items()
    }


def same(loaded: dict[str, Any], saved: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor loaded has the saved one's dtype, shape and bytes."""
    got = flat(loaded)
    return got.keys() == saved.keys() and all(
        got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)
        for k, v in saved.items()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    state = make_moe(nbytes, args.tensors)
    saved = flat(state)
    n = len(saved)
    compiled = table_tensors._compiled
    paths = {"C++": compiled, "numpy": None} if compiled is not None else {"numpy": None}
    walker = plan_walk.COMPILED
    walks = {"C++": walker, "Python": None} if walker is not None else {"Python": None}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{n:,} tensors, {args.size}, load paths: {', '.join(paths)}, "
          f"walks: {', '.join(walks)}")  # fmt: skip
    memcpys: list[float] = []
    stalls: dict[str, list[float]] = {name: [] for name in walks}
    loads: dict[str, list[float]] = {name: [] for name in paths}
    args_ = ("--memory-limit", str(4 * nbytes + (512 << 20)), "--keep", "1")
    with tempfile.TemporaryDirectory() as root, running_daemon(*args_) as daemon:
        path = os.path.join(root, "moe.pt")
        with Client(daemon.socket, fallback="raise") as c:
            for name in walks:  # each walk's plan and the spare in place: the saves repeat
                plan_walk.COMPILED = walks[name]
                for _ in range(2):
                    c.save(state, path)
                    wait_idle(c, path)
            plan_walk.COMPILED = walker
            for r in range(args.rounds):
                memcpys.append(memcpy_seconds(saved))
                for name in list(walks) if r % 2 == 0 else list(reversed(walks)):
                    plan_walk.COMPILED = walks[name]
                    try:
                        t0 = time.perf_counter()
                        c.save(state, path)
                        stalls[name].append(time.perf_counter() - t0)
                    finally:
                        plan_walk.COMPILED = walker
                    wait_idle(c, path)
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for name in order:
                    table_tensors._compiled = paths[name]
                    try:
                        t0 = time.perf_counter()
                        loaded = c.load(path)
                        loads[name].append(time.perf_counter() - t0)
                    finally:
                        table_tensors._compiled = compiled
                    assert same(loaded, saved), f"a load by {name} differs from the save"
                    del loaded
                    gc.collect()
    mc = min(memcpys)
    print(f"\nload average (1 min) after the run: {os.getloadavg()[0]:.2f}\n")
    print(f"| {n:,} tensors, {args.size} | best | median | per tensor (median) |")
    print("|---|---:|---:|---:|")
    print(f"| memcpy (limit) | {mc * 1e3:.1f} ms | {statistics.median(memcpys) * 1e3:.1f} ms | |")
    mm = statistics.median(memcpys)
    for name, secs in stalls.items():
        best, med = min(secs), statistics.median(secs)
        print(f"| repeated save (stall), walk by {name} | {best * 1e3:.1f} ms ({best / mc:.2f}x) "
              f"| {med * 1e3:.1f} ms ({med / mm:.2f}x) | {(med - mm) / n * 1e6:.2f} us above "
              "the copy |")  # fmt: skip
    for name, secs in stalls.items():
        each = ", ".join(f"{s / m:.2f}" for s, m in zip(secs, memcpys, strict=True))
        print(f"each round, walk by {name} (x that round's memcpy): {each}")
    for name, secs in loads.items():
        best, med = min(secs), statistics.median(secs)
        print(f"| zero-copy load, dense tensors by {name} | {best * 1e3:.1f} ms | "
              f"{med * 1e3:.1f} ms | {med / n * 1e6:.2f} us |")  # fmt: skip


if __name__ == "__main__":
    main()
