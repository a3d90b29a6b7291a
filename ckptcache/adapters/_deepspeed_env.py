"""``CKPTCACHE_DEEPSPEED``: what it asks for, read in one place by the start-up hook
(:mod:`ckptcache.adapters._startup`) and by the DeepSpeed adapter. Imports nothing of torch:
the hook runs it at interpreter start."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DEEPSPEED_ENV", "OFF_VALUES", "ON_VALUES", "deepspeed_setting"]

#: ``CKPTCACHE_DEEPSPEED=1`` (or a ``commit_waits`` value: ``local``, ``persisted``, ``files``)
#: routes every DeepSpeed engine of the process through the cache.
DEEPSPEED_ENV = "CKPTCACHE_DEEPSPEED"
ON_VALUES = frozenset({"1", "true", "yes", "on"})
OFF_VALUES = frozenset({"", "0", "false", "no", "off"})
_COMMIT_WAITS = ("local", "persisted", "files")


def deepspeed_setting(environ: Any = None) -> str | None:
    """What :data:`DEEPSPEED_ENV` asks for: ``None`` (off), ``""`` (on, default
    ``commit_waits``) or a ``commit_waits`` value. Raises ``ckptcache.ConfigError`` (a
    ``ValueError``) for anything else, naming the values it accepts."""
    raw = (os.environ if environ is None else environ).get(DEEPSPEED_ENV)
    value = (raw or "").strip().lower()
    if value in OFF_VALUES:
        return None
    if value in ON_VALUES:
        return ""
    if value in _COMMIT_WAITS:
        return value
    from ckptcache.errors import ConfigError

    raise ConfigError(
        f"${DEEPSPEED_ENV}={raw!r}: expected one of {sorted(ON_VALUES)} (on), "
        f"{sorted(OFF_VALUES - {''})} (off) or a commit_waits value {list(_COMMIT_WAITS)}"
    )
