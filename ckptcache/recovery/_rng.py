"""Capture and restore every random generator a training step draws from.

Resuming bitwise-identically needs the generators exactly where they were at the start of the
step being (re)run: Python ``random`` (data shuffles in user code), NumPy's global generator
(augmentations), torch's CPU generator and the current CUDA device's generator (dropout).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RngState", "capture_rng", "restore_rng"]


@dataclass(frozen=True)
class RngState:
    """The state of every global generator, picklable so a peer can send it."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    #: State of the current CUDA device's generator; None when CUDA was never initialised.
    cuda: torch.Tensor | None


def capture_rng() -> RngState:
    """Snapshot Python, NumPy, torch CPU and (when initialised) current-device CUDA generators."""
    cuda = None
    # is_initialized, not is_available: capturing must not create a CUDA context in a CPU job.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state()
    return RngState(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch_cpu=torch.get_rng_state(),
        cuda=cuda,
    )


def restore_rng(state: RngState) -> None:
    """Put every generator back to ``state`` (CUDA only when this process uses CUDA too)."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    if state.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.cuda)
