"""A stand-in for Megatron-LM's ``megatron/training/checkpointing.py`` legacy (``torch``) path.

Megatron-LM is not a pip package; this module does the same I/O the same way: module-level
``torch.save``/``torch.load`` on ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt``, an ``isfile``
helper, directories made before the save, and ``latest_checkpointed_iteration.txt`` written by
rank 0 with ``open`` after a barrier; loads read the tracker, detect the format by listing the
iteration directory, then ``torch.load`` the rank's file.
"""

from __future__ import annotations

import os

import torch

TRACKER = "latest_checkpointed_iteration.txt"


def isfile(filename: str) -> bool:
    return os.path.isfile(filename)


def get_checkpoint_name(checkpoints_path: str, iteration: int, tensor_rank: int) -> str:
    return os.path.join(
        checkpoints_path,
        f"iter_{iteration:07d}",
        f"mp_rank_{tensor_rank:02d}",
        "model_optim_rng.pt",
    )


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER)


def save_checkpoint(iteration: int, state_dict: dict, save_dir: str) -> None:
    rank = torch.distributed.get_rank()
    name = get_checkpoint_name(save_dir, iteration, rank)
    os.makedirs(os.path.dirname(name), exist_ok=True)
    torch.save(state_dict, name)
    torch.distributed.barrier()
    if rank == 0:
        with open(get_checkpoint_tracker_filename(save_dir), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def load_checkpoint(load_dir: str) -> tuple[int, dict] | None:
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not isfile(tracker):
        return None
    with open(tracker) as f:
        iteration = int(f.read().strip())
    iter_dir = os.path.join(load_dir, f"iter_{iteration:07d}")
    if not any(n.startswith("mp_rank_0") for n in os.listdir(iter_dir)):
        raise NotImplementedError(f"unknown checkpoint format in {iter_dir}")
    name = get_checkpoint_name(load_dir, iteration, torch.distributed.get_rank())
    return iteration, torch.load(name, map_location="cpu", weights_only=False)
