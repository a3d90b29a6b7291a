"""A tiny DeepSpeed trainer on 2 CPU ranks: reference run, crash after a save, or resume.

usage: ds_trainer.py MODE STAGES CKPT_DIR OUT_DIR

MODE: reference (no checkpoint) | crash (save at step 3, then SIGKILL) | resume (cache on) |
plainresume (resume with DeepSpeed's default engine, cache off)

STAGES: one ZeRO stage, or several separated by commas: each is trained in turn by the same
ranks (one launch instead of one per stage), checkpointing into ``CKPT_DIR/zero<stage>``; a
crash run saves every stage's checkpoint first and then dies. Each rank writes its final state
to ``OUT_DIR/<mode>-zero<stage>-rank<rank>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from _dist import DEEPSPEED, deepspeed_without_compiled_ops, launch, tensors_of

CRASH_AT, TOTAL = 3, 6


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=g)


def train(rank: int, world: int, mode: str, stages: list[int], ckpt_dir: str, out_dir: str) -> None:
    import deepspeed  # imported by the launcher already (preload): the ranks fork with it

    deepspeed_without_compiled_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in stages:
        where = ckpt_dir if len(stages) == 1 else os.path.join(ckpt_dir, f"zero{stage}")
        train_stage(rank, mode, stage, where, out_dir)
    if mode == "crash":
        torch.distributed.barrier()
        print("CHECKPOINT-SAVED", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the crash: no cleanup, no persist wait


def train_stage(rank: int, mode: str, stage: int, ckpt_dir: str, out_dir: str) -> None:
    """One engine at ``stage``; a crash run stops right after its save (the test's crash comes
    once every stage has saved)."""
    import deepspeed

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
        # Tells the test this rank is about to read the checkpoint (it may wait for a persist).
        open(os.path.join(out_dir, f"{mode}-loading-rank{rank}"), "w").close()
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
            return
    state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
    torch.save(tensors_of(state), os.path.join(out_dir, f"{mode}-zero{stage}-rank{rank}.pt"))


if __name__ == "__main__":
    mode, ckpt_dir, out_dir = sys.argv[1], sys.argv[3], sys.argv[4]
    stages = [int(s) for s in sys.argv[2].split(",")]
    launch(train, 2, mode, stages, ckpt_dir, out_dir, preload=DEEPSPEED)
