"""DeepSpeed: a ``CheckpointEngine`` backed by the cache, switched on with one call.

::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, ...)
    ckptcache.adapters.deepspeed.enable(engine)          # the one added line
    engine.save_checkpoint(save_dir)                     # phase 1 only: a memcpy
    engine.load_checkpoint(save_dir)                     # from memory after a crash

The files are DeepSpeed's own (``<save_dir>/<tag>/mp_rank_00_model_states.pt``,
``zero_pp_rank_*_optim_states.pt``, ``latest``), so DeepSpeed's default engine, ``zero_to_fp32``
and ``torch.load`` read them once persisted.

How DeepSpeed drives the engine (0.19): ``save_checkpoint`` calls ``makedirs``, ``create(info)``,
``save(state_dict, path)`` per file, then ``commit(info)``, and then rank 0 writes ``latest``
itself with ``open()``. ``load_checkpoint`` reads ``latest`` and globs / ``os.path``-checks the
payload files *before* it calls ``engine.load``. Hence two decisions:

* ``commit_waits="local"`` (default): ``commit`` returns at once (phase 1 done), so ``latest``
  names the new tag while persistence is still running. A restart on the same node resumes
  from memory; losing the node before persistence ends leaves ``latest`` ahead of storage.
  ``commit_waits="persisted"``: each rank waits until its own files are persisted and then
  all ranks meet in a barrier, so ``latest`` is written only once every file is in storage.
* ``enable`` wraps ``engine.load_checkpoint``: before DeepSpeed looks at the directory, every
  cached object of the tag that is not yet a file is made one, by waiting for the daemon's
  in-flight persist of it (never a second writer), or, for objects outside every persist root,
  by writing it once with temp + rename. The payloads themselves are then still read from
  memory through ``CkptCacheCheckpointEngine.load``. Waiting rather than faking ``os.path``
  keeps DeepSpeed's own checks (glob, ``assert os.path.exists``) meaningful.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import ckptcache
from ckptcache.adapters import _common

__all__ = ["CkptCacheCheckpointEngine", "enable", "prepare_load"]

ENGINE_NAME = "CkptCacheCheckpointEngine"


class CkptCacheCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` whose ``save`` is a cache save (phase 1 only).

    ``commit_waits`` is ``"local"`` or ``"persisted"`` (see the module docstring); ``client``
    defaults to the process's default client (``$CKPTCACHE_SOCKET``).
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        commit_waits: str = "local",
        client: ckptcache.Client | None = None,
    ):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.commit_waits = _common.check_commit_waits(commit_waits)
        self._client = client
        self._saved: list[str] = []

    @property
    def client(self) -> ckptcache.Client:
        """The client this engine saves through."""
        return _common.client_of(self._client)

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start a checkpoint (tag): forget the files of the previous one."""
        self._saved = []

    def save(self, state_dict: Any, path: str) -> None:
        """Hand ``state_dict`` to the cache under DeepSpeed's file name (phase 1)."""
        self.client.save(state_dict, path)
        self._saved.append(path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load from memory when cached, else from the file (DeepSpeed unpickles fully too)."""
        return _common.load_any(self.client, path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """All files of ``info.tag`` were handed over; with ``commit_waits="persisted"`` wait
        until they are in storage on every rank before DeepSpeed writes ``latest``."""
        if self.commit_waits == "persisted":
            for path in self._saved:
                _common.wait_persisted(self._client, path)
            # DeepSpeed's rank 0 writes `latest` right after its own commit returns; without
            # this barrier it could name a tag whose files other ranks are still persisting.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        self._saved = []
        return True


def _resolve_tag(load_dir: str, tag: Any, universal: bool) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(latest):
        return None  # DeepSpeed itself warns and returns (None, None)
    with open(latest) as f:
        return f.read().strip()


def prepare_load(load_dir: str, tag: str, client: ckptcache.Client | None = None) -> int:
    """Make every cached object of ``load_dir/tag`` visible as a file; returns how many were
    not files yet. Called by the wrapped ``load_checkpoint``; usable on its own."""
    c = _common.client_of(client)
    missing = [
        info
        for info in _common.cached_under(c, os.path.join(load_dir, tag))
        if not os.path.exists(info.path)
    ]
    for info in missing:
        _common.ensure_on_disk(c, info)
    return len(missing)


def enable(
    engine: Any,
    *,
    commit_waits: str = "local",
    client: ckptcache.Client | None = None,
) -> CkptCacheCheckpointEngine:
    """Route ``engine.save_checkpoint``/``load_checkpoint`` through the cache.

    Call once after ``deepspeed.initialize`` on every rank. Replaces ``engine.checkpoint_engine``
    and wraps ``engine.load_checkpoint`` (see the module docstring); returns the new engine.
    """
    ckpt_engine = CkptCacheCheckpointEngine(
        getattr(engine, "_config", None), commit_waits=commit_waits, client=client
    )
    engine.checkpoint_engine = ckpt_engine
    original = getattr(engine.load_checkpoint, "__ckptcache_original__", engine.load_checkpoint)

    @functools.wraps(original)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        universal = bool(getattr(engine, "load_universal_checkpoint", lambda: False)())
        resolved = _resolve_tag(load_dir, tag, universal)
        if resolved is not None:
            prepare_load(load_dir, resolved, client)
        return original(load_dir, tag, *args, **kwargs)

    load_checkpoint.__ckptcache_original__ = original  # type: ignore[attr-defined]
    engine.load_checkpoint = load_checkpoint
    return ckpt_engine
