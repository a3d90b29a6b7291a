"""Step time of a small training loop that checkpoints every step: no checkpoint, blocking
``ckptcache.save``, and ``ckptcache.save(..., blocking=False)`` overlapped with forward and
backward (the copy must finish before the optimizer step), all in one run.

    python benchmarks/async_save/bench.py --width 2048 --layers 4 --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from ckptcache.benchmarking import memcpy_seconds, running_daemon
from ckptcache.client import Client
from ckptcache.recovery import StepGuard


def _model(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _loop(
    width: int, layers: int, batch: int, steps: int, save: Callable[[dict, int], object] | None
) -> float:
    """Median seconds per step; ``save(state, step)`` returns a handle or None."""
    model, opt = _model(width, layers)
    guard = StepGuard()
    x = torch.randn(batch, width)
    times = []
    for step in range(steps + 1):  # the first step warms Adam's state up: not timed
        t0 = time.perf_counter()
        if save is not None:
            save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step)
        model(x).square().mean().backward()
        with guard.optimizer_step():  # waits for a non-blocking save's copy
            opt.step()
            opt.zero_grad(set_to_none=False)
        if step:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    model, opt = _model(args.width, args.layers)
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    tensors = {f"{i}": t for i, t in enumerate(_tensors(state))}
    nbytes = sum(t.nbytes for t in tensors.values())
    memcpy = memcpy_seconds(tensors)
    budget = str(4 * nbytes + (64 << 20))
    with (
        running_daemon("--memory-limit", budget, "--keep", "1") as daemon,
        Client(daemon.socket, fallback="raise") as c,
        tempfile.TemporaryDirectory() as tmp,
    ):
        path = os.path.join(tmp, "model.pt")
        c.warmup(wait=True)
        run = (args.width, args.layers, args.batch, args.steps)
        none = _loop(*run, None)
        blocking = _loop(*run, lambda s, i: c.save(s, path))
        handles: list[object] = []

        def non_blocking(s: dict, i: int) -> None:
            if handles:
                handles.pop().wait()  # type: ignore[attr-defined]  # previous commit
            handles.append(c.save(s, path, blocking=False))

        async_ = _loop(*run, non_blocking)
        handles.pop().wait()  # type: ignore[attr-defined]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; checkpoint {nbytes / 2**20:.0f} MiB, "
          f"memcpy {memcpy:.4f} s\n")  # fmt: skip
    print("| loop | step time (s) | vs no checkpoint |")
    print("|---|---:|---:|")
    for name, t in (("no checkpoint", none), ("blocking save every step", blocking),
                    ("non-blocking save every step", async_)):  # fmt: skip
        print(f"| {name} | {t:.4f} | {t / none:.2f}x |")


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
