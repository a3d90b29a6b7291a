"""Run a function on N gloo ranks in spawned processes (the DCP ``with_comms`` pattern).

Each rank's return value is saved to a file and handed back to the test, which asserts on it:
assertions in the parent get pytest's rewriting and a clean report.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    backend: str,
    args: tuple[Any, ...],
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank: the ranks share two cores, and fixed thread counts keep
    # CPU kernels bitwise reproducible between the reference and the recovered run.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Tear down together: a rank closing its gloo connections while a peer's background
        # threads still use them can abort that peer at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 90.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results."""
    # A forkserver that has imported torch once forks each rank in milliseconds; spawning
    # would re-import torch in every rank of every test (seconds each on two cores).
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "_recovery_workers"])
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, backend, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:  # only the processes this call started
                    if proc.is_alive():
                        proc.kill()
                raise TimeoutError(f"ranks did not finish within {timeout} s")
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
