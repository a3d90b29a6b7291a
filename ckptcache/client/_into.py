"""A load that fills tensors the caller already has (:meth:`Client.load_into`).

A private-copy load makes fresh memory for every tensor, and a process's fresh pages cost
more than the copy into them (``benchmarks/save_load/README.md``). A trainer that restores
already holds memory of the right shape: its model's parameters and its optimizer's state.
Filled in place, a restore is one copy from the daemon's segment into memory that is already
the trainer's, as ``torch.distributed.checkpoint.load`` fills the state dict it is given.

Every tensor to fill is matched with the checkpoint's tensor at the same key path (dict keys,
list and tuple indices) and checked before the first byte is written: shape, dtype and
layout equal, and a destination that a copy can fill (memory of its own: not on the meta
device, no elements sharing one address, a storage as large as its shape; an inference
tensor only inside ``torch.inference_mode()``). A mismatch raises
:class:`~ckptcache.errors.StateMismatch` and leaves every tensor as it was; tensors held by
an object other than a dict, list or tuple (a module, a dataclass) raise :class:`TypeError`
rather than being passed over. CPU tensors whose bytes are a plain copy (contiguous, no
lazy conjugate or negation, apart from every other tensor to fill) are filled as a save
copies: the bytes shared out among the copy threads (one call a share, streaming stores),
then their version counters moved as an in-place write moves them. The rest (a tensor on a
device, filled from the segment directly; a strided one; a conjugate or negative view;
tensors whose bytes overlap, such as tied weights) are ``Tensor.copy_`` calls without
autograd, in the order of ``into``: what a loop of ``copy_`` would leave.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptcache._signals import signals_deferred
from ckptcache.codec.shm import copy_runs_on_threads
from ckptcache.errors import StateMismatch

__all__ = ["check", "fill"]

_Pair = tuple[str, torch.Tensor, torch.Tensor]  # key path, destination, source


def check(into: Any) -> None:
    """Raise :class:`TypeError` where ``into`` holds no tensor to fill, or holds tensors in
    an object other than a dict, list or tuple (a module given for its state dict, say): a
    load would fill nothing, or pass them over."""
    if next(_tensors(into, ""), None) is None:
        raise TypeError(
            "load_into fills the tensors held by dicts, lists and tuples; the "
            f"{type(into).__name__} given holds none"
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
    """The pairs a plain copy of bytes may fill, as ``(dst, src, nbytes, tensor)`` runs, and
    the rest, filled by ``copy_`` in order. A plain copy: CPU, contiguous, no lazy conjugate
    or negation on either side, and a destination whose bytes lie apart from every other
    CPU destination's (any layout: a tied weight named twice, a strided view into a
    contiguous one), so that the order of the copies cannot matter."""
    spans = []  # (first byte, end, pair index) of every CPU destination with bytes
    for i, (_, dst, _) in enumerate(pairs):
        if type(dst) in _PLAIN_TYPES and dst.is_cpu and dst.numel():
            start = dst.data_ptr()
            spans.append((start, start + _extent(dst) * dst.element_size(), i))
    overlapping: set[int] = set()
    cluster: list[int] = []  # destinations that overlap, directly or through another
    reach = 0
    for start, end, i in sorted(spans):
        if start >= reach:
            if len(cluster) > 1:
                overlapping.update(cluster)
            cluster = []
        cluster.append(i)
        reach = max(reach, end)
    if len(cluster) > 1:
        overlapping.update(cluster)
    fast, slow = [], []
    for i, (_, dst, src) in enumerate(pairs):
        if i not in overlapping and _plain(dst) and _plain(src) and not dst.is_inference():
            if dst.nbytes:
                fast.append((dst.data_ptr(), src.data_ptr(), dst.nbytes, dst))
        else:
            slow.append((dst, src))
    return fast, slow


#: Tensors whose bytes are at ``data_ptr()``: not a subclass that wraps others (a
#: ``DTensor``), which only its own ``copy_`` fills.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are its values in order: a plain CPU tensor, contiguous, with no
    lazy conjugate or negation (a view whose values are its bytes' conjugate or negative)."""
    return (
        type(t) in _PLAIN_TYPES and t.is_cpu and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
    )  # fmt: skip


def _extent(t: torch.Tensor) -> int:
    """The elements of ``t``'s storage that its elements span, from its first (strides are
    never negative in torch)."""
    return 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))


