"""Megatron: a cache-backed ``dist_checkpointing`` strategy, and the legacy ``torch.save`` path.

Distributed checkpoints (megatron-core ``dist_checkpointing``)::

    from ckptcache.adapters.megatron import CacheLoadShardedStrategy, CacheSaveShardedStrategy
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=CacheSaveShardedStrategy())
    dist_checkpointing.load(sharded_sd, ckpt_dir, sharded_strategy=CacheLoadShardedStrategy())

The strategies translate MCore ``ShardedTensor``s exactly as the stock ``torch_dist`` strategy
does and hand the result to DCP with :class:`ckptcache.adapters.dcp.CacheWriter` /
``CacheReader`` (the stock strategy's async writer calls CUDA APIs; these run on CPU). The
checkpoint records backend ``torch_dist`` version 1, so the stock strategy loads it once it is
persisted, and these load it from memory before that, at any parallelism. ``register()``
also makes them the defaults for ``("ckptcache", 1)``.

Legacy checkpoints (Megatron-LM ``--ckpt-format torch``)::

    import ckptcache.adapters.megatron
    ckptcache.adapters.megatron.enable()   # before pretrain()

Megatron-LM saves ``iter_XXXXXXX/mp_rank_XX[_XXX]/model_optim_rng.pt`` with its module-level
``torch.save`` and loads it with ``torch.load``; ``enable`` replaces that module's ``torch`` by
a proxy whose ``save``/``load`` go through the cache (everything else is the real ``torch``),
and makes its ``isfile`` see cached files. The tracker ``latest_checkpointed_iteration.txt``
stays the plain text file Megatron writes after its post-save barrier; it cannot be a cached
object because the cache persists ``torch.save`` archives. What changes is what it follows:
with ``commit_waits="files"`` (default; ``$CKPTCACHE_COMMIT_WAITS`` changes it) every rank's
``torch.save`` returns only after its file exists and holds the new save (persisted, or
written by the adapter when no persist root covers it), so the tracker never names an
iteration whose files are not all readable, and Megatron's own tools (checkpoint converters,
a plain ``torch.load``) read the checkpoint right after the save, as without the cache; with
``"persisted"`` only after its file is in storage; with ``"local"`` after phase 1 (the
tracker may then name an iteration whose files appear later).
"""

from __future__ import annotations

import importlib
import os
import types
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.base import (
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import nested_values

import ckptcache
from ckptcache.adapters import _common
from ckptcache.adapters.dcp import CacheReader, CacheWriter

__all__ = [
    "BACKEND",
    "CacheLoadShardedStrategy",
    "CacheSaveShardedStrategy",
    "disable",
    "enable",
    "register",
]

#: The format written: the stock one, so Megatron's own strategy reads persisted checkpoints.
BACKEND = ("torch_dist", 1)
#: Extra name these strategies are registered under by :func:`register`.
ALIAS = ("ckptcache", 1)


class CacheSaveShardedStrategy(SaveShardedStrategy):  # type: ignore[misc]
    """Save MCore sharded tensors as a DCP (``torch_dist``) checkpoint through the cache.

    ``keep_only_main_replica`` as in the stock strategy (each shard written once, by its main
    replica); ``commit_waits`` and ``client`` as for :class:`~ckptcache.adapters.dcp.CacheWriter`.
    """

    def __init__(
        self,
        backend: str = BACKEND[0],
        version: int = BACKEND[1],
        *,
        keep_only_main_replica: bool = True,
        commit_waits: str | None = None,
        client: ckptcache.Client | None = None,
    ):
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.commit_waits = _common.resolve_commit_waits(commit_waits)
        self.client = client

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path | str) -> None:
        """Translate to PyTorch ``ShardedTensor``s and save with DCP into ``checkpoint_dir``."""
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        dcp.save(
            pyt_state_dict,
            storage_writer=CacheWriter(
                checkpoint_dir, commit_waits=self.commit_waits, client=self.client
            ),
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            ),
        )

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Sharded objects travel as DCP bytes items."""
        return True


class CacheLoadShardedStrategy(TorchDistLoadShardedStrategy):  # type: ignore[misc]
    """Load a ``torch_dist`` checkpoint, cached items from memory and the rest from files.

    Metadata queries (``load_tensors_metadata``…) are the stock strategy's: they read the
    ``.metadata`` file, which is always written straight to the checkpoint directory.
    """

    def __init__(self, *, client: ckptcache.Client | None = None):
        super().__init__()
        self.client = client

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path | str) -> StateDict:
        """Load into ``sharded_state_dict``'s shards (any parallelism: DCP reshards)."""
        values = list(nested_values(sharded_state_dict))
        shape_checked = [
            t for t in values if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch
        ]
        mismatch_ok = {
            t.key: t for t in values if isinstance(t, ShardedTensor) and t.allow_shape_mismatch
        }
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = (
            _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = CacheReader(checkpoint_dir, client=self.client)
        dcp.load(
            pyt_state_dict,
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=shape_checked,
                allow_shape_mismatch_sharded_tensors=mismatch_ok,
            ),
        )
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return cast(StateDict, state)


