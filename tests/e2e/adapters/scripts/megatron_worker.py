"""megatron-core dist_checkpointing and the legacy torch path through the cache.

usage: megatron_worker.py MODE CKPT_DIR WORLD
MODE: dist-save | dist-load | dist-load-stock | legacy-crash | legacy-resume | legacy-plain
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import megatron_legacy_standin as standin
import torch
import torch.distributed as dist
from _dist import MEGATRON, launch

# megatron-core is imported by the launcher (preload), the ranks fork with it: every mode's
# ranks import the adapter, which imports megatron-core's dist_checkpointing strategies.
FRAMEWORK = (
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
)

FULL = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
EMB = torch.linspace(-1, 1, 16 * 4).reshape(16, 4)


def sharded(rank: int, world: int, empty: bool, with_rng: bool = True) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    w = FULL.chunk(world)[rank]
    e = EMB.chunk(world, dim=1)[rank]
    state = {
        "layer.weight": ShardedTensor.from_rank_offsets(
            "layer.weight", torch.zeros_like(w) if empty else w.clone(), (0, rank, world)
        ),
        "emb": ShardedTensor.from_rank_offsets(
            "emb", torch.zeros_like(e) if empty else e.clone(), (1, rank, world)
        ),
        "iteration": 0 if empty else 7,
    }
    if with_rng:  # per-rank objects only load at the parallelism they were saved with
        state["rng"] = ShardedObject(
            "rng", None if empty else {"seed": 100 + rank}, (world,), (rank,)
        )
    return state


def check(state: dict, rank: int, world: int, saved_world: int) -> None:
    assert torch.equal(state["layer.weight"], FULL.chunk(world)[rank])
    assert torch.equal(state["emb"], EMB.chunk(world, dim=1)[rank])
    if world == saved_world:
        assert state["rng"] == {"seed": 100 + rank}, state["rng"]
    assert state["iteration"] == 7


def legacy_state(rank: int) -> dict:
    return {
        "model": {"w": FULL * (rank + 1)},
        "args": argparse.Namespace(num_layers=2, tensor_model_parallel_size=2),
        "iteration": 5,
    }


def run(rank: int, world: int, mode: str, ck: str, saved_world: int) -> None:
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing

    from ckptcache.adapters import megatron as cm

    if mode == "dist-save":
        dist_checkpointing.save(
            sharded(rank, world, False), ck, sharded_strategy=cm.CacheSaveShardedStrategy()
        )
    elif mode == "dist-load":
        state = dist_checkpointing.load(
            sharded(rank, world, True, world == saved_world),
            ck,
            sharded_strategy=cm.CacheLoadShardedStrategy(),
        )
        check(state, rank, world, saved_world)
    elif mode == "dist-load-stock":  # cache off: megatron-core's own torch_dist strategy
        state = dist_checkpointing.load(sharded(rank, world, True, world == saved_world), ck)
        check(state, rank, world, saved_world)
    elif mode == "legacy-crash":
        cm.enable(standin)
        standin.save_checkpoint(5, legacy_state(rank), ck)
        print("CHECKPOINT-SAVED", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode in ("legacy-resume", "legacy-plain"):
        if mode == "legacy-resume":
            cm.enable(standin)
        loaded = standin.load_checkpoint(ck)
        assert loaded is not None
        iteration, state = loaded
        assert iteration == 5 and torch.equal(state["model"]["w"], FULL * (rank + 1))
        assert state["args"].num_layers == 2
    dist.barrier()
    if rank == 0:
        print(f"{mode.upper()}-OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, ck, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    saved_world = int(sys.argv[4]) if len(sys.argv) > 4 else world
    launch(run, world, mode, ck, saved_world, preload=MEGATRON)
