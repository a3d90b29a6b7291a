"""DeepSpeed: a ``CheckpointEngine`` backed by the cache, switched on once per process.

::

    import ckptcache.adapters.deepspeed
    ckptcache.adapters.deepspeed.enable()     # once, before any deepspeed.initialize
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, ...)
    engine.save_checkpoint(save_dir)          # returns once every file is readable
    engine.load_checkpoint(save_dir)          # from memory after a crash

``enable()`` without an engine hooks DeepSpeed's checkpoint-engine factory (DeepSpeed 0.19
picks its engine from its own classes only; there is no plug-in entry), so every engine built
afterwards, by your code, by Lightning's ``DeepSpeedStrategy`` or by the HF ``Trainer``, saves
and loads through the cache. Per-engine settings come from the DeepSpeed config:
``"checkpoint": {"ckptcache": {"enabled": true, "commit_waits": "local", "decoupled": true}}``
(DeepSpeed ignores the key); ``"enabled": false`` keeps an engine on DeepSpeed's own writer.
Precedence: config, then ``enable(commit_waits=...)``, then ``$CKPTCACHE_COMMIT_WAITS``, then
``"files"``. ``enable(engine)`` still switches one existing engine. ``disable()`` removes the
hook.

**No code at all:** ``CKPTCACHE_DEEPSPEED=1`` in the environment (or ``=files``, ``=persisted``,
``=local``: on, with that ``commit_waits``) does what ``enable()`` does, in every process that
inherits it, as soon as the process imports ``deepspeed``: the installed package puts a
startup hook (``ckptcache-startup.pth``) in ``site-packages`` that checks the variable at
interpreter start and costs one lookup when it is unset (see ``ckptcache.adapters._startup``).

The files are DeepSpeed's own (``<save_dir>/<tag>/mp_rank_00_model_states.pt``,
``zero_pp_rank_*_optim_states.pt``, ``latest``), so DeepSpeed's default engine, ``zero_to_fp32``
and ``torch.load`` read them.

How DeepSpeed drives the engine (0.19): ``save_checkpoint`` calls ``makedirs``, ``create(info)``,
``save(state_dict, path)`` per file, then ``commit(info)``, and then rank 0 writes ``latest``
itself with ``open()``. A *decoupled* engine (DeepSpeed's own asynchronous protocol,
``is_decoupled()``) is committed later instead: at the next optimizer step, where DeepSpeed
calls ``commit`` and only then writes ``latest``. ``load_checkpoint`` reads ``latest`` and
globs / ``os.path``-checks the payload files *before* it calls ``engine.load``. Hence:

* ``commit_waits="files"`` (default): ``commit`` returns once each of the rank's files exists
  and holds the new save (persisted by the daemon, or, under no persist root, written by the
  adapter with temp + rename), then all ranks meet in a barrier, so ``latest`` never names a
  tag whose files are not all readable. What DeepSpeed's tests and tools do right after
  ``save_checkpoint`` (``torch.load`` of ``mp_rank_00_model_states.pt``, ``zero_to_fp32``,
  a fixed tag saved again, as Lightning's ``DeepSpeedStrategy`` does) behaves as without the
  cache. The stall is the copy plus the wait for storage.
* ``"decoupled": true`` (or DeepSpeed's own ``"checkpoint": {"writer": {"decoupled": true}}``):
  ``save_checkpoint`` returns after the copy into the cache, and the wait of ``commit_waits``
  moves to the next optimizer step, by which time the daemon has usually persisted the files;
  ``latest`` (written by DeepSpeed after that commit) keeps naming the previous, complete tag
  until then. This is DeepSpeed's contract for decoupled engines: a tool that reads the new
  tag's files before the next step must go through the cache (``ckptcache.open``) or wait.
  :func:`flush` commits a pending save at once (on every rank), e.g. after the last step.
* ``commit_waits="persisted"``: as ``"files"``, but every file must be in storage (raises
  ``PathNotAllowed`` under no persist root). ``commit_waits="local"``: ``commit`` returns at
  once, so ``latest`` names the new tag while persistence is still running: a restart on the
  same node resumes from memory, but tools that open the files right after the save fail or
  read an older file.
* ``enable`` wraps ``engine.load_checkpoint``: before DeepSpeed looks at the directory, every
  cached object of the tag whose newest generation is not yet the file (no file, or the file
  of an earlier save of the tag) is made one, by waiting for the daemon's
  in-flight persist of it (never a second writer), or, for objects outside every persist root,
  by writing it once with temp + rename. The payloads themselves are then still read from
  memory through ``CkptCacheCheckpointEngine.load``. Waiting rather than faking ``os.path``
  keeps DeepSpeed's own checks (glob, ``assert os.path.exists``) meaningful.
* DeepSpeed's own small files on rank 0 (``ckptcache.adapters._deepspeed_files``): for an
  engine that is not decoupled, ``latest`` is written by the engine's ``commit``, where
  DeepSpeed would write it next, as a new file renamed over the old one (DeepSpeed truncates it
  in place); the recovery scripts (``zero_to_fp32.py``, ``zero_to_torch.py``) are copied into
  the save directory only when the copy there differs from DeepSpeed's. Both leave the files
  DeepSpeed leaves, without waiting for the disk behind the checkpoint's persist.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, cast

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import ckptcache
from ckptcache.adapters import _common, _deepspeed_files
from ckptcache.adapters._deepspeed_env import deepspeed_setting

__all__ = [
    "CkptCacheCheckpointEngine",
    "disable",
    "enable",
    "enable_from_env",
    "flush",
    "is_enabled",
    "prepare_load",
]

ENGINE_NAME = "CkptCacheCheckpointEngine"
#: The key inside the DeepSpeed config's ``"checkpoint"`` section that this adapter reads.
CONFIG_KEY = "ckptcache"
#: Default ``commit_waits`` of every adapter (see ``_common.resolve_commit_waits``).
ENV_COMMIT_WAITS = _common.ENV_COMMIT_WAITS


class CkptCacheCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` whose ``save`` is a cache save (phase 1 only).

    ``commit_waits`` is ``"files"`` (default: ``$CKPTCACHE_COMMIT_WAITS`` or ``"files"``),
    ``"persisted"`` or ``"local"``; ``decoupled`` moves that wait to DeepSpeed's next optimizer
    step (see the module docstring); ``client`` defaults to the process's default client
    (``$CKPTCACHE_SOCKET``).
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        commit_waits: str | None = None,
        client: ckptcache.Client | None = None,
        decoupled: bool = False,
    ):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.commit_waits = _common.resolve_commit_waits(commit_waits)
        self.decoupled = decoupled
        self._client = client
        self._saved: list[str] = []
        #: The save a decoupled engine has not committed yet (DeepSpeed asks at each step).
        self._pending: CheckpointCommitInfo | None = None
        #: Whether :meth:`commit` writes ``latest`` in DeepSpeed's place (set by the wrapped
        #: ``save_checkpoint`` on rank 0 for the duration of one save).
        self.writes_latest = False

    @property
    def client(self) -> ckptcache.Client:
        """The client this engine saves through."""
        return _common.client_of(self._client)

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start a checkpoint (tag): forget the files of the previous one (a decoupled save
        never committed is superseded, as DeepSpeed's own decoupled engine does)."""
        self._saved = []
        self._pending = info if self.decoupled else None

    def save(self, state_dict: Any, path: str) -> None:
        """Hand ``state_dict`` to the cache under DeepSpeed's file name (phase 1)."""
        self.client.save(state_dict, path)
        self._saved.append(path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load from memory when cached, else from the file (DeepSpeed unpickles fully too)."""
        return _common.load_any(self.client, path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """All files of ``info.tag`` were handed over: wait for what ``commit_waits`` promises
        on every rank before DeepSpeed writes ``latest`` (right after this returns)."""
        if self.commit_waits != "local":
            _common.settle(self._client, self._saved, self.commit_waits)
            # DeepSpeed's rank 0 writes `latest` right after its own commit returns; without
            # this barrier it could name a tag whose files other ranks are still persisting.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        if self.writes_latest:
            # Where DeepSpeed writes it: after every rank's commit, before its last barrier.
            _deepspeed_files.write_latest(info.save_dir, str(info.tag))
        self._saved = []
        self._pending = None
        return True

    # DeepSpeed's decoupled protocol: save_checkpoint skips commit and `latest`; the engine
    # commits at the next optimizer step (DeepSpeedEngine._commit_decoupled_checkpoint).

    def is_decoupled(self) -> bool:
        """Whether DeepSpeed commits this engine's saves at the next step, not in the save."""
        return self.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The save waiting for its commit (``None``: nothing pending)."""
        return self._pending

    def cleanup(self) -> None:
        """The engine is destroyed: this rank's files of a pending save are made readable
        (no barrier and no ``latest``: the other ranks may not be here; as DeepSpeed's own
        decoupled engine, only a step or :func:`flush` writes ``latest``)."""
        if self._pending is not None and self.commit_waits != "local":
            _common.settle(self._client, self._saved, self.commit_waits)
        self._pending = None
        self._saved = []


def flush(engine: Any) -> bool:
    """Commit ``engine``'s pending decoupled save now (call on every rank): its files are made
    readable and rank 0 writes ``latest``, as DeepSpeed does at the next optimizer step.
    Returns whether a save was pending."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ckpt_engine, CkptCacheCheckpointEngine) or ckpt_engine._pending is None:
        return False
    engine._commit_decoupled_checkpoint()
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


def _wrap_save(original: Any) -> Any:
    """``save_checkpoint`` whose ``latest`` our engine's ``commit`` writes (see the module
    docstring); unchanged for a decoupled engine, another engine, or ``save_latest=False``."""
    original = getattr(original, "__ckptcache_original__", original)
    signature = inspect.signature(original)
    if "save_latest" not in signature.parameters:  # another DeepSpeed: leave it as it is
        return original

    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kw: Any) -> Any:
        ckpt_engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(ckpt_engine, CkptCacheCheckpointEngine) or ckpt_engine.decoupled:
            return original(self, *args, **kw)
        call = signature.bind(self, *args, **kw)
        call.apply_defaults()
        if not call.arguments["save_latest"]:
            return original(self, *args, **kw)
        call.arguments["save_latest"] = False
        ckpt_engine.writes_latest = getattr(self, "global_rank", 0) == 0
        try:
            return original(*call.args, **call.kwargs)
        finally:
            ckpt_engine.writes_latest = False

    save_checkpoint.__ckptcache_original__ = original  # type: ignore[attr-defined]
    return save_checkpoint


