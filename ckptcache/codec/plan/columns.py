"""The tensors of a plan cache's walk, read in columns (:mod:`ckptcache.codec.plan.cache`).

Each field is read for every tensor by ``map`` over a C getter, not by a Python step per tensor
reading a dozen fields (``benchmarks/save_load/README.md`` has the figures). The flat
level of a state dict (string keys, tensors seen for the first time) is added to the walk's
key by C calls too (:func:`tensor_items`).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from ckptcache.codec.shm import device_of

__all__ = ["NotPlain", "tensor_columns", "tensor_items"]

_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_PLAIN_DEVICES = frozenset({"cpu", "cuda"})
#: Below this many items a dict is walked item by item (as quick, and the usual nesting).
_BULK_FROM = 8


class NotPlain(Exception):
    """The object holds something the walk does not describe: flatten it afresh."""


def tensor_items(
    value: dict[Any, Any], key: list[Any], seen: dict[int, int], tensors: list[torch.Tensor]
) -> bool:
    """Add the items of ``value`` to the walk's ``key`` as its per-item steps would (``str``,
    the key, ``Tensor``; ``seen`` names each tensor by the place of its ``Tensor`` mark) and
    its tensors to ``tensors``, when every key is a ``str`` and every value a plain tensor
    the walk has not seen: a state dict's own level, added by C calls. ``False``: nothing
    added, walk it item by item."""
    n = len(value)
    if n < _BULK_FROM:
        return False
    keys, values = list(value), list(value.values())
    if set(map(type, keys)) != {str} or set(map(type, values)) != {_Tensor}:
        return False
    ids = list(map(id, values))
    if len(set(ids)) != n or not seen.keys().isdisjoint(ids):
        return False  # a tensor held twice: the per-item steps write its reference
    base = len(key)
    repeat = itertools.repeat
    items = zip(repeat(str, n), keys, repeat(_Tensor, n), strict=True)
    key.extend(itertools.chain.from_iterable(items))
    seen.update(zip(ids, range(base + 2, base + 3 * n, 3), strict=True))
    tensors.extend(values)
    return True


_Storage = torch.UntypedStorage
_STRIDED = {torch.strided}
_layout = operator.attrgetter("layout")
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_version = operator.attrgetter("_version")
_cdata = operator.attrgetter("_cdata")
_requires_grad = operator.attrgetter("requires_grad")
#: Every dtype torch has, from its module (a dtype added by a later torch is in here too).
_DTYPES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype))
_QUANTIZED = frozenset(d for d in _DTYPES if str(d).startswith(("torch.qint", "torch.quint")))
_COMPLEX = frozenset(d for d in _DTYPES if d.is_complex)
_is_cpu = operator.attrgetter("is_cpu")
_hooks = operator.attrgetter("_backward_hooks")
_attributes = operator.attrgetter("__dict__")


def tensor_columns(
    tensors: list[torch.Tensor], v3: frozenset[torch.dtype], versions: bool = True
) -> tuple[list[torch.UntypedStorage], list[int | None], list[int], tuple[Any, ...], bool]:
    """The storages of ``tensors`` (each once, in pickling order) in first-use order; per
    tensor its version counter (none read without ``versions``: only a non-blocking save
    checks them) and its storage's ``_cdata``; eight columns of their fields
    (:attr:`Structure.columns`), which the key holds after the walk's items; and whether every
    tensor is on the CPU (:attr:`~ckptcache.codec.flatten.Flattened.on_cpu`). Raises
    :class:`NotPlain` for a tensor that is not a plain dense CPU/CUDA tensor, or storages the
    flatten would refuse.

    Each field is read for every tensor by ``map`` over a C getter, not by a Python loop
    over the tensors (a dozen attribute reads per tensor in bytecode). The
    columns follow the walk's own items in the key, so two keys are equal exactly when the
    walks and every tensor's fields are (the i-th column entry is the i-th tensor visited).
    """
    ts = tensors
    if not ts:
        return [], [], [], ((),) * 8, True
    Tensor = _Tensor
    # All on the CPU (the usual case): one flag per tensor, no device object made.
    on_cpu = all(map(_is_cpu, ts))
    devices = {_CPU} if on_cpu else set(map(device_of, ts))
    dtypes = list(map(_dtype, ts))
    kinds = set(dtypes)
    # Three flags follow from the dtypes, so their columns are read only where they can be
    # set: a quantized tensor has a quantized dtype; the conjugate bit exists only on complex
    # tensors (torch asserts it); a strided nested tensor has no shape (``shape`` raises
    # RuntimeError below, and the walk takes the slow path) and a jagged one another layout.
    if (
        set(map(_layout, ts)) != _STRIDED
        or not kinds.isdisjoint(_QUANTIZED)
        or not {device.type for device in devices} <= _PLAIN_DEVICES
        or any(map(_hooks, ts))
        or any(map(_attributes, ts))
        or (not kinds.isdisjoint(_COMPLEX) and any(map(Tensor.is_conj, ts)))
        or any(map(Tensor.is_neg, ts))
        or not v3.isdisjoint(kinds)
    ):
        raise NotPlain
    per_tensor = list(map(Tensor.untyped_storage, ts))
    cdatas = list(map(_cdata, per_tensor))
    order = list(dict.fromkeys(cdatas))  # each storage once, in first-use order
    if len(order) == len(ts):  # no storage shared (most state dicts): nothing to reconcile
        storages, storage_dtypes, indices = per_tensor, dtypes, tuple(range(len(ts)))
    else:
        # Every tensor over a storage has the storage's first dtype (as ``flatten`` requires).
        if len(set(zip(cdatas, dtypes, strict=True))) != len(order):
            raise NotPlain
        first = dict(zip(reversed(cdatas), reversed(per_tensor), strict=True))
        storages = list(map(first.__getitem__, order))
        first_dtype = dict(zip(reversed(cdatas), reversed(dtypes), strict=True))
        storage_dtypes = list(map(first_dtype.__getitem__, order))
        position = {c: i for i, c in enumerate(order)}
        indices = tuple(map(position.__getitem__, cdatas))
    # Two storages over the same memory must agree on the dtype: flatten refuses it, with its
    # message. Distinct pointers (the usual case) cannot disagree.
    ptrs = list(map(_Storage.data_ptr, storages))
    if len(set(ptrs)) != len(ptrs):
        placed = {(p, d) for p, d in zip(ptrs, storage_dtypes, strict=True) if p}
        if len(placed) != len({p for p, _ in placed}):
            raise NotPlain
    counters: list[int | None] = []
    try:
        counters = list(map(_version, ts)) if versions else []
    except RuntimeError:  # an inference-mode tensor among them: it has no counter
        counters = [_version_or_none(t) for t in ts]
    columns = (
        tuple(dtypes),
        tuple(map(_shape, ts)),
        tuple(map(Tensor.stride, ts)),
        tuple(map(Tensor.storage_offset, ts)),
        indices,
        tuple(map(_requires_grad, ts)),
        (-1,) * len(ts) if on_cpu else tuple(map(Tensor.get_device, ts)),
        tuple(map(_Storage.nbytes, storages)),
    )
    return storages, counters, cdatas, columns, on_cpu


def _version_or_none(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor: no counter
        return None
