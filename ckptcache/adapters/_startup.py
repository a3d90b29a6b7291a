"""Turn adapters on from the environment, with no change to the training code.

The package ships ``ckptcache-startup.pth`` into ``site-packages``; Python runs its one line at
interpreter start. The line only looks up :data:`DEEPSPEED_ENV` in ``os.environ`` and imports
this module when the variable is present, so a process without it pays one dictionary lookup
and imports nothing of ckptcache (nor torch). The value is read in one place,
:mod:`ckptcache.adapters._deepspeed_env`, by this hook and by the adapter alike.

When the variable is on, :func:`install` puts a one-shot finder at the front of
``sys.meta_path``. It does nothing until ``deepspeed`` is imported (by the user's script, by
Lightning's ``DeepSpeedStrategy``, by the HF ``Trainer``; a lookup alone, such as the
``importlib.util.find_spec("deepspeed")`` those run first, leaves it in place); once
DeepSpeed's ``__init__`` has run, it calls
:func:`ckptcache.adapters.deepspeed.enable_from_env`, which hooks DeepSpeed's checkpoint-engine
factory and ``load_checkpoint`` exactly as ``enable()`` does, and leaves ``sys.meta_path``. A
process that never imports DeepSpeed never imports torch on ckptcache's account either.

``python -S`` (no ``site``) skips every ``.pth`` file: there, call ``enable()`` in code.
"""

from __future__ import annotations

import _thread
import sys
from typing import TYPE_CHECKING, Any

from ckptcache.adapters._deepspeed_env import DEEPSPEED_ENV, deepspeed_setting

if TYPE_CHECKING:  # importlib.abc alone would double the start-up cost of a hooked process
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["DEEPSPEED_ENV", "deepspeed_setting", "install"]


class _AfterImport:
    """Runs ``callback(module)`` right after the module ``name`` has executed, once.

    A ``sys.meta_path`` finder (the protocol is one method) that finds nothing itself: it asks
    the finders behind it for the spec and wraps the loader. It stays in place until the
    wrapped loader has run the module and the callback: a mere lookup
    (``importlib.util.find_spec(name)``, as HF ``transformers``/``accelerate`` probe for
    DeepSpeed before they import it) must not use it up. A per-thread flag keeps the lookup
    of the finders behind it from coming back here.
    """

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name = name
        self.callback = callback
        self._busy: set[int] = set()  # threads inside find_spec

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        me = _thread.get_ident()
        if me in self._busy:
            return None  # a finder behind us looked the name up again
        self._busy.add(me)
        try:
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, self._ran)
                    return spec
            return None
        finally:
            self._busy.discard(me)

    def _ran(self, module: ModuleType) -> None:
        """The module was executed: the callback, then this finder is done."""
        self.callback(module)
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass  # removed already (a second import of the module after a reload)


class _Loader:
    """The real loader, then the callback (a failing callback fails the import: visibly)."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        # is_package, get_code, get_resource_reader, ...: whatever the real loader offers.
        return getattr(self._loader, name)


def _enable_deepspeed(module: ModuleType) -> None:
    from ckptcache.adapters import deepspeed as adapter

    adapter.enable_from_env()


def install() -> None:
    """Called by ``ckptcache-startup.pth`` when :data:`DEEPSPEED_ENV` is set: arrange for the
    DeepSpeed adapter to switch on as soon as ``deepspeed`` is imported (at once if it is
    already). A bad value is reported when DeepSpeed is imported, as a ``ConfigError``."""
    try:
        if deepspeed_setting() is None:
            return
    except ValueError:
        pass  # raised again, with its message, where the user sees it: at `import deepspeed`
    if "deepspeed" in sys.modules:
        _enable_deepspeed(sys.modules["deepspeed"])
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("deepspeed", _enable_deepspeed))