def _wrap_recovery_scripts(original: Any) -> Any:
    """``_copy_recovery_script`` that copies nothing when the save directory holds DeepSpeed's
    scripts already (our engine only; another DeepSpeed's function is left as it is)."""
    original = getattr(original, "__ckptcache_original__", original)
    scripts = _deepspeed_files.recovery_scripts(original)
    if scripts is None:
        return original
    source, names = scripts

    @functools.wraps(original)
    def copy_recovery_script(self: Any, save_path: str) -> Any:
        ours = isinstance(getattr(self, "checkpoint_engine", None), CkptCacheCheckpointEngine)
        if ours and _deepspeed_files.scripts_current(save_path, source, names):
            return None
        return original(self, save_path)

    copy_recovery_script.__ckptcache_original__ = original  # type: ignore[attr-defined]
    return copy_recovery_script


#: The ``DeepSpeedEngine`` methods :func:`enable` wraps, with their wrappers.
_WRAPPED = {
    "load_checkpoint": _wrap_load,
    "save_checkpoint": _wrap_save,
    "_copy_recovery_script": _wrap_recovery_scripts,
}


def enable(
    engine: Any = None,
    *,
    commit_waits: str | None = None,
    client: ckptcache.Client | None = None,
    decoupled: bool | None = None,
) -> CkptCacheCheckpointEngine | ckptcache.CacheStatus:
    """Route ``save_checkpoint``/``load_checkpoint`` through the cache.

    Without ``engine`` (recommended): hook DeepSpeed so that every engine built from now on in
    this process uses the cache (see the module docstring for the config key); returns whether
    the cache is reachable (and logs it; ``CKPTCACHE_REQUIRE=1`` raises
    :class:`ckptcache.DaemonUnavailable` instead). With ``engine``: switch that existing engine
    (call after ``deepspeed.initialize`` on every rank); returns its new checkpoint engine.
    ``decoupled`` (default: the engine's config) as in the module docstring.
    """
    if commit_waits is not None:
        _common.check_commit_waits(commit_waits)
    if engine is None:
        return cast(ckptcache.CacheStatus, _install(commit_waits, client, decoupled=decoupled))
    config = getattr(engine, "_config", None)
    ckpt_engine = CkptCacheCheckpointEngine(
        config,
        commit_waits=commit_waits,
        client=client,
        decoupled=_decoupled(config, _options(config) or {}, decoupled),
    )
    engine.checkpoint_engine = ckpt_engine
    for name, wrap in _WRAPPED.items():
        method = getattr(type(engine), name, None)
        if method is not None:
            setattr(engine, name, functools.partial(wrap(method), engine))
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
    unknown = set(section) - {"enabled", "commit_waits", "decoupled"}
    if unknown:
        raise ckptcache.ConfigError(
            f'unknown keys in DeepSpeed config "checkpoint.{CONFIG_KEY}": {sorted(unknown)}; '
            "allowed: enabled, commit_waits, decoupled"
        )
    return None if section.get("enabled", True) is False else section