def _storage_nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s storage; unbounded for a tensor with none to look at (a wrapper
    subclass), which ``copy_`` fills as it can."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 1 << 62


def _pairs(into: Any, loaded: Any, where: str) -> Iterator[_Pair]:
    """The (key path, destination, source) of every tensor of ``into``; raises
    :class:`StateMismatch` for one the checkpoint has no fitting tensor for, or that a copy
    cannot fill, and :class:`TypeError` for tensors held by another kind of object."""
    if isinstance(into, torch.Tensor):
        _check_pair(into, loaded, where)
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
    else:
        _refuse_holders(into, where)


def _check_pair(into: torch.Tensor, loaded: Any, where: str) -> None:
    """Raise :class:`StateMismatch` where ``loaded`` cannot fill ``into`` by a copy."""
    name = where or "the object"

    def mismatch(why: str) -> StateMismatch:
        return StateMismatch(f"{name}: {why}", tensor=where)

    if not isinstance(loaded, torch.Tensor):
        raise mismatch(
            f"the checkpoint holds a {type(loaded).__name__} where a tensor was given to fill"
        )
    if into.is_meta:
        raise mismatch(
            "a tensor on the meta device has no memory to fill (materialize the model "
            "first, e.g. Module.to_empty)"
        )
    if into.layout != torch.strided or loaded.layout != torch.strided:
        raise mismatch(
            f"only dense tensors are filled; the checkpoint's is {loaded.layout}, the "
            f"tensor to fill {into.layout}"
        )
    if into.shape != loaded.shape or into.dtype != loaded.dtype:
        raise mismatch(
            f"the checkpoint's tensor is {loaded.dtype} {tuple(loaded.shape)}, the tensor "
            f"to fill {into.dtype} {tuple(into.shape)}"
        )
    if into.is_inference() and not torch.is_inference_mode_enabled():
        raise mismatch(
            "an inference tensor can be written only inside torch.inference_mode(): call "
            "load_into there"
        )
    if into.numel() and (into.storage_offset() + _extent(into)) * into.element_size() > (
        _storage_nbytes(into)
    ):
        raise mismatch(
            "its storage holds fewer bytes than its shape spans (resized or freed, as FSDP "
            "and ZeRO free parameters): nothing to fill"
        )
    if torch._debug_has_internal_overlap(into) == 1:  # 1: some elements share an address
        raise mismatch(
            "several of its elements share one address (an expanded tensor): it cannot be filled"
        )


def _none_to_fill(value: Any, where: str) -> None:
    """Raise :class:`StateMismatch` where ``value`` (at ``where``, absent from the checkpoint)
    holds a tensor to fill."""
    missing = next(_tensors(value, where), None)
    if missing is not None:
        raise StateMismatch(f"{missing}: not in the checkpoint", tensor=missing)


def _tensors(obj: Any, where: str) -> Iterator[str]:
    """The key paths of the tensors in ``obj``; raises :class:`TypeError` for tensors held
    by another kind of object than a dict, list or tuple."""
    if isinstance(obj, torch.Tensor):
        yield where
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{where}.{key}" if where else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{where}.{index}" if where else str(index))
    else:
        _refuse_holders(obj, where)


def _refuse_holders(obj: Any, where: str) -> None:
    """Raise :class:`TypeError` where ``obj`` (neither a tensor, nor a dict, list or tuple)
    holds tensors: a module, a dataclass, an object's attributes. Filling only what dicts,
    lists and tuples hold, a load would pass them over, and the caller would take them for
    restored."""
    if isinstance(obj, torch.nn.Module):
        holds = next(itertools.chain(obj.parameters(), obj.buffers()), None) is not None
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        holds = any(_holds(getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    elif isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, type):
        holds = any(map(_holds, vars(obj).values()))
    else:
        holds = False
    if holds:
        hint = " (pass module.state_dict())" if isinstance(obj, torch.nn.Module) else ""
        raise TypeError(
            f"{where or 'the object'}: load_into fills the tensors held by dicts, lists and "
            f"tuples; this {type(obj).__name__} holds tensors it would not fill{hint}"
        )


def _holds(value: Any) -> bool:
    """Whether ``value`` is a tensor or a dict, list or tuple holding one (no object's
    attributes: an object graph may have cycles)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(map(_holds, value.values()))
    if isinstance(value, (list, tuple)):
        return any(map(_holds, value))
    return False


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
