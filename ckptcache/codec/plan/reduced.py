"""The objects beyond plain containers whose pickling the plan cache can predict.

The plan cache (:mod:`ckptcache.codec.plan.cache`) reuses a skeleton when a new object's
description equals an old one's, so a description must decide every byte the pickler writes.
For an object that is not a builtin container, the pickler (protocol 2, ``flatten``'s pickler)
writes whatever its reduction returns: ``obj.__reduce_ex__(2)``, then the callable (or, for
``copyreg.__newobj__``, the class), the arguments, and the state, each pickled in turn. An
object whose reduction is deterministic (two calls with nothing changed in between give equal
results) is therefore described by its class and that output, described in turn.

Which reductions are deterministic is not something to guess: only these, read from their
source, are trusted, and every other object is flattened afresh on every save:

* ``torch.Size`` (exactly): ``Size.__reduce__`` (C) returns ``(torch.Size, (tuple(self),))``.
* enum members whose class keeps ``Enum.__reduce_ex__``: ``(self.__class__, (self._value_,))``.
* instances pickled by ``object``'s default reduction (plain classes, dataclasses, named
  tuples): ``(copyreg.__newobj__, (cls, *cls.__getnewargs__(self)), state, None, None)``, where
  ``state`` is the instance ``__dict__`` (or ``None`` when empty). Trusted only when nothing
  in it runs the class's own code: no ``__reduce_ex__``, ``__reduce__``, ``__getstate__``,
  ``__getnewargs_ex__``, ``__getattribute__`` or ``__getattr__`` of the class's own (on it or
  on a base; builtin bases aside), ``__getnewargs__`` only a named tuple's (known by its code
  object), no ``__slots__`` (read through attribute access), no ``list``/``dict`` base (their
  items come from iterators the class may define), and no override on the instance.

The classes these reductions name (and any class held as a value) are written by name
(``save_global``): equal descriptions hold the same class. Their metaclass must be ``type``,
``EnumType`` or ``ABCMeta``, none of which changes how a class is named or compared.
"""

from __future__ import annotations

import abc
import collections
import copyreg
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Reduction", "reduction_of"]

#: A reduction as the walk needs it: ``(callable, args, state)``; a ``None`` callable stands
#: for ``copyreg.__newobj__`` (the pickler writes ``args[0]``, ``args[1:]``, ``NEWOBJ``).
Reduced = tuple[Any, tuple[Any, ...], Any]

_METACLASSES = frozenset({type, enum.EnumType, abc.ABCMeta})
# Builtin bases whose attribute access is the generic one (their ``__getattribute__`` is
# ``PyObject_GenericGetAttr``): listed so that a namedtuple's or an IntEnum's bases pass.
_GENERIC_ACCESS = frozenset({object, tuple, int, str, float, bytes})
# Looked up on the instance by the pickler or the default reduction: an instance attribute of
# one of these names would replace the class's.
_INSTANCE_OVERRIDES = ("__reduce_ex__", "__getstate__")
_NAMEDTUPLE_GETNEWARGS = collections.namedtuple("_Probe", "a").__getnewargs__.__code__  # type: ignore[attr-defined]
_NOT_OURS = (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage, list, dict)


@dataclass(frozen=True)
class Reduction:
    """How the pickler writes the instances of one class."""

    #: The values are classes, written by name: described by themselves.
    by_name: bool = False
    #: For instances: their reduction, or ``None`` where it is not what its source returns
    #: (an override on the instance, an unexpected shape): then the object is not described.
    reduce: Callable[[Any], Reduced | None] | None = None


def reduction_of(kind: type) -> Reduction | None:
    """How the pickler writes a value of type ``kind`` (not a builtin container, scalar or
    plain tensor), if it is one the plan cache can describe; ``None`` otherwise."""
    if kind in copyreg.dispatch_table or type(kind) not in _METACLASSES:
        return None
    if issubclass(kind, type):
        return _BY_NAME if kind in _METACLASSES else None
    if issubclass(kind, _NOT_OURS) or not _generic_access(kind):
        return None
    reduce_ex = kind.__reduce_ex__
    if kind is torch.Size:
        return _SIZE if reduce_ex is object.__reduce_ex__ else None
    if issubclass(kind, enum.Enum):
        return _ENUM if reduce_ex is enum.Enum.__reduce_ex__ else None
    getnewargs = getattr(kind, "__getnewargs__", None)
    if (
        reduce_ex is object.__reduce_ex__
        and kind.__reduce__ is object.__reduce__
        and kind.__getstate__ is object.__getstate__
        and not hasattr(kind, "__getnewargs_ex__")
        and (getnewargs is None or getattr(getnewargs, "__code__", None) is _NAMEDTUPLE_GETNEWARGS)
        and not copyreg._slotnames(kind)  # type: ignore[attr-defined]
    ):
        return _DEFAULT
    return None


def _generic_access(kind: type) -> bool:
    """No class in ``kind``'s MRO but the generic builtins defines attribute access."""
    return all(
        base in _GENERIC_ACCESS
        or ("__getattribute__" not in vars(base) and "__getattr__" not in vars(base))
        for base in kind.__mro__
    )


def _overridden(value: Any) -> bool:
    attributes = getattr(value, "__dict__", None)
    return attributes is not None and any(name in attributes for name in _INSTANCE_OVERRIDES)


def _call_of(value: Any, factory: Any) -> Reduced | None:
    """``value``'s reduction when it is the plain call ``factory(*args)`` with a tuple of
    arguments (what ``torch.Size`` and enum members reduce to), else None."""
    reduced = value.__reduce_ex__(2)
    if not (
        type(reduced) is tuple
        and len(reduced) == 2
        and reduced[0] is factory
        and type(reduced[1]) is tuple
    ):
        return None
    return reduced[0], reduced[1], None


def _size(value: Any) -> Reduced | None:
    return _call_of(value, torch.Size)


def _enum(value: Any) -> Reduced | None:
    return None if _overridden(value) else _call_of(value, type(value))


def _default(value: Any) -> Reduced | None:
    if _overridden(value):
        return None
    kind = type(value)
    reduced = value.__reduce_ex__(2)
    if not (
        type(reduced) is tuple
        and len(reduced) == 5
        and reduced[0] is copyreg.__newobj__  # type: ignore[attr-defined]
        and type(reduced[1]) is tuple
        and reduced[1]
        and reduced[1][0] is kind
        and value.__class__ is kind  # the pickler refuses NEWOBJ of another class
        and reduced[3] is None
        and reduced[4] is None
    ):
        return None
    return None, reduced[1], reduced[2]


_BY_NAME = Reduction(by_name=True)
_SIZE = Reduction(reduce=_size)
_ENUM = Reduction(reduce=_enum)
_DEFAULT = Reduction(reduce=_default)
