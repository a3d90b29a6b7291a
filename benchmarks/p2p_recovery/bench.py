"""Checkpointless (peer-to-peer) recovery time vs state size, against its limit and alternatives.

    python benchmarks/p2p_recovery/bench.py --sizes-mib 64 256 1024

Two gloo ranks on this machine: rank 0 is a healthy replica, rank 1 a restarted one (fresh model,
empty Adam state). The *state* is parameters plus Adam's two moment buffers (so a third of it is
parameters), 75% of the parameter bytes in 8 MiB tensors and 25% in 64 KiB tensors. Every row is
the time until the recovering rank holds the state, measured in the same run:

* raw broadcast: one ``dist.broadcast`` of a contiguous tensor of the same size, into memory
  the receiver has touched before (the wire's limit) and into never-touched memory (the limit
  for a restarted process, whose optimizer state is new memory: the target's reference);
* ``PeerRecovery.recover``: feasibility exchange, plan, bucketed transfer into the receiver's
  tensors (materialising its optimizer state), digests hashed in flight and compared,
  optimizer load_state_dict;
* one broadcast per tensor: what recovery would cost without buckets (bytes moved only, into
  tensors that already exist, so it pays no first-touch page faults);
* ``torch.load`` of a file written by ``torch.save`` (in the page cache: a best case) plus
  ``load_state_dict`` into the fresh model and optimizer;
* ``ckptcache.load`` from the local daemon (private copy) plus ``load_state_dict``, when the
  daemon and client import (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ckptcache.recovery import PeerRecovery, training_state_dict

MiB = 1 << 20
BIG, SMALL = 8 * MiB, 64 * 1024


class Model(nn.Module):
    """Parameters only: the layout of a real model's state without its compute."""

    def __init__(self, param_bytes: int) -> None:
        super().__init__()
        big_bytes = param_bytes * 3 // 4
        sizes = [BIG // 4] * max(1, big_bytes // BIG)
        sizes += [SMALL // 4] * max(1, (param_bytes - sum(sizes) * 4) // SMALL)
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in sizes)


def build(param_bytes: int, *, trained: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Model(param_bytes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if trained:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
                p.grad = torch.randn_like(p)
        optimizer.step()  # materialises exp_avg / exp_avg_sq on the healthy replica
        model.zero_grad(set_to_none=True)
    return model, optimizer


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    state = training_state_dict(model, optimizer, step=0)
    total = 0
    for t in _tensors(state):
        total += t.numel() * t.element_size()
    return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def timed_collective(fn: Callable[[], object]) -> float:
    """Seconds from a common start until the slowest rank finished ``fn``."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure(
    rank: int, size: int, repeats: int, bucket_mib: int, tmp: str, cache_row: bool
) -> dict[str, float]:
    healthy = rank == 0
    model, optimizer = build(size // 3, trained=healthy)
    nbytes = state_bytes(model, optimizer) if healthy else 0
    results: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    for rep in range(repeats):
        flat = torch.empty(size, dtype=torch.uint8)
        flat.fill_(1)  # fault pages in: the limit should not pay first-touch costs
        add("raw", timed_collective(lambda flat=flat: dist.broadcast(flat, src=0)))
        del flat
        # What a restarted process really has: memory that is allocated but never touched.
        add("raw-fresh", timed_collective(lambda: dist.broadcast(_fresh(size, healthy), src=0)))
        # Alternate which goes first: the first after the raw rows pays for their freed memory.
        for digest in ("checksum", None)[:: 1 if rep % 2 else -1]:
            if not healthy:
                # A restarted process: fresh weights, empty optimizer state, every time.
                model, optimizer = build(size // 3, trained=False)
            recovery = PeerRecovery(bucket_bytes=bucket_mib * MiB, digest=digest)  # type: ignore[arg-type]

            def recover(
                recovery: PeerRecovery = recovery,
                model: nn.Module = model,
                optimizer: torch.optim.Optimizer = optimizer,
            ) -> None:
                result = recovery.recover(
                    model, optimizer, step=0 if healthy else None, recovering=not healthy
                )
                assert result.source == "peer", result.reason

            add(f"p2p digest={digest}", timed_collective(recover))
        tensors = _tensors(training_state_dict(model, optimizer, step=0))
        add(
            "per-tensor",
            timed_collective(lambda tensors=tensors: [dist.broadcast(t, src=0) for t in tensors]),
        )
    gc.collect()
    if healthy:
        path = os.path.join(tmp, "state.pt")
        torch.save(training_state_dict(model, optimizer, step=0), path)
        for _ in range(repeats):
            add("torch.load", _load_and_apply(size, lambda: torch.load(path, weights_only=True)))
        os.unlink(path)
        if cache_row:
            _cache_rows(size, model, optimizer, repeats, add)
    dist.barrier()
    out = {k: statistics.median(v) for k, v in results.items()}
    if nbytes:
        out["nbytes"] = nbytes
    return out


def _fresh(size: int, healthy: bool) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8)
    if healthy:
        buf.fill_(1)  # the sender's state exists already; only the receiver's memory is new
    return buf


def _load_and_apply(size: int, load: Callable[[], Any]) -> float:
    fresh, fresh_opt = build(size // 3, trained=False)
    gc.collect()
    t0 = time.perf_counter()
    state = load()
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    return time.perf_counter() - t0


def _cache_rows(
    size: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    repeats: int,
    add: Callable[[str, float], None],
) -> None:
    try:
        from ckptcache.cli.benchmarking import running_daemon
        from ckptcache.client import Client
    except ImportError as e:  # the daemon is not part of this checkout
        print(f"skipping the local-cache row: {e}", file=sys.stderr)
        return
    try:
        budget = str(3 * size + 256 * MiB)
        with (
            running_daemon("--memory-limit", budget, "--keep", "1") as daemon,
            Client(daemon.socket, fallback="raise") as client,
        ):
            path = os.path.join(tempfile.gettempdir(), "p2p-bench", "state.pt")
            client.save(training_state_dict(model, optimizer, step=0), path)
            for _ in range(repeats):
                add("cache", _load_and_apply(size, lambda: client.load(path, mmap=False)))
    except Exception as e:  # report, do not lose the other rows
        print(f"local-cache row failed: {e!r}", file=sys.stderr)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    try:
        rows = {
            size: measure(rank, size * MiB, args.repeats, args.bucket_mib, out, not args.no_cache)
            for size in args.sizes_mib
        }
        torch.save(rows, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


ROWS = [
    ("raw", "raw `dist.broadcast`, one contiguous tensor (limit)"),
    ("raw-fresh", "raw `dist.broadcast` into never-touched memory"),
    ("p2p digest=checksum", "`PeerRecovery.recover` (checksum digest)"),
    ("p2p digest=None", "`PeerRecovery.recover` (digest off)"),
    ("per-tensor", "one `dist.broadcast` per tensor, no buckets (tensors already touched)"),
    ("torch.load", "`torch.load` (page-cached file) + `load_state_dict`"),
    ("cache", "`ckptcache.load` from local daemon (private copy) + `load_state_dict`"),
]


def table(results: dict[int, dict[str, float]]) -> str:
    lines = [
        "| state | method | time (s) | GB/s | vs raw broadcast | vs raw into fresh memory |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for size, row in results.items():
        nbytes = row.get("nbytes", size * MiB)
        for key, label in ROWS:
            if key not in row:
                if key == "cache":
                    lines.append(f"| {size} MiB | {label} | n/a | | | |")
                continue
            s = row[key]
            lines.append(
                f"| {size} MiB | {label} | {s:.3f} | {nbytes / s / 1e9:.2f} | "
                f"{row['raw'] / s:.2f}x | {row['raw-fresh'] / s:.2f}x |"
            )
    return "\n".join(lines)


def targets(results: dict[int, dict[str, float]]) -> str:
    """The issue's targets: >= 0.8x raw-into-fresh and faster than torch.load, digests on."""
    lines = []
    for size, row in results.items():
        p2p = row["p2p digest=checksum"]
        vs_fresh = row["raw-fresh"] / p2p
        vs_load = row["torch.load"] / p2p if "torch.load" in row else float("nan")
        ok = vs_fresh >= 0.8 and vs_load > 1.0
        lines.append(
            f"{size} MiB: recovery (checksum) {vs_fresh:.2f}x raw-into-fresh (target >= 0.8x), "
            f"{vs_load:.2f}x torch.load's speed (target > 1x): {'met' if ok else 'NOT met'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument(
        "--no-cache", action="store_true", help="skip the ckptcache.load row (starts a daemon)"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(2, port, args, out), nprocs=2, start_method="spawn")
        r0 = torch.load(os.path.join(out, "rank0.pt"), weights_only=False)
        r1 = torch.load(os.path.join(out, "rank1.pt"), weights_only=False)
    merged = {size: {**r0[size], **r1[size]} for size in r0}
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo over loopback, "
        f"bucket {args.bucket_mib} MiB, median of {args.repeats}"
    )
    print(table(merged))
    print()
    print(targets(merged))


if __name__ == "__main__":
    main()