def _decoupled(config_params: Any, options: dict[str, Any], default: bool | None) -> bool:
    """Whether the engine commits at the next step: the ``ckptcache`` section's
    ``"decoupled"``, else ``default`` (``enable(decoupled=...)``), else DeepSpeed's own
    ``"checkpoint": {"writer": {"decoupled": ...}}`` (which asks DeepSpeed's writer for the
    same protocol)."""
    if "decoupled" in options:
        return bool(options["decoupled"])
    if default is not None:
        return default
    raw = getattr(config_params, "_param_dict", None) or {}
    writer = (raw.get("checkpoint") or {}).get("writer") or {}
    return bool(writer.get("decoupled", False)) if isinstance(writer, dict) else False


def enable_from_env() -> ckptcache.CacheStatus | None:
    """What ``CKPTCACHE_DEEPSPEED`` asks for (see ``ckptcache.adapters._startup``): with it on, the
    process-wide hook of :func:`enable`, ``commit_waits`` from its value if it names one.

    Called by the startup hook when ``deepspeed`` is imported; reachability is reported when
    the first engine is built (so importing DeepSpeed never connects to a daemon). Returns
    ``None`` (and installs nothing) when the variable is off; a bad value raises
    :class:`ckptcache.ConfigError`.
    """
    setting = deepspeed_setting()
    if setting is None:
        return None
    return _install(setting or None, None, report=False)


