"""The plan cache's walk in compiled code (``ckptcache/codec/table/_walk.cpp``), where the
package's C++ module is built for the running torch (:mod:`ckptcache.codec.table.native`).

:func:`walk` gives what a save reusing a plan needs: a compact key (bytes, equal for two
objects exactly when :func:`~ckptcache.codec.plan.cache.describe`'s keys are), the tensors,
the integers the key holds by width, and the storages as addresses and sizes
(:class:`Sources`), read from torch's own structures in one call. Where it is not built, or
the object holds what it does not describe, it gives ``None`` and the Python walk decides.

:func:`reference_key` runs the same compiled walker with a sink that makes ``describe``'s
own key, token for token: the plan cache stores a byte key only where, on that miss, the two
walks agree (and the tests compare them on many shapes).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from ckptcache._workers import LingeringPool
from ckptcache.codec.flatten import v3_dtypes
from ckptcache.codec.table.native import COMPILED

__all__ = ["REF", "WALKED_BY", "Sources", "Walk", "reference_key", "release", "walk"]

#: In a key: "the container or tensor first seen at ..." follows (both walks' marker).
REF = object()

#: Which walk a repeated save's plan key comes from: ``"C++"`` or ``"Python"``.
WALKED_BY = "Python" if COMPILED is None else "C++"

_policy: Any = None
_releasers: LingeringPool | None = None
_releasers_pid = 0
_releasers_lock = threading.Lock()


def _releaser() -> LingeringPool:
    """The thread that lets a walk's storages go (a forked child makes its own)."""
    global _releasers, _releasers_pid
    with _releasers_lock:
        if _releasers is None or _releasers_pid != os.getpid():
            _releasers, _releasers_pid = LingeringPool(1, "ckptcache-release"), os.getpid()
        return _releasers


def _compiled() -> Any:
    """The compiled module and its policy, or ``(None, None)`` where the Python walk runs:
    not built, or a torch function mode active (its getters would answer in Python)."""
    global _policy
    if COMPILED is None or torch._C._is_torch_function_mode_enabled():
        return None, None
    if _policy is None:
        _policy = COMPILED.WalkPolicy(
            torch.Tensor, collections.OrderedDict, REF, sorted(v3_dtypes(), key=str)
        )
    return COMPILED, _policy


class Sources(Sequence[torch.UntypedStorage]):
    """A save's storages as the compiled walk found them, in first-use order, each held alive
    while this is: their addresses and sizes as arrays for the copy (:meth:`columns`,
    :func:`~ckptcache.codec.shm.copy_sources`); their Python objects made only where
    something asks for them (a non-blocking save's snapshots, a copy off the CPU)."""

    def __init__(self, walked: Any):
        self._walked = walked
        self._count = len(walked)
        self._made: tuple[torch.UntypedStorage, ...] | None = None

    def release(self) -> None:
        """Let the storages go, on a thread of their own (dropping thousands of references
        waits on memory long out of the caches): for a save that has copied them, and needs
        them no more (a blocking one). Python objects already made stay usable."""
        if self._walked is not None and self._made is None:
            walked, self._walked = self._walked, None
            _releaser().submit(walked.release)

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The storages' addresses (``uint64``) and sizes (``int64``), read now: where the
        copy starts, not where the walk ran (a storage resized since has moved)."""
        if self._walked is None:
            raise RuntimeError("the storages were released after their copy")
        return (
            np.frombuffer(self._walked.addresses(), dtype=np.uint64),
            np.frombuffer(self._walked.sizes(), dtype=np.int64),
        )

    def _storages(self) -> tuple[torch.UntypedStorage, ...]:
        if self._made is None:
            if self._walked is None:
                raise RuntimeError("the storages were released after their copy")
            self._made = tuple(self._walked.storages())
        return self._made

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> torch.UntypedStorage: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.UntypedStorage]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self._storages()[i]

    def __iter__(self) -> Iterator[torch.UntypedStorage]:
        return iter(self._storages())


@dataclass(frozen=True)
class Walk:
    """What the compiled walk found (see :class:`~ckptcache.codec.plan.cache.Structure` for
    the fields' meaning; :attr:`key` is the compact one)."""

    key: bytes
    tensors: tuple[torch.Tensor, ...]
    ints: tuple[int, ...]
    storages: Sources
    versions: tuple[int | None, ...]
    storage_ids: tuple[int, ...]
    on_cpu: bool


def walk(obj: Any, *, versions: bool = True) -> Walk | None:
    """``obj``'s compact plan key, tensors and storages by the compiled walk; ``versions``:
    read the tensors, their version counters and storage ids too (a non-blocking save's
    check; a blocking one gets no tensors: the caller's object holds them).
    ``None`` where the compiled walk is not in use or leaves ``obj`` to the Python walk."""
    module, policy = _compiled()
    if module is None:
        return None
    try:
        walked = module.walk(policy, obj, False, versions)
    except Exception:  # a Python error met on the way (out of memory...): the Python walk's
        return None
    if walked is None:
        return None
    return Walk(
        walked.key, tuple(walked.tensors), walked.ints, Sources(walked), walked.versions,
        walked.storage_ids, walked.on_cpu,
    )  # fmt: skip


def release(storages: Sequence[torch.UntypedStorage]) -> None:
    """Let a save's storages go once copied, where the compiled walk holds them
    (:meth:`Sources.release`); nothing otherwise."""
    if isinstance(storages, Sources):
        storages.release()


def reference_key(obj: Any, *, versions: bool = False) -> Any:
    """The compiled walker's result with ``describe``'s own key (a tuple, the columns at its
    end) in ``.key`` and the columns in ``.columns``, or ``None`` where the compiled walk is
    not in use or leaves ``obj`` to the Python walk."""
    module, policy = _compiled()
    if module is None:
        return None
    return module.walk(policy, obj, True, versions)
