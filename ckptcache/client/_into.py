"""A load that fills tensors the caller already has (:meth:`Client.load_into`).

A private-copy load makes fresh memory for every tensor, and a process's fresh pages cost
more than the copy into them (``benchmarks/save_load/README.md``). A trainer that restores
already holds memory of the right shape: its model's parameters and its optimizer's state.
Filled in place, a restore is one copy from the daemon's segment into memory that is already
the trainer's, as ``torch.distributed.checkpoint.load`` fills the state dict it is given.

Every tensor to fill is matched with the checkpoint's tensor at the same key path (dict keys,
list and tuple indices) and checked (shape, dtype) before the first byte is written: a
mismatch raises :class:`~ckptcache.errors.StateMismatch` and leaves every tensor as it was.
CPU tensors are filled as a save copies: the bytes shared out among the copy threads (one
call a share, streaming stores), then their version counters moved as an in-place write moves
them. The rest (a tensor on a device, filled from the segment directly; a strided one; views
whose bytes overlap another tensor's to fill) are ``Tensor.copy_`` calls without autograd,
in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptcache._signals import signals_deferred
from ckptcache.codec.shm import copy_runs_on_threads
from ckptcache.errors import StateMismatch

__all__ = ["check", "fill"]

_Pair = tuple[str, torch.Tensor, torch.Tensor]  # key path, destination, source


def check(into: Any) -> None:
    """Raise :class:`TypeError` where ``into`` holds no tensor to fill (a module given for
    its state dict, say): a load would fill nothing."""
    if next(_tensors(into, ""), None) is None:
        hint = " (pass module.state_dict())" if isinstance(into, torch.nn.Module) else ""
        raise TypeError(
            "load_into fills the tensors held by dicts, lists and tuples; the "
            f"{type(into).__name__} given holds none{hint}"
        )


def fill(into: Any, loaded: Any) -> Any:
    """Copy every tensor of ``loaded`` that ``into`` has a tensor for at the same key path
    into that tensor, all checked first; returns ``loaded`` with those tensors replaced by
    ``into``'s (its dicts and lists changed in place, its tuples made anew)."""
    pairs = list(_pairs(into, loaded, ""))
    fast, slow = _by_path(pairs)
    if fast:
        # One step for a signal's exception: bytes changed with no version moved would hide
        # the write from what reads version counters (a non-blocking save's mutation check).
        with signals_deferred():
            copy_runs_on_threads([(d, s, n) for d, s, n, _ in fast])
            torch.autograd.graph.increment_version([t for *_, t in fast])  # as copy_ would
    with torch.no_grad():
        for dst, src in slow:
            dst.copy_(src)
    return _replaced(into, loaded)


def _by_path(
    pairs: list[_Pair],
) -> tuple[list[tuple[int, int, int, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pairs a plain copy of bytes may fill, as ``(dst, src, nbytes, tensor)`` runs (CPU,
    contiguous, destinations apart from every other's: the copy threads share them out as a
    save's copy), and the rest, filled by ``copy_`` in order (devices, strided tensors, views
    that share a destination's bytes)."""
    runs = [
        (dst.data_ptr(), src.data_ptr(), dst.nbytes, dst) for _, dst, src in pairs
        if dst.is_cpu and src.is_cpu and dst.is_contiguous() and src.is_contiguous()
    ]  # fmt: skip
    runs = [run for run in runs if run[2]]
    apart = set(range(len(runs)))
    cluster: list[int] = []  # destinations that overlap, directly or through another
    reach = 0
    for start, end, i in sorted((d, d + n, i) for i, (d, _, n, _) in enumerate(runs)):
        if start >= reach:
            if len(cluster) > 1:
                apart.difference_update(cluster)
            cluster = []
        cluster.append(i)
        reach = max(reach, end)
    if len(cluster) > 1:
        apart.difference_update(cluster)
    fast = [runs[i] for i in sorted(apart)]
    taken = {id(run[3]) for run in fast}
    slow = [(dst, src) for _, dst, src in pairs if id(dst) not in taken]
    return fast, slow


def _pairs(into: Any, loaded: Any, where: str) -> Iterator[_Pair]:
    """The (key path, destination, source) of every tensor of ``into``; raises
    :class:`StateMismatch` for one the checkpoint has no fitting tensor for."""
    if isinstance(into, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise StateMismatch(
                f"{where or 'the object'}: the checkpoint holds a {type(loaded).__name__} "
                "where a tensor was given to fill",
                tensor=where,
            )
        if into.is_meta:
            raise StateMismatch(
                f"{where or 'the object'}: a tensor on the meta device has no memory to fill "
                "(materialize the model first, e.g. Module.to_empty)",
                tensor=where,
            )
        if into.shape != loaded.shape or into.dtype != loaded.dtype:
            raise StateMismatch(
                f"{where or 'the object'}: the checkpoint's tensor is "
                f"{loaded.dtype} {tuple(loaded.shape)}, the tensor to fill "
                f"{into.dtype} {tuple(into.shape)}",
                tensor=where,
            )
        yield where, into, loaded
    elif isinstance(into, Mapping):
        for key, value in into.items():
            at = f"{where}.{key}" if where else str(key)
            if not isinstance(loaded, Mapping) or key not in loaded:
                _none_to_fill(value, at)
                continue
            yield from _pairs(value, loaded[key], at)
    elif isinstance(into, (list, tuple)):
        for index, value in enumerate(into):
            at = f"{where}.{index}" if where else str(index)
            if not isinstance(loaded, (list, tuple)) or index >= len(loaded):
                _none_to_fill(value, at)
                continue
            yield from _pairs(value, loaded[index], at)


def _none_to_fill(value: Any, where: str) -> None:
    """Raise :class:`StateMismatch` where ``value`` (at ``where``, absent from the checkpoint)
    holds a tensor to fill."""
    missing = next(_tensors(value, where), None)
    if missing is not None:
        raise StateMismatch(f"{missing}: not in the checkpoint", tensor=missing)


def _tensors(obj: Any, where: str) -> Iterator[str]:
    """The key paths of the tensors in ``obj``."""
    if isinstance(obj, torch.Tensor):
        yield where
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{where}.{key}")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{where}.{index}")


def _replaced(into: Any, loaded: Any) -> Any:
    if isinstance(into, torch.Tensor):
        return into
    if isinstance(into, Mapping) and isinstance(loaded, dict):
        for key, value in into.items():
            if key in loaded:
                loaded[key] = _replaced(value, loaded[key])
        return loaded
    if isinstance(into, (list, tuple)) and isinstance(loaded, (list, tuple)):
        items = list(loaded)
        for index, value in enumerate(into[: len(items)]):
            items[index] = _replaced(value, items[index])
        if isinstance(loaded, list):
            loaded[:] = items
            return loaded
        if hasattr(loaded, "_fields"):  # a named tuple
            return type(loaded)(*items)
        return type(loaded)(items)
    return loaded
