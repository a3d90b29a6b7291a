"""DeepSpeed: a ``CheckpointEngine`` backed by the cache, switched on once per process.

::

    import ckptcache.adapters.deepspeed
    ckptcache.adapters.deepspeed.enable()     # once, before any deepspeed.initialize
    cfg["checkpoint"] = {"ckptcache": {"commit_waits": "local"}}   # optional, per engine
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, ...)
    engine.save_checkpoint(save_dir)          # phase 1 only: a memcpy
    engine.load_checkpoint(save_dir)          # from memory after a crash

``enable()`` without an engine hooks DeepSpeed's checkpoint-engine factory (DeepSpeed 0.19
picks its engine from its own classes only; there is no plug-in entry), so every engine built
afterwards, by your code, by Lightning's ``DeepSpeedStrategy`` or by the HF ``Trainer``, saves
and loads through the cache. Per-engine settings come from the DeepSpeed config:
``"checkpoint": {"ckptcache": {"enabled": true, "commit_waits": "files"}}`` (DeepSpeed ignores
the key); ``"enabled": false`` keeps an engine on DeepSpeed's own writer. Precedence:
config, then ``enable(commit_waits=...)``, then ``$CKPTCACHE_COMMIT_WAITS``, then ``"local"``.
``enable(engine)`` still switches one existing engine. ``disable()`` removes the hook.

**No code at all:** ``CKPTCACHE_DEEPSPEED=1`` in the environment (or ``=files``, ``=persisted``,
``=local``: on, with that ``commit_waits``) does what ``enable()`` does, in every process that
inherits it, as soon as the process imports ``deepspeed``: the installed package puts a
startup hook (``ckptcache-startup.pth``) in ``site-packages`` that checks the variable at
interpreter start and costs one lookup when it is unset (see ``ckptcache._startup``).

The files are DeepSpeed's own (``<save_dir>/<tag>/mp_rank_00_model_states.pt``,
``zero_pp_rank_*_optim_states.pt``, ``latest``), so DeepSpeed's default engine, ``zero_to_fp32``
and ``torch.load`` read them once persisted.

How DeepSpeed drives the engine (0.19): ``save_checkpoint`` calls ``makedirs``, ``create(info)``,
``save(state_dict, path)`` per file, then ``commit(info)``, and then rank 0 writes ``latest``
itself with ``open()``. ``load_checkpoint`` reads ``latest`` and globs / ``os.path``-checks the
payload files *before* it calls ``engine.load``. Hence two decisions:

* ``commit_waits="local"`` (default): ``commit`` returns at once (phase 1 done), so ``latest``
  names the new tag while persistence is still running. A restart on the same node resumes
  from memory; losing the node before persistence ends leaves ``latest`` ahead of storage,
  and tools that open the files right after the save (``torch.load`` of
  ``mp_rank_00_model_states.pt``, ``zero_to_fp32``) must go through the cache
  (``ckptcache.load``, or ``torch.load(ckptcache.open(path))``) or wait
  (``ckptcache.wait(prefix=save_dir)``).
  ``commit_waits="persisted"``: each rank waits until its own files are persisted and then
  all ranks meet in a barrier, so ``latest`` is written only once every file is in storage.
  ``commit_waits="files"``: the same, except that files under no persist root are written by
  the adapter (temp + rename): ``save_checkpoint`` returns once every file exists and holds
  the new save (a fixed tag saved again, as Lightning's ``DeepSpeedStrategy`` does, included),
  and every call DeepSpeed's own tests and tools make after a save behaves as without the cache.
* ``enable`` wraps ``engine.load_checkpoint``: before DeepSpeed looks at the directory, every
  cached object of the tag whose newest generation is not yet the file (no file, or the file
  of an earlier save of the tag) is made one, by waiting for the daemon's
  in-flight persist of it (never a second writer), or, for objects outside every persist root,
  by writing it once with temp + rename. The payloads themselves are then still read from
  memory through ``CkptCacheCheckpointEngine.load``. Waiting rather than faking ``os.path``
  keeps DeepSpeed's own checks (glob, ``assert os.path.exists``) meaningful.
"""

from __future__ import annotations

import functools
import os
from typing import Any, cast

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import ckptcache
from ckptcache.adapters import _common

__all__ = [
    "CkptCacheCheckpointEngine",
    "disable",
    "enable",
    "enable_from_env",
    "is_enabled",
    "prepare_load",
]

ENGINE_NAME = "CkptCacheCheckpointEngine"
#: The key inside the DeepSpeed config's ``"checkpoint"`` section that this adapter reads.
CONFIG_KEY = "ckptcache"
#: Default ``commit_waits`` for engines switched on by the process-wide hook.
ENV_COMMIT_WAITS = "CKPTCACHE_COMMIT_WAITS"


class CkptCacheCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` whose ``save`` is a cache save (phase 1 only).

    ``commit_waits`` is ``"local"``, ``"persisted"`` or ``"files"`` (see the module
    docstring); ``client`` defaults to the process's default client (``$CKPTCACHE_SOCKET``).
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
        if self.commit_waits != "local":
            _common.settle(self._client, self._saved, self.commit_waits)
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
    """Make every cached object of ``load_dir/tag`` a file holding its newest generation (a
    file left by an earlier save of the same tag does not count); returns how many were not.
    Called by the wrapped ``load_checkpoint``; usable on its own."""
    c = _common.client_of(client)
    missing = [
        info
        for info in _common.cached_under(c, os.path.join(load_dir, tag))
        if not _common.file_is_current(info)
    ]
    for info in missing:
        _common.ensure_on_disk(c, info)
    return len(missing)


def _wrap_load(original: Any) -> Any:
    """``load_checkpoint`` that first makes the tag's cached objects files (see above)."""
    original = getattr(original, "__ckptcache_original__", original)

    @functools.wraps(original)
    def load_checkpoint(self: Any, load_dir: str, tag: Any = None, *args: Any, **kw: Any) -> Any:
        ckpt_engine = getattr(self, "checkpoint_engine", None)
        if isinstance(ckpt_engine, CkptCacheCheckpointEngine):
            universal = bool(getattr(self, "load_universal_checkpoint", lambda: False)())
            resolved = _resolve_tag(load_dir, tag, universal)
            if resolved is not None:
                prepare_load(load_dir, resolved, ckpt_engine._client)
        return original(self, load_dir, tag, *args, **kw)

    load_checkpoint.__ckptcache_original__ = original  # type: ignore[attr-defined]
    return load_checkpoint


def enable(
    engine: Any = None,
    *,
    commit_waits: str | None = None,
    client: ckptcache.Client | None = None,
) -> CkptCacheCheckpointEngine | ckptcache.CacheStatus:
    """Route ``save_checkpoint``/``load_checkpoint`` through the cache.

    Without ``engine`` (recommended): hook DeepSpeed so that every engine built from now on in
    this process uses the cache (see the module docstring for the config key); returns whether
    the cache is reachable (and logs it; ``CKPTCACHE_REQUIRE=1`` raises
    :class:`ckptcache.DaemonUnavailable` instead). With ``engine``: switch that existing engine
    (call after ``deepspeed.initialize`` on every rank); returns its new checkpoint engine.
    """
    if commit_waits is not None:
        _common.check_commit_waits(commit_waits)
    if engine is None:
        return cast(ckptcache.CacheStatus, _install(commit_waits, client))
    ckpt_engine = CkptCacheCheckpointEngine(
        getattr(engine, "_config", None), commit_waits=commit_waits or "local", client=client
    )
    engine.checkpoint_engine = ckpt_engine
    wrapped = _wrap_load(type(engine).load_checkpoint)
    engine.load_checkpoint = functools.partial(wrapped, engine)
    return ckpt_engine


_HOOK: dict[str, Any] = {}


def _options(config_params: Any) -> dict[str, Any] | None:
    """This engine's ``"checkpoint": {"ckptcache": {...}}`` settings (``None``: opted out)."""
    raw = getattr(config_params, "_param_dict", None) or {}
    section = (raw.get("checkpoint") or {}).get(CONFIG_KEY, {})
    if section is True or section is None:
        section = {}
    if section is False:
        return None
    if not isinstance(section, dict):
        raise ckptcache.ConfigError(
            f'DeepSpeed config "checkpoint.{CONFIG_KEY}" must be an object or a boolean, '
            f"not {section!r}"
        )
    unknown = set(section) - {"enabled", "commit_waits"}
    if unknown:
        raise ckptcache.ConfigError(
            f'unknown keys in DeepSpeed config "checkpoint.{CONFIG_KEY}": {sorted(unknown)}; '
            "allowed: enabled, commit_waits"
        )
    return None if section.get("enabled", True) is False else section


def enable_from_env() -> ckptcache.CacheStatus | None:
    """What ``CKPTCACHE_DEEPSPEED`` asks for (see ``ckptcache._startup``): with it on, the
    process-wide hook of :func:`enable`, ``commit_waits`` from its value if it names one.

    Called by the startup hook when ``deepspeed`` is imported; reachability is reported when
    the first engine is built (so importing DeepSpeed never connects to a daemon). Returns
    ``None`` (and installs nothing) when the variable is off; a bad value raises
    :class:`ckptcache.ConfigError`.
    """
    from ckptcache._startup import deepspeed_setting

    setting = deepspeed_setting()
    if setting is None:
        return None
    return _install(setting or None, None, report=False)


def _install(
    commit_waits: str | None, client: ckptcache.Client | None, *, report: bool = True
) -> ckptcache.CacheStatus | None:
    import deepspeed.runtime.engine as ds_engine

    factory = _HOOK.get("factory", ds_engine.create_checkpoint_engine)
    unreported = [] if report else [True]

    def create_checkpoint_engine(config_params: Any, *args: Any, **kwargs: Any) -> Any:
        options = _options(config_params)
        if options is None:
            return factory(config_params, *args, **kwargs)
        if unreported:
            # Enabled from the environment: say once, at the first engine, whether the cache
            # is reachable (CKPTCACHE_REQUIRE=1 makes an unreachable one an error here).
            unreported.clear()
            _common.report_enabled("DeepSpeed", client)
        waits = options.get("commit_waits") or commit_waits or os.environ.get(ENV_COMMIT_WAITS)
        return CkptCacheCheckpointEngine(
            config_params,
            commit_waits=_common.check_commit_waits(waits or "local"),
            client=client,
        )

    if not _HOOK:
        _HOOK["factory"] = factory
        _HOOK["load_checkpoint"] = ds_engine.DeepSpeedEngine.load_checkpoint
    cast(Any, ds_engine).create_checkpoint_engine = create_checkpoint_engine
    ds_engine.DeepSpeedEngine.load_checkpoint = _wrap_load(_HOOK["load_checkpoint"])
    return _common.report_enabled("DeepSpeed", client) if report else None


def disable() -> None:
    """Remove the process-wide hook: engines built afterwards use DeepSpeed's own writer."""
    if not _HOOK:
        return
    import deepspeed.runtime.engine as ds_engine

    cast(Any, ds_engine).create_checkpoint_engine = _HOOK.pop("factory")
    ds_engine.DeepSpeedEngine.load_checkpoint = _HOOK.pop("load_checkpoint")


def is_enabled() -> bool:
    """Whether the process-wide hook is installed."""
    return bool(_HOOK)
