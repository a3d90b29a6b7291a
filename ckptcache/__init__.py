"""ckptcache: tiered in-memory checkpoint storage for PyTorch training.

Replace ``torch.save``/``torch.load`` with :func:`save`/:func:`load`; see README.md.

The public names are imported on first use (PEP 562): the daemon and the ``ckptcache`` command
import submodules of this package and must not pay for torch, which the client side needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptcache import errors
from ckptcache._version import __version__
from ckptcache.errors import *  # noqa: F403 - every public error is a public name here

if TYPE_CHECKING:
    from ckptcache.api import (
        delete,
        exists,
        load,
        load_into,
        prefetch,
        save,
        status,
        wait,
        warmup,
    )
    from ckptcache.api import open as open  # public, not in __all__ (see below)
    from ckptcache.client import CachedFile, CacheStatus, Client, SaveHandle, Staged
    from ckptcache.wire.messages import ObjectInfo as ObjectStatus

__all__ = [
    "CacheStatus",
    "CachedFile",
    "Client",
    "ObjectStatus",
    "SaveHandle",
    "Staged",
    "__version__",
    "delete",
    "exists",
    "load",
    "load_into",
    "prefetch",
    "save",
    "status",
    "wait",
    "warmup",
]
__all__ += errors.__all__  # the errors, listed once (in ckptcache.errors)

# ``ckptcache.open`` is public but left out of ``__all__``: ``from ckptcache import *`` must
# not shadow the built-in ``open``.

# Public name -> (module, attribute) for the names that pull in torch.
_LAZY = {
    **{
        n: ("ckptcache.api", n)
        for n in (
            "delete",
            "exists",
            "load",
            "load_into",
            "prefetch",
            "save",
            "status",
            "wait",
            "warmup",
        )
    },
    **{
        n: ("ckptcache.client", n)
        for n in ("CacheStatus", "CachedFile", "Client", "SaveHandle", "Staged")
    },
    "open": ("ckptcache.api", "open"),
    "ObjectStatus": ("ckptcache.wire.messages", "ObjectInfo"),
}


# Submodules reached as attributes of the package, each imported on first use (importing
# the package stays cheap): code that does ``import ckptcache`` and then uses
# ``ckptcache.api.…`` works. A few modules are also reached by a short name: format modules
# (``ckptcache.format``), codec modules and ``packing`` (``ckptcache.codec``), the command,
# bench and demo modules (``ckptcache.cli``).
_SUBMODULES = {
    "api": "ckptcache.api",
    "client": "ckptcache.client",
    "codec": "ckptcache.codec",
    "format": "ckptcache.format",
    "storage": "ckptcache.storage",
    "wire": "ckptcache.wire",
    **{n: f"ckptcache.format.{n}" for n in ("archive", "layout", "manifest")},
    **{n: f"ckptcache.codec.{n}" for n in ("flatten", "objectio", "packing", "shm")},
    **{n: f"ckptcache.cli.{n}" for n in ("bench", "benchmarking", "demo")},
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _SUBMODULES.get(name)
    if module is not None:
        return importlib.import_module(module)
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
