"""Lightning: a ``CheckpointIO`` plugin that saves through the cache.

::

    from ckptcache.adapters.lightning import CkptCacheIO
    trainer = lightning.Trainer(..., plugins=[CkptCacheIO()])     # the one added argument
    trainer.fit(model, ckpt_path=path_of_the_last_checkpoint)    # resumes from memory

Checkpoint files keep Lightning's names and format (``epoch=0-step=8.ckpt``, ``last.ckpt``):
``ModelCheckpoint`` decides paths, this plugin only replaces the write (phase 1 into the cache,
persisted by the daemon) and the read (memory first, then the file). ``CkptCacheIO`` subclasses
``lightning.fabric``'s ``CheckpointIO``; for the standalone ``pytorch_lightning`` package use
``PLCkptCacheIO`` (``lightning_fabric``'s base class), the same plugin.

**When the file exists: ``commit_waits``.** Lightning's own code lists and checks the
checkpoint directory (``ckpt_path="last"``, ``ModelCheckpoint``'s free-name choice and
``save_last`` link, a ``torch.load`` in a callback), so by default (``commit_waits="files"``,
or ``$CKPTCACHE_COMMIT_WAITS``) ``save_checkpoint`` returns once the ``.ckpt`` file exists and
holds the new save: persisted by the daemon, or, under no persist root, written by the plugin
(temp + rename). ``"persisted"`` waits for storage (``PathNotAllowed`` under no persist root);
``"local"`` returns after the copy into the cache, and the file appears when persisted.
Wrapping the plugin in Lightning's ``AsyncCheckpointIO`` moves that wait (and the copy) to
Lightning's checkpoint thread: ``AsyncCheckpointIO(CkptCacheIO())``.

With ``"local"``, ``ckpt_path="last"`` lists only persisted files: pass the path explicitly to
resume before persistence has finished. ``ModelCheckpoint`` picks a free name (``m.ckpt``,
then ``m-v1.ckpt``, ...) by checking which files exist, and a checkpoint not yet persisted is
no file: with a ``filename`` that names no epoch or step, kept checkpoints would overwrite each
other. ``CkptCacheModelCheckpoint`` (``PLCkptCacheModelCheckpoint``), a ``ModelCheckpoint``
with the same arguments, also asks the cache::

    trainer = lightning.Trainer(..., plugins=[CkptCacheIO(commit_waits="local")],
                                callbacks=[CkptCacheModelCheckpoint(filename="m", save_top_k=3)])
"""

from __future__ import annotations

import importlib
import os
import shutil
from typing import Any

import ckptcache
from ckptcache.adapters import _common
from ckptcache.client import normalize_path
from ckptcache.storage import backend_for

__all__ = [  # noqa: F822 - built lazily by __getattr__
    "CkptCacheIO",
    "CkptCacheModelCheckpoint",
    "PLCkptCacheIO",
    "PLCkptCacheModelCheckpoint",
]


def _storage_as_loaded(storage: Any, location: str) -> Any:
    """Lightning's default ``map_location``: every storage stays where it was loaded, on
    the CPU (a checkpoint saved on GPUs loads on a machine without one)."""
    return storage


_is_url = _common.is_url


