"""Tensor names from a pickle skeleton, without torch and without running its code.

A damaged record of a stored archive is ``data/<key>``; the user knows the tensor as a
state-dict path (``model.layers.3.weight``). This module reads the skeleton (``data.pkl``) with
an unpickler that builds stand-ins instead of objects: no global is ever imported, no code of
the checkpoint runs, and neither torch nor NumPy is loaded (the daemon names the tensor of a
corrupt storage read too). The names are the ones a save records
(:func:`ckptcache.codec.flatten.flatten`): the path of the first tensor, in depth-first order,
that uses the storage, through mappings, lists, tuples and ``argparse.Namespace``.

Only error messages use this, so any skeleton it cannot read gives no names rather than an
error.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["first_paths", "storage_names"]

K = TypeVar("K", bound=Hashable)

#: How deep inside a rebuild call's arguments a storage (or a tensor stand-in) is looked for:
#: ``_rebuild_tensor_v2(storage, ...)``, ``_rebuild_parameter(tensor, ...)``,
#: ``_rebuild_from_type_v2(func, type, (storage, ...), state)``.
_REBUILD_DEPTH = 3


class _StorageRef:
    """What a persistent id (``("storage", type, key, location, numel)``) unpickles to."""

    def __init__(self, key: str):
        self.key = key


class _Stub:
    """Stands for any object the skeleton builds from a global: records its arguments, its
    state and whatever items or elements the pickle adds to it."""

    qualname = ""
    args: tuple[Any, ...]
    state: Any
    items: dict[Any, Any]
    elements: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        self = object.__new__(cls)
        self.args, self.state, self.items, self.elements = args, None, {}, []
        return self

    def __init__(self, *args: Any, **kwargs: Any):
        pass  # everything was recorded by __new__ (NEWOBJ calls only that)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.elements.append(value)

    def extend(self, values: Any) -> None:
        self.elements.extend(values)

    @property
    def is_tensor(self) -> bool:
        """Built by one of torch's tensor rebuild functions."""
        return self.qualname.startswith(("torch._utils._rebuild", "torch._tensor._rebuild"))


class _Unpickler(pickle.Unpickler):
    """Resolves every global to a :class:`_Stub` subclass named after it (never imports)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._stubs: dict[str, type[_Stub]] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        if qualname == "collections.OrderedDict":
            return collections.OrderedDict  # plain data, and a mapping to walk
        stub = self._stubs.get(qualname)
        if stub is None:
            stub = self._stubs[qualname] = type(name, (_Stub,), {"qualname": qualname})
        return stub

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            return _StorageRef(str(pid[2]))
        raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")


def _storage_key(value: Any, depth: int = _REBUILD_DEPTH) -> str | None:
    """The storage a tensor stand-in (or a value inside its rebuild arguments) refers to."""
    if isinstance(value, _StorageRef):
        return value.key
    if depth == 0:
        return None
    children: Any = ()
    if isinstance(value, _Stub):
        children = value.args
    elif isinstance(value, (tuple, list)):
        children = value
    for child in children:
        key = _storage_key(child, depth - 1)
        if key is not None:
            return key
    return None


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """A container's named children, in the order a save names them (None: not walked)."""
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(value)]
    if isinstance(value, _Stub) and value.qualname == "argparse.Namespace":
        state = value.state if isinstance(value.state, Mapping) else {}
        return [(str(k), v) for k, v in state.items()]
    return None


def first_paths(
    root: Any,
    is_leaf: Callable[[Any], bool],
    key_of: Callable[[Any], K | None],
    children_of: Callable[[Any], Sequence[tuple[str, Any]] | None],
) -> dict[K, str]:
    """Map the key of each leaf under ``root`` to the dotted path of the first leaf with that
    key, depth-first in the order ``children_of`` names a container's children (a leaf at the
    root is ``"<root>"``). A container reached twice is walked once; a leaf whose key is
    ``None`` is passed over, and so is a value that is neither a leaf nor a container.

    The one walk behind a tensor's name at save time (:func:`ckptcache.codec.flatten.
    tensor_names`, over the live object) and in a stored skeleton (:func:`storage_names`), so
    that both name a storage alike."""
    names: dict[K, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        prefix, value = stack.pop()
        if is_leaf(value):
            key = key_of(value)
            if key is not None:
                names.setdefault(key, prefix or "<root>")
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        for name, child in reversed(children_of(value) or ()):
            stack.append((f"{prefix}.{name}" if prefix else name, child))
    return names


def _is_tensor(value: Any) -> bool:
    return isinstance(value, _Stub) and value.is_tensor


def storage_names(skeleton: bytes | memoryview) -> dict[str, str]:
    """Storage key -> state-dict path of the first tensor using it, read from ``skeleton``
    without importing anything; empty if the skeleton cannot be read."""
    try:
        root = _Unpickler(bytes(skeleton)).load()
    except Exception:  # a damaged or foreign skeleton: no names, the error says the rest
        return {}
    return first_paths(root, _is_tensor, _storage_key, _children)
