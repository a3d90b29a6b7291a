"""DeepSpeed switched to the cache by configuration only, checked the way DeepSpeed's own
checkpoint tests check a save: the files are read back right after ``save_checkpoint``.

usage: ds_tools_worker.py CKPT_DIR [CONFIG]

Every rank calls ``ckptcache.adapters.deepspeed.enable()`` once, before any engine exists (as a
script under Lightning or the HF Trainer would); engines are then built by plain
``deepspeed.initialize`` and never touched by ckptcache code. CONFIG: ``files`` (default:
``"checkpoint": {"ckptcache": {"commit_waits": "files"}}``) or ``default`` (no ckptcache key
in the DeepSpeed config: the adapter's defaults).
"""

from __future__ import annotations

import os
import sys

import torch
from _dist import DEEPSPEED, deepspeed_without_compiled_ops, launch, tensors_of

TAG = "global_step3"


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=g)


def build(seed: int, checkpoint: dict) -> object:
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10_000,
        "checkpoint": checkpoint,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def run(rank: int, world: int, ck: str, config: str) -> None:
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import ckptcache.adapters.deepspeed as ds_cache

    deepspeed_without_compiled_ops()
    assert ds_cache.enable().reachable  # the one process-wide line
    deepspeed.init_distributed(dist_backend="gloo")
    cached = {"ckptcache": {"commit_waits": "files"}} if config == "files" else {}
    engine = build(0, cached)
    assert isinstance(engine.checkpoint_engine, ds_cache.CkptCacheCheckpointEngine)
    for step in range(3):
        loss = engine(batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ck, client_state={"step": 3})

    # Right after the save, as DeepSpeed's TestZeROCheckpointFrozenWeights and zero_to_fp32 do.
    model_file = os.path.join(ck, TAG, "mp_rank_00_model_states.pt")
    assert os.path.getsize(model_file) > 0
    saved = torch.load(model_file, weights_only=False)
    live = engine.module.state_dict()
    assert saved["module"].keys() == live.keys()
    for k, v in live.items():
        assert torch.equal(saved["module"][k], v), k
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == TAG
    if rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(ck)
        for k, v in live.items():
            assert torch.equal(fp32[k], v), k

    # Load into a fresh engine (same hook): the state comes back, optimizer included.
    fresh = build(1, cached)
    path, client_state = fresh.load_checkpoint(ck)
    assert path is not None and client_state["step"] == 3
    a = tensors_of({"m": engine.module.state_dict(), "o": engine.optimizer.state_dict()})
    b = tensors_of({"m": fresh.module.state_dict(), "o": fresh.optimizer.state_dict()})
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # Opting one engine out through its config keeps DeepSpeed's own writer.
    stock = build(2, {"ckptcache": {"enabled": False}})
    assert isinstance(stock.checkpoint_engine, TorchCheckpointEngine)
    torch.distributed.barrier()
    if rank == 0:
        print("DSTOOLS-OK", flush=True)


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "files"
    launch(run, 2, sys.argv[1], mode, preload=DEEPSPEED)
