"""The package's C++ module (``_tensors.cpp``: a zero-copy load's dense tensors;
``_walk.cpp``: a save's walk), where it was built, and only under the torch release it was
compiled against: another release's tensor structures may differ, and it would misread them.
``CKPTCACHE_TORCH_EXTENSION=1 python setup.py build_ext --inplace`` builds it
(``scripts/setup.sh`` does)."""

from __future__ import annotations

import types

import torch

__all__ = ["COMPILED", "same_torch"]


def same_torch(built: tuple[int, int, int], running: str) -> bool:
    """Whether a module compiled against torch ``built`` (major, minor, patch) may run under
    torch ``running`` (its ``__version__``): the same release, whatever the local tag."""
    release = running.split("+", 1)[0].split(".")[:3]
    return (
        len(release) == 3
        and all(p.isdigit() for p in release)
        and (tuple(int(p) for p in release) == tuple(built))
    )


def _load() -> types.ModuleType | None:
    try:
        from ckptcache.codec.table import _tensors
    except ImportError:  # not built (no compiler, or no torch at build time)
        return None
    return _tensors if same_torch(_tensors.torch_version, torch.__version__) else None


#: The module, or ``None`` where it is not built or was built for another torch.
COMPILED: types.ModuleType | None = _load()