def register() -> None:
    """Register the strategies as the defaults for ``("ckptcache", 1)``."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, *ALIAS, CacheSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, *ALIAS, CacheLoadShardedStrategy())


# --------------------------------------------------------------------------- legacy path


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike))


class _TorchProxy(types.ModuleType):
    """``torch`` as seen by Megatron-LM's checkpointing module: ``save``/``load`` of paths go
    through the cache, file objects and every other attribute are the real ``torch``."""

    def __init__(self, client: ckptcache.Client | None, commit_waits: str):
        super().__init__("torch")
        self._ckptcache_client = client
        self._ckptcache_commit_waits = commit_waits

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not _is_path(f) or args:
            return torch.save(obj, f, *args, **kwargs)  # streams, or pickle options: as is
        path = os.fspath(f)
        _common.client_of(self._ckptcache_client).save(obj, path)
        # Megatron barriers right after this call and then writes the tracker.
        _common.settle(
            self._ckptcache_client, [os.path.abspath(path)], self._ckptcache_commit_waits
        )
        return None

    def load(self, f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not _is_path(f) or args or set(kwargs) - {"weights_only", "mmap"}:
            return torch.load(f, map_location, *args, **kwargs)
        client = _common.client_of(self._ckptcache_client)
        # torch.load's own default (weights_only=True) applies when Megatron passes none.
        weights_only = kwargs.get("weights_only")
        return client.load(
            f,
            map_location,
            weights_only=True if weights_only is None else bool(weights_only),
            mmap=kwargs.get("mmap"),
        )


def _target(module: types.ModuleType | str | None) -> types.ModuleType:
    if module is None:
        module = "megatron.training.checkpointing"
    return importlib.import_module(module) if isinstance(module, str) else module


def enable(
    module: types.ModuleType | str | None = None,
    *,
    commit_waits: str | None = None,
    client: ckptcache.Client | None = None,
) -> None:
    """Route Megatron-LM's legacy ``torch.save``/``torch.load`` checkpoints through the cache.

    ``module``: the module whose global ``torch`` does the checkpoint I/O (default
    ``megatron.training.checkpointing``); ``commit_waits`` as in the module docstring.
    Idempotent; :func:`disable` undoes it.
    """
    mod = _target(module)
    commit_waits = _common.resolve_commit_waits(commit_waits)
    if not isinstance(mod.__dict__.get("torch"), _TorchProxy):
        mod.__dict__["__ckptcache_saved__"] = {
            k: mod.__dict__[k] for k in ("torch", "isfile") if k in mod.__dict__
        }
    mod.torch = _TorchProxy(client, commit_waits)  # type: ignore[attr-defined]
    original_isfile = mod.__dict__["__ckptcache_saved__"].get("isfile", os.path.isfile)

    def isfile(filename: Any) -> bool:
        """Megatron's ``isfile``, true also for a checkpoint the cache holds."""
        if original_isfile(filename):
            return True
        return _is_path(filename) and _common.client_of(client).exists(os.fspath(filename))

    if "isfile" in mod.__dict__:
        mod.isfile = isfile  # type: ignore[attr-defined]


def disable(module: types.ModuleType | str | None = None) -> None:
    """Undo :func:`enable` on ``module``."""
    mod = _target(module)
    saved = mod.__dict__.pop("__ckptcache_saved__", None)
    if saved:
        mod.__dict__.update(saved)
