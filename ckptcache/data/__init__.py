"""Restart-proof data loading: a shared-memory batch cache that survives process restarts.

``CachedDataLoader`` wraps any iterable loader; ``CachedDataModule`` (imported lazily, needs
``lightning`` or ``pytorch_lightning``) wraps a ``LightningDataModule``.
"""

from __future__ import annotations

from typing import Any

from ckptcache.data._crypto import ENV_KEY
from ckptcache.data.errors import BatchLoadError, BatchTimeout, LoaderDied
from ckptcache.data.loader import CachedDataLoader, default_cache_dir

__all__ = [
    "ENV_KEY",
    "BatchLoadError",
    "BatchTimeout",
    "CachedDataLoader",
    "CachedDataModule",
    "LoaderDied",
    "default_cache_dir",
]


def __getattr__(name: str) -> Any:
    # Lightning is optional and slow to import: only touch it when the wrapper is asked for.
    if name == "CachedDataModule":
        from ckptcache.data.lightning import CachedDataModule

        return CachedDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
