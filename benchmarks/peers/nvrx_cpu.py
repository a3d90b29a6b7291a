"""NVRx's local checkpointing on CPU tensors: its ``BasicTensorAwareStateDict`` asserts that
every tensor is on CUDA and moves tensors back to CUDA after a save; this subclass drops that
assert and keeps CPU tensors where they are, and changes nothing else (a module of its own, so
the saved object unpickles by name)."""

from __future__ import annotations

from typing import Any

from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
    BasicTensorAwareStateDict,
)


class CpuTensorAwareStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
    """``BasicTensorAwareStateDict`` that accepts CPU tensors."""

    def __init__(self, state_dict: Any):
        # The manager replaces tensors in the dict it is given (its D2H copies): it gets its
        # own containers, as a trainer's fresh ``state_dict()`` call would give it.
        self.state_dict = _containers(state_dict)
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """The tensors were on the CPU to begin with: nothing to move back."""


def _containers(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_containers(v) for v in obj]
    return obj