def _install(
    commit_waits: str | None,
    client: ckptcache.Client | None,
    *,
    report: bool = True,
    decoupled: bool | None = None,
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
        return CkptCacheCheckpointEngine(
            config_params,
            commit_waits=options.get("commit_waits") or commit_waits,
            client=client,
            decoupled=_decoupled(config_params, options, decoupled),
        )

    if not _HOOK:
        _HOOK["factory"] = factory
        for name in _WRAPPED:
            if hasattr(ds_engine.DeepSpeedEngine, name):
                _HOOK[name] = getattr(ds_engine.DeepSpeedEngine, name)
    cast(Any, ds_engine).create_checkpoint_engine = create_checkpoint_engine
    for name, wrap in _WRAPPED.items():
        if name in _HOOK:
            setattr(ds_engine.DeepSpeedEngine, name, wrap(_HOOK[name]))
    return _common.report_enabled("DeepSpeed", client) if report else None


def disable() -> None:
    """Remove the process-wide hook: engines built afterwards use DeepSpeed's own writer."""
    if not _HOOK:
        return
    import deepspeed.runtime.engine as ds_engine

    cast(Any, ds_engine).create_checkpoint_engine = _HOOK.pop("factory")
    for name in _WRAPPED:
        if name in _HOOK:
            setattr(ds_engine.DeepSpeedEngine, name, _HOOK.pop(name))


def is_enabled() -> bool:
    """Whether the process-wide hook is installed."""
    return bool(_HOOK)
