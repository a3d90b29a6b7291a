"""Launch ``fn(rank, world, *args)`` on ``world`` CPU ranks with gloo, torchrun-style env."""

from __future__ import annotations

import importlib
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

#: What a DeepSpeed rank imports on its way to a trained engine: DeepSpeed, and the modules
#: ``deepspeed.initialize`` imports lazily (its optimizer checks import the Muon optimizer,
#: whose ``torch.compile`` decorator imports dynamo and inductor: seconds per rank).
DEEPSPEED = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer")
#: What a rank of megatron_worker.py imports: the adapter imports megatron-core's
#: dist_checkpointing strategies in every mode.
MEGATRON = ("megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.torch")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    fn(rank, world, *args)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nobody leaves while a peer is still in a collective
    # Skip interpreter teardown: DeepSpeed's CPU shared-memory comm op (where it is built) leaves
    # a joinable C++ thread behind that aborts the process at exit ("terminate called without an
    # active exception") now and then. Every result is already written to disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def deepspeed_without_compiled_ops() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory collective op (``deepspeed_shm_comm``).

    ``init_distributed`` builds it with a C++ compiler on first use (minutes on a busy machine);
    gloo does the same job for these tiny models. DeepSpeed caches its op probe in a module dict
    that it documents as editable, so marking the op incompatible there is enough. The
    optimizers are configured with ``torch_adam`` so that no CPU Adam op is built either.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def launch(fn: Callable[..., Any], world: int, *args: Any, preload: tuple[str, ...] = ()) -> None:
    """Run ``fn`` on ``world`` processes and wait (raises if any rank fails).

    The ranks are forked after the launcher imported ``preload`` (the framework): a spawned
    rank would import it again, seconds per rank per launch. Nothing in the launcher has
    started a thread pool, a process group or a ckptcache client by then, so the fork copies
    no lock held by another thread.
    """
    for name in preload:
        importlib.import_module(name)
    mp.start_processes(
        _entry, args=(fn, world, _port(), args), nprocs=world, join=True, start_method="fork"
    )


def tensors_of(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state, keyed by its path (for exact comparisons)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone().cpu()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out
