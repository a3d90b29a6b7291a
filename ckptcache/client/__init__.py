"""The trainer side: the client of the local daemon, and what is built on it.

``Client`` (:mod:`ckptcache.client._client`) is the face; its parts, one job a module, are
made and wired in :mod:`ckptcache.client._parts`. The names below are the package's public
face, the one the adapters import; those that need torch are imported on first use (PEP 562),
so a control-plane command that imports the client starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptcache.client._client import Client
from ckptcache.client._health import CacheStatus, cache_status
from ckptcache.client._paths import in_storage, normalize_path
from ckptcache.client._readthrough import (
    BlobFile,
    CachedFile,
    open_checkpoint,
    write_from_memory,
)
from ckptcache.client._saves import DURABILITY_LEVELS

if TYPE_CHECKING:
    from ckptcache.client._async import SaveHandle, wait_for_copies
    from ckptcache.client._staging import Staged
    from ckptcache.codec.packing import Packed

__all__ = [
    "DURABILITY_LEVELS",
    "BlobFile",
    "CacheStatus",
    "CachedFile",
    "Client",
    "Packed",
    "SaveHandle",
    "Staged",
    "cache_status",
    "in_storage",
    "normalize_path",
    "open_checkpoint",
    "wait_for_copies",
    "write_from_memory",
]

# Public name -> module, for the names that pull in torch. ``Packed`` is what
# ``Client.save_packed`` takes.
_LAZY = {
    "SaveHandle": "ckptcache.client._async",
    "wait_for_copies": "ckptcache.client._async",
    "Packed": "ckptcache.codec.packing",
    "Staged": "ckptcache.client._staging",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
