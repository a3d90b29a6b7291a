"""A tiny DeepSpeed trainer on 2 CPU ranks: reference run, crash after a save, or resume.

usage: ds_trainer.py MODE STAGE CKPT_DIR OUT_DIR

MODE: reference (no checkpoint) | crash (save at step 3, then SIGKILL) | resume (cache on) |
plainresume (resume with DeepSpeed's default engine, cache off)
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from _dist import launch, tensors_of

CRASH_AT, TOTAL = 3, 6


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=g)


def train(rank: int, world: int, mode: str, stage: int, ckpt_dir: str, out_dir: str) -> None:
    import deepspeed  # in the ranks only: the launching process never needs it

    # No JIT-compiled op: DeepSpeed's optional CPU shared-memory allreduce is skipped (gloo's
    # allreduce is used), so the ranks need no compiler and no torch-extensions lock.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    if mode in ("crash", "resume"):
        import ckptcache.adapters.deepspeed as ds_cache

        ds_cache.enable(engine)
    start = 0
    if mode in ("resume", "plainresume"):
        path, client_state = engine.load_checkpoint(ckpt_dir)
        assert path is not None, "no checkpoint found"
        start = client_state["step"]
        assert start == CRASH_AT
    for step in range(start, TOTAL):
        loss = engine(batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if mode == "crash" and step + 1 == CRASH_AT:
            engine.save_checkpoint(ckpt_dir, client_state={"step": CRASH_AT})
            torch.distributed.barrier()
            print("CHECKPOINT-SAVED", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the crash: no cleanup, no persist wait
    state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
    torch.save(tensors_of(state), os.path.join(out_dir, f"{mode}-rank{rank}.pt"))


if __name__ == "__main__":
    mode, stage, ckpt_dir, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    launch(train, 2, mode, stage, ckpt_dir, out_dir)
