"""DeepSpeed's decoupled checkpoint protocol through the cache, on 2 CPU ranks.

usage: ds_decoupled_worker.py CKPT_DIR

``"checkpoint": {"ckptcache": {"decoupled": true}}``: ``save_checkpoint`` returns after the copy
into the cache, and DeepSpeed's ``latest`` follows the files at the next optimizer step. Run
against a memory-only daemon, where nobody but the adapter writes the files: right after the
save the payloads are cached objects, not files, and ``latest`` names no tag; one step later the
files hold the save, ``latest`` names it and ``zero_to_fp32`` converts it. ``flush(engine)``
commits a second save at once.
"""

from __future__ import annotations

import os
import sys

import torch
from _dist import DEEPSPEED, deepspeed_without_compiled_ops, launch
from ds_tools_worker import batch, build


def latest(ck: str) -> str | None:
    path = os.path.join(ck, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def train_step(engine, step: int, rank: int) -> None:
    loss = engine(batch(step, rank)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def files_of(ck: str, tag: str, rank: int) -> list[str]:
    return [
        os.path.join(ck, tag, "mp_rank_00_model_states.pt"),
        os.path.join(ck, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
    ]


def run(rank: int, world: int, ck: str) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import ckptcache.adapters.deepspeed as ds_cache
    from ckptcache.api import default_client

    deepspeed_without_compiled_ops()
    assert ds_cache.enable().reachable
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(0, {"ckptcache": {"decoupled": True}})
    assert engine.checkpoint_engine.is_decoupled()
    for step in range(3):
        train_step(engine, step, rank)
    engine.save_checkpoint(ck, client_state={"step": 3})
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    # Returned after the copy: the files are the cache's alone, `latest` names no tag yet.
    assert latest(ck) is None
    for path in files_of(ck, "global_step3", rank):
        assert not os.path.exists(path) and default_client().exists(path), path
    torch.distributed.barrier()

    train_step(engine, 3, rank)  # DeepSpeed commits the save here, then writes `latest`
    assert latest(ck) == "global_step3"
    assert all(os.path.exists(p) for p in files_of(ck, "global_step3", rank))
    model = torch.load(files_of(ck, "global_step3", rank)[0], weights_only=False)["module"]
    assert model.keys() == saved.keys() and all(torch.equal(model[k], saved[k]) for k in saved)
    if rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(ck)
        assert all(torch.equal(fp32[k], v) for k, v in saved.items())

    engine.save_checkpoint(ck, client_state={"step": 4})
    assert latest(ck) == "global_step3"  # the new tag waits for its commit
    assert ds_cache.flush(engine) and not ds_cache.flush(engine)
    assert latest(ck) == "global_step4"
    assert all(os.path.exists(p) for p in files_of(ck, "global_step4", rank))
    assert torch.load(files_of(ck, "global_step4", rank)[0], weights_only=False)["step"] == 4
    torch.distributed.barrier()
    if rank == 0:
        print("DECOUPLED-OK", flush=True)


if __name__ == "__main__":
    launch(run, 2, sys.argv[1], preload=DEEPSPEED)