def _remove_stored(path: str) -> None:
    """What ``TorchCheckpointIO.remove_checkpoint`` does: remove ``path`` from its file system,
    recursively (a directory checkpoint, e.g. ``DeepSpeedStrategy``'s), if it exists. URLs go
    through fsspec as Lightning's do, or the cache's own storage backend (one object) where
    fsspec has no implementation installed for the scheme."""
    if not _is_url(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        return
    try:
        from fsspec.core import url_to_fs

        fs, _ = url_to_fs(path)
    except (ImportError, ValueError):
        backend = backend_for(path)
        if backend.exists(path):
            backend.delete(path)
        return
    if fs.exists(path):
        fs.rm(path, recursive=True)


class _CacheIOMixin:
    """The plugin's behaviour, shared by the ``lightning`` and ``pytorch_lightning`` classes."""

    def __init__(
        self,
        *,
        commit_waits: str | None = None,
        durability: str = "local",
        client: ckptcache.Client | None = None,
    ):
        super().__init__()
        self.commit_waits = _common.resolve_commit_waits(commit_waits)
        self.durability = durability
        self._client = client

    @property
    def client(self) -> ckptcache.Client:
        """The client this plugin talks to."""
        return _common.client_of(self._client)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Hand ``checkpoint`` to the cache under ``path``; return once ``commit_waits``
        holds (by default: the file exists and holds this save)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = normalize_path(path)
        if not _is_url(path):
            # The daemon persists into this directory; Lightning expects it to exist afterwards.
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.client.save(checkpoint, path, durability=self.durability)
        _common.settle(self._client, [path], self.commit_waits)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = _storage_as_loaded,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` from memory, else from the file. As ``TorchCheckpointIO``: by default
        every tensor loads to the CPU, wherever it was saved; ``weights_only=None`` is torch's
        default (``True``), as for Lightning's own local loads."""
        if not self.client.exists(os.fspath(path)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return self.client.load(  # type: ignore[no-any-return]
            os.fspath(path),
            map_location,
            weights_only=True if weights_only is None else weights_only,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Drop ``path`` from the cache and from storage (``ModelCheckpoint``'s top-k pruning),
        as ``TorchCheckpointIO`` does: recursively for a directory checkpoint (every object
        the cache holds below it too), URLs kept as URLs.

        An object whose persist is still running is waited for first: deleting the file
        while the daemon writes it would let the daemon's rename bring it back.
        """
        path = normalize_path(path)
        client = self.client
        info = _common.cached_status(client, path)
        held = [info] if info is not None and _common.in_memory(info) else []
        held += _common.cached_under(client, path)  # a directory checkpoint's files
        for obj in held:
            if not _common.is_persisted(obj) and not _common.is_memory_only(obj):
                try:
                    _common.wait_persisted(client, obj.path)
                except ckptcache.CheckpointDeleted:
                    pass  # its directory is already gone: nothing will come back
            client.delete(obj.path)
        _remove_stored(path)


class _CacheAwareCheckpointMixin:
    """``ModelCheckpoint`` whose file-name choice also sees the checkpoints the cache holds and
    has not persisted yet (``ModelCheckpoint`` picks ``m.ckpt``, ``m-v1.ckpt``, ... by checking
    which names exist; without this, a name whose file is not written yet looks free and a
    later save takes it, overwriting a kept top-k checkpoint)."""

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        """Lightning's check (rank 0's file system, reduced over the ranks), then rank 0's
        cache: the same collectives, in the same order, on every rank."""
        if super().file_exists(filepath, trainer):  # type: ignore[misc]
            return True
        held = bool(trainer.is_global_zero) and _client_of_trainer(trainer).exists(
            os.fspath(filepath)
        )
        return bool(trainer.strategy.reduce_boolean_decision(held, all=False))


def _client_of_trainer(trainer: Any) -> ckptcache.Client:
    """The client of the trainer's ``CkptCacheIO`` plugin, else the process's default."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    return io.client if isinstance(io, _CacheIOMixin) else _common.client_of(None)


def _plugin(base_module: str, name: str) -> type:
    base = importlib.import_module(base_module).CheckpointIO
    doc = f"{_CacheIOMixin.__doc__}\n\nA ``{base_module}.CheckpointIO``."
    return type(name, (_CacheIOMixin, base), {"__doc__": doc, "__module__": __name__})


def _callback(base_module: str, name: str) -> type:
    base = importlib.import_module(base_module).ModelCheckpoint
    doc = f"{_CacheAwareCheckpointMixin.__doc__}\n\nA ``{base_module}.ModelCheckpoint``."
    return type(name, (_CacheAwareCheckpointMixin, base), {"__doc__": doc, "__module__": __name__})


_LAZY = {
    "CkptCacheIO": (_plugin, "lightning.fabric.plugins"),
    "PLCkptCacheIO": (_plugin, "lightning_fabric.plugins"),
    "CkptCacheModelCheckpoint": (_callback, "lightning.pytorch.callbacks"),
    "PLCkptCacheModelCheckpoint": (_callback, "pytorch_lightning.callbacks"),
}


def __getattr__(name: str) -> Any:
    # Built on first use so that importing this module needs only the flavour you use.
    if name not in _LAZY:
        raise AttributeError(name)
    build, module = _LAZY[name]
    cls = build(module, name)
    globals()[name] = cls
    return cls
