"""Training state <-> (skeleton, flat tensor list), and applying a received state in place.

The *skeleton* is the state with every tensor replaced by a :class:`Slot` naming its index in the
flat list; it holds everything that is not a tensor (hyperparameters, scheduler counters, user
values) and is small enough to send as one pickled object. Tensors travel separately, in buckets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "STATE_KEYS",
    "FlatState",
    "Slot",
    "TensorSpec",
    "apply_training_state",
    "flat_training_state",
    "flatten",
    "frozen_model_keys",
    "rebuild",
    "training_state",
    "training_state_dict",
    "unwrap_model",
]

#: Top-level keys of a training state; a fallback returning a mapping with these keys is applied.
STATE_KEYS = ("model", "optimizer", "scheduler", "extra_state", "step", "rng")

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Slot:
    """Placeholder for the tensor at ``index`` of the flat list."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate or match one tensor: no data, only its description."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: "cpu" or the accelerator type; a newly allocated copy goes to the same kind of device
    #: (Adam keeps its ``step`` counters on the CPU even when the parameters are on a GPU).
    device_type: str
    #: A model parameter with requires_grad=False (PEFT base weights), skippable on request.
    frozen: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FlatState:
    """A flattened state: skeleton plus tensors in a fixed order, with one spec per tensor."""

    skeleton: Any
    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]

    def by_path(self) -> dict[Path, torch.Tensor]:
        return {s.path: t for s, t in zip(self.specs, self.tensors, strict=True)}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that owns the parameters: strips DDP/DataParallel and torch.compile wrappers.

    Unwrapping on every rank makes state keys match whether or not each rank wraps its model.
    """
    while True:
        inner = None
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        else:
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def frozen_model_keys(model: nn.Module) -> frozenset[str]:
    """State-dict keys of parameters that do not train (requires_grad=False)."""
    return frozenset(n for n, p in unwrap_model(model).named_parameters() if not p.requires_grad)


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    scheduler: Any = None,
    extra_state: Any = None,
) -> dict[str, Any]:
    """The live state as a dict keyed like :data:`STATE_KEYS` (tensors are shared, not copied)."""
    return {
        "model": unwrap_model(model).state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "extra_state": extra_state,
    }


def flatten(state: Any, *, frozen: frozenset[str] = frozenset()) -> FlatState:
    """Split ``state`` into a skeleton and its tensors (depth-first, container order).

    ``frozen`` names model keys whose specs are marked frozen.
    """
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []

    def visit(obj: Any, path: Path) -> Any:
        if isinstance(obj, torch.Tensor):
            is_frozen = len(path) == 2 and path[0] == "model" and path[1] in frozen
            specs.append(TensorSpec(path, obj.dtype, tuple(obj.shape), obj.device.type, is_frozen))
            tensors.append(obj.detach())
            return Slot(len(tensors) - 1)
        if isinstance(obj, Mapping):
            items = [(k, visit(v, (*path, k))) for k, v in obj.items()]
            # OrderedDict survives (state_dict returns one); other mappings become dicts.
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, list):
            return [visit(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return _same_tuple(obj, [visit(v, (*path, i)) for i, v in enumerate(obj)])
        return obj

    skeleton = visit(state, ())
    return FlatState(skeleton, tuple(specs), tuple(tensors))


def flat_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    scheduler: Any = None,
    extra_state: Any = None,
) -> FlatState:
    """:func:`training_state` split by :func:`flatten`, the model's frozen keys marked: what
    a snapshot copies and what a replica offers or receives."""
    state = training_state(model, optimizer, scheduler=scheduler, extra_state=extra_state)
    return flatten(state, frozen=frozen_model_keys(model))


def rebuild(skeleton: Any, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
    """Inverse of :func:`flatten`: put ``tensors[i]`` back where ``Slot(i)`` stands."""

    def visit(obj: Any) -> Any:
        if isinstance(obj, Slot):
            return tensors[obj.index]
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, visit(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: visit(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [visit(v) for v in obj]
        if isinstance(obj, tuple):
            return _same_tuple(obj, [visit(v) for v in obj])
        return obj

    return visit(skeleton)


def _same_tuple(like: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    # Named tuples take their fields positionally; plain tuples take one iterable.
    if hasattr(like, "_fields"):
        return type(like)(*items)
    return tuple(items)


def training_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    scheduler: Any = None,
    extra_state: Any = None,
) -> dict[str, Any]:
    """The checkpoint layout a recovery fallback understands: save this, load it in ``fallback``.

    ``ckptcache.save(training_state_dict(model, opt, step=step), path)`` during training and
    ``fallback=lambda: ckptcache.load(path)`` at recovery time is all a user adds: a fallback
    returning this mapping is loaded into the model, optimizer and scheduler, and its ``step``
    becomes the step to resume from. Tensors are the live ones (not copies).
    """
    state = training_state(model, optimizer, scheduler=scheduler, extra_state=extra_state)
    state["step"] = step
    return state


def apply_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, Any],
    *,
    scheduler: Any = None,
    model_in_place: bool = False,
    strict: bool = True,
) -> Any:
    """Load a :func:`training_state`-shaped mapping into the live objects; return extra_state.

    ``model_in_place`` says the model tensors were already written into the live parameters
    (peer transfer), so the model's load_state_dict copy is skipped; ``strict`` is passed to
    the model's load_state_dict otherwise.
    """
    module = unwrap_model(model)
    model_state = state.get("model")
    if model_state is not None and not model_in_place:
        with torch.no_grad():
            module.load_state_dict(model_state, strict=strict)
    elif model_state is not None:
        _set_extra_states(module, model_state)
    optim_state = state.get("optimizer")
    if optimizer is not None and optim_state is not None:
        # Tensors that arrived in place are the live state tensors already; load_state_dict's
        # .to(param.device, param.dtype) returns them unchanged, so this copies nothing big...
        optimizer.load_state_dict(optim_state)
        if model_in_place:  # ...unless their dtype differs from the parameter's
            _keep_received_dtypes(optimizer, optim_state)
    sched_state = state.get("scheduler")
    if scheduler is not None and sched_state is not None:
        scheduler.load_state_dict(sched_state)
    return state.get("extra_state")


def _set_extra_states(module: nn.Module, model_state: Mapping[str, Any]) -> None:
    """Restore every submodule's ``get_extra_state`` entry (FP8 scaling history, ...): the
    parameters and buffers arrived in place, but extra state lives outside the tensors
    ``state_dict`` returns, so only ``set_extra_state`` puts it back."""
    for name, sub in module.named_modules():
        if type(sub).get_extra_state is nn.Module.get_extra_state:
            continue
        key = f"{name}._extra_state" if name else "_extra_state"
        if key in model_state:
            sub.set_extra_state(model_state[key])


def _keep_received_dtypes(optimizer: torch.optim.Optimizer, received: Mapping[str, Any]) -> None:
    """``Optimizer.load_state_dict`` casts state to each parameter's dtype; the healthy replicas
    keep theirs (fp32 moments of bf16 parameters in mixed precision), and so must this rank."""
    saved_ids = [i for group in received["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, param in zip(saved_ids, params, strict=False):
        live = optimizer.state.get(param)
        for key, value in received["state"].get(saved_id, {}).items():
            if live is None or not isinstance(value, torch.Tensor) or key not in live:
                continue
            if live[key].dtype != value.dtype:
                live[key] = value
