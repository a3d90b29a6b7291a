"""Step time of a small training loop that checkpoints every step: no checkpoint, blocking
``ckptcache.save``, and ``ckptcache.save(..., blocking=False)`` overlapped with forward and
backward (the copy must finish before the optimizer step), all in one run,
the modes taking turns step by step.

    python benchmarks/async_save/bench.py --width 2048 --layers 4 --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptcache.cli.benchmarking import memcpy_seconds, running_daemon
from ckptcache.client import Client
from ckptcache.codec.flatten import flatten
from ckptcache.recovery import StepGuard


def _model(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


class _Trainer:
    """One model and optimizer; ``save(state)`` (or None) runs at the start of every step."""

    def __init__(self, args: argparse.Namespace, save: Callable[[dict], object] | None):
        self.model, self.opt = _model(args.width, args.layers)
        self.x = torch.randn(args.batch, args.width)
        self.save = save
        self.guard = StepGuard()
        self.times: list[float] = []
        self.steps = 0

    def step(self) -> None:
        t0 = time.perf_counter()
        if self.save is not None:
            self.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()})
        self.model(self.x).square().mean().backward()
        with self.guard.optimizer_step():  # waits for a non-blocking save's copy
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        if self.steps:  # the first step creates Adam's state: not timed
            self.times.append(time.perf_counter() - t0)
        self.steps += 1


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
    # The bytes a save copies (each storage once), for the memcpy limit.
    tensors = {
        str(i): torch.empty(0, dtype=torch.uint8).set_(s)
        for i, s in enumerate(flatten(state).storages)
    }
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
        handles: list[Any] = []

        def non_blocking(s: dict) -> None:
            if handles:
                handles.pop().wait()  # the previous save's commit (and its error, if any)
            handles.append(c.save(s, path + ".async", blocking=False))

        trainers = {
            "no checkpoint": _Trainer(args, None),
            "blocking save every step": _Trainer(args, lambda s: c.save(s, path)),
            "non-blocking save every step": _Trainer(args, non_blocking),
        }
        # Modes take turns, one step each, so the machine's load drifts over all alike.
        for _ in range(args.steps + 1):
            for trainer in trainers.values():
                trainer.step()
        handles.pop().wait()
        med = {name: statistics.median(t.times) for name, t in trainers.items()}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; checkpoint {nbytes / 2**20:.0f} MiB, "
          f"memcpy {memcpy:.4f} s\n")  # fmt: skip
    print("| loop | step time (s) | vs no checkpoint |")
    print("|---|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t:.4f} | {t / med['no checkpoint']:.2f}x |")


if __name__ == "__main__":
    main()
