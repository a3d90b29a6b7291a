"""DeepSpeed switched to the cache by ``CKPTCACHE_DEEPSPEED=1`` alone: no line of this script
imports or calls ckptcache. The installed package's startup hook does, when ``deepspeed`` is
imported.

usage: ds_env_worker.py CKPT_DIR OUT_DIR

Each rank trains 3 steps, saves with ``save_checkpoint``, writes the live state to
``OUT_DIR/saved-rank{r}.pt``, loads the checkpoint into a fresh engine with
``load_checkpoint`` and writes that engine's state to ``OUT_DIR/loaded-rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from _dist import deepspeed_without_compiled_ops, launch, tensors_of

ADAPTER = "ckptcache.adapters.deepspeed"


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=g)


def build(seed: int) -> object:
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def state_of(engine) -> dict[str, torch.Tensor]:
    return tensors_of({"m": engine.module.state_dict(), "o": engine.optimizer.state_dict()})


def run(rank: int, world: int, ck: str, out: str) -> None:
    assert ADAPTER not in sys.modules and "torch.distributed.checkpoint" not in sys.modules
    import deepspeed

    assert ADAPTER in sys.modules, "the startup hook did not switch the adapter on"
    deepspeed_without_compiled_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(0)
    print(f"ENGINE {type(engine.checkpoint_engine).__name__}", flush=True)
    for step in range(3):
        loss = engine(batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ck, client_state={"step": 3})
    torch.save(state_of(engine), os.path.join(out, f"saved-rank{rank}.pt"))
    fresh = build(1)
    print(f"ENGINE {type(fresh.checkpoint_engine).__name__}", flush=True)
    path, client_state = fresh.load_checkpoint(ck)
    assert path is not None and client_state["step"] == 3
    torch.save(state_of(fresh), os.path.join(out, f"loaded-rank{rank}.pt"))


if __name__ == "__main__":
    launch(run, 2, sys.argv[1], sys.argv[2])
