"""The package's modules import each other without a cycle, keep to their layers, and keep
out of each other's private names.

Read from the source (``tests/structure.py``, which also says when an import counts as run at
import time). The rules, over all of ``ckptcache/``:

* no cycle among the imports that run when a module is imported (a cycle makes import order
  matter and breaks partial imports), and no circle either once annotations
  (``TYPE_CHECKING``) and deferred imports are counted: two modules that need each other are
  one job split in two, or a back-reference;
* no module uses a private name (``_x``) of a module, package or object it is not part of;
* the trainer side (everything outside ``ckptcache/server/``) never imports the daemon at
  import time; the adapters import only the public faces; ``format/`` and ``wire/`` know
  neither the daemon nor the client, and ``format/`` imports neither torch nor ``codec/``.

What breaks a rule today is listed as data below, each with its reason: the test fails on any
new violation, and on a listed one that is gone (so the lists only shrink). The restructuring
of issue 26 empties them.

The daemon's parts meet only in ``daemon.build_core``: the state owner (``state.py``) is the
only module that touches the condition variable, and no part holds a back-reference.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator

import ckptcache
from tests.structure import (
    PACKAGE,
    Module,
    circles,
    find_cycle,
    import_graph,
    imports,
    inside,
    package_modules,
    parse,
    private_reaches,
)

SERVER = "ckptcache.server"
ALL_TIMES = ("import", "typing", "call")


@functools.cache
def _modules() -> dict[str, Module]:
    return package_modules()


def _without(graph: dict[str, set[str]], edges: Iterable[tuple[str, str]]) -> dict:
    for src, dst in edges:
        graph[src].discard(dst)
    return graph


# --- cycles -------------------------------------------------------------------------------

#: Import-time cycles waiting for a restructuring (none known).
CYCLE_ALLOWED: dict[tuple[str, str], str] = {}

#: Circles closed by an annotation-only or deferred import: the edge that closes each.
CIRCLE_ALLOWED: dict[tuple[str, str], str] = {}


def test_the_graph_sees_real_imports_and_skips_deferred_ones():
    graph = import_graph(_modules())
    assert "ckptcache.server.persist.persister" in graph["ckptcache.server.core"]
    assert "ckptcache.server.core" in graph["ckptcache.server.service"]
    assert "ckptcache.server.state" in graph["ckptcache.server.saves"]
    assert "ckptcache.client" in graph["ckptcache.api"]
    assert "ckptcache.adapters._common" in graph["ckptcache.adapters.dcp"]  # from pkg import mod
    # Deferred: under TYPE_CHECKING (persist -> state) or inside a function (daemon -> cluster).
    assert "ckptcache.server.state" not in graph["ckptcache.server.persist.persister"]
    assert "ckptcache.server.cluster.cluster" not in graph["ckptcache.server.daemon"]
    assert "ckptcache.server.daemon" not in graph["ckptcache.cli.commands"]
    # ``from ckptcache import errors`` depends on the submodule, not on the package's face.
    assert "ckptcache" not in graph["ckptcache.wire.messages"]
    everything = import_graph(_modules(), ALL_TIMES)
    assert "ckptcache.server.state" in everything["ckptcache.server.persist.persister"]
    assert "ckptcache.server.daemon" in everything["ckptcache.cli.commands"]


def test_no_import_cycle_at_import_time():
    cycle = find_cycle(_without(import_graph(_modules()), CYCLE_ALLOWED))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_circle_counting_annotations_and_deferred_imports():
    graph = import_graph(_modules(), ALL_TIMES)
    stale = sorted(edge for edge in CIRCLE_ALLOWED if edge[1] not in graph[edge[0]])
    assert not stale, f"listed edges that are gone: remove them from CIRCLE_ALLOWED: {stale}"
    cycle = find_cycle(_without(graph, CIRCLE_ALLOWED))
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}}) == [
        ["a", "b"],
        ["c", "d", "e"],
    ]


def test_the_graph_finds_a_planted_cycle():
    planted = {
        "ckptcache.p.a": parse("ckptcache.p.a", "from ckptcache.p import b\n"),
        "ckptcache.p.b": parse("ckptcache.p.b", "if True:\n    from . import a\n"),
        "ckptcache.p.c": parse("ckptcache.p.c", "def f():\n    import ckptcache.p.a\n"),
    }
    graph = import_graph(planted)
    assert find_cycle(graph) == ["ckptcache.p.a", "ckptcache.p.b", "ckptcache.p.a"]
    assert graph["ckptcache.p.c"] == set()
    assert import_graph(planted, ALL_TIMES)["ckptcache.p.c"] == {"ckptcache.p.a"}


# --- private names ------------------------------------------------------------------------

#: Private names used from outside their owner today: ``(module, name as written) -> reason``.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}

#: Private names that are not ours to fix: other projects' internals the package relies on
#: by design, and a class's own members used by its own module's functions.
PRIVATE_KEPT: dict[tuple[str, str], str] = {
    **{("ckptcache.codec.flatten", what): "torch's storage internals, as torch.save reads them"
       for what in ("storage._cdata", "value._pickle_storage_type", "value._size",
                    "value._untyped_storage", "value.untyped_storage()._cdata",
                    "obj._backward_hooks")},
    ("ckptcache.codec.flatten", "multiarray._reconstruct"):
        "numpy's unpickling entry point, allowed as torch's weights-only unpickler allows it",
    **{("ckptcache.client._async", what): "torch's storage identity and version counter: how a "
       "tensor changed during a non-blocking save is seen"
       for what in ("s._cdata", "tensor._version", "tensor.untyped_storage()._cdata")},
    **{("ckptcache.client._staging", what): "torch's storage identity: which staged storage "
       "each tensor lies on" for what in ("s._cdata", "t.untyped_storage()._cdata")},
    ("ckptcache.recovery._buckets", "buf._base"): "numpy's view base: is the buffer shared",
    ("ckptcache.wire.messages", "hint._value2member_map_"):
        "enum's value table: a string enum field decoded without a try per member",
    **{(module, "typed._untyped_storage"): "torch's storage internals, as torch.save reads them"
       for module in ("ckptcache.codec.flatten", "ckptcache.codec.fast_unpickle")},
    **{("ckptcache.codec.plan.cache", what): "torch's storage identity: a cached plan's "
       "storages checked against a fresh flatten's" for what in ("a._cdata", "b._cdata")},
    ("ckptcache.codec.plan.columns", "t._version"): "torch's version counter, read for "
    "an inference-mode tensor one by one (it has none): the cached plan's structure key",
    ("ckptcache.format.archive", "plan._scatter"): "the archive plan's own member, in its module",
    ("ckptcache.client._connection", "conn._closed"): "rpyc's connection, disowned after a fork",
    ("ckptcache.client._connection", "conn._send"): "rpyc's connection, disowned after a fork",
    ("ckptcache.server.service", "conn._config"): "rpyc's own hook",
    ("ckptcache.server.service", "self.service._connect"): "rpyc's own hook",
    ("ckptcache.adapters.deepspeed", "engine._commit_decoupled_checkpoint"):
        "DeepSpeed's own commit of a decoupled save, called when it would call it",
    ("ckptcache.format.manifest", "manifest._check"): "Manifest's own member, in its classmethod",
    ("ckptcache.adapters.deepspeed", "ckpt_engine._client"):
        "the adapter's own engine class, in its own module",
    ("ckptcache.adapters.deepspeed", "ckpt_engine._pending"):
        "the adapter's own engine class, in its own module",
}  # fmt: skip


def private_uses(modules: dict[str, Module], known: set[str]) -> dict[tuple[str, str], str]:
    """``(module, name as written) -> "kind, line"`` for every private name used outside its
    owner."""
    return {
        (name, r.what): f"{r.kind} reach, line {r.line}"
        for name, module in modules.items()
        for r in private_reaches(module, known)
    }


def test_no_module_uses_another_ones_private_names():
    found = private_uses(_modules(), set(_modules()))
    listed = PRIVATE_ALLOWED.keys() | PRIVATE_KEPT.keys()
    new = sorted(f"{m}: {what} ({found[m, what]})" for m, what in found.keys() - listed)
    assert not new, f"private names used from outside their owner: {new}"
    stale = sorted(PRIVATE_ALLOWED.keys() - found.keys())
    assert not stale, f"listed uses that are gone: remove them from PRIVATE_ALLOWED: {stale}"
    assert not PRIVATE_ALLOWED.keys() & PRIVATE_KEPT.keys()


def test_the_private_name_check_finds_planted_reaches():
    source = """
import torch
import ckptcache.client
from ckptcache import _gpu, client as c
from ckptcache.client import _helper
from ckptcache.adapters import _common
from ckptcache.p import _own


class Thing:
    def __init__(self, other):
        self._mine = other._theirs
        super()._init()
        ckptcache.client._state.clear()
        c._reach()
        torch._C.foo()
        self._mine._replace(x=1)
        _gpu.copy()
"""
    known = {"ckptcache.client", "ckptcache._gpu", "ckptcache.adapters._common"}
    found = private_uses({"ckptcache.p.planted": parse("ckptcache.p.planted", source)}, known)
    assert found == {
        ("ckptcache.p.planted", "ckptcache.client._helper"): "import reach, line 5",
        ("ckptcache.p.planted", "ckptcache.adapters._common"): "import reach, line 6",
        ("ckptcache.p.planted", "other._theirs"): "object reach, line 12",
        ("ckptcache.p.planted", "ckptcache.client._state"): "module reach, line 14",
        ("ckptcache.p.planted", "c._reach"): "module reach, line 15",
    }
    # The owner may: a module its own names, a package its private modules.
    own = parse("ckptcache.client", "from ckptcache.client import _helper\n_helper()\n")
    assert private_uses({"ckptcache.client": own}, known) == {}
    sibling = parse("ckptcache.adapters.dcp", "from ckptcache.adapters import _common\n")
    assert private_uses({"ckptcache.adapters.dcp": sibling}, known) == {}


# --- layers -------------------------------------------------------------------------------

#: What the adapters may import: the faces a user's own code imports. ``storage`` is the
#: backend registry users extend (``register_backend``, ``backend_for``); ``wire.states``
#: holds the states a public ``ObjectStatus`` reports (``persist_state``), compared against.
PUBLIC_FACES = {
    "ckptcache",
    "ckptcache.api",
    "ckptcache.client",
    "ckptcache.errors",
    "ckptcache.storage",
    "ckptcache.wire.states",
}

#: What ``format/``, ``codec/`` and ``wire/`` may import: each other, and the modules shared by
#: the daemon and the client that belong to neither (errors, storage backends, torch-free
#: helpers).
NEUTRAL = (
    "ckptcache.codec",
    "ckptcache.format",
    "ckptcache.wire",
    "ckptcache.errors",
    "ckptcache.storage",
    "ckptcache._atomic",
    "ckptcache._defaults",
    "ckptcache._secure_fs",
    "ckptcache._signals",
    "ckptcache._units",
    "ckptcache._version",
    "ckptcache._workers",
    "ckptcache.hugepages",
)

#: Trainer-side modules that import the daemon at import time (none).
SERVER_ALLOWED: dict[tuple[str, str], str] = {}

#: Internal modules the adapters import today: ``(adapter module, module) -> reason``.
ADAPTERS_ALLOWED: dict[tuple[str, str], str] = {}

#: ``format/`` and ``wire/`` imports of the client today: ``(module, module) -> reason``.
FORMAT_WIRE_ALLOWED: dict[tuple[str, str], str] = {}


def _deps(modules: dict[str, Module], known: set[str], times: Iterable[str]) -> Iterator:
    """``(module, package module it imports)`` at the given times."""
    for name, module in modules.items():
        for i in imports(module, known):
            if i.when in times and inside(i.target, PACKAGE) and i.target != name:
                yield name, i.target


def server_imports(modules: dict[str, Module], known: set[str]) -> set[tuple[str, str]]:
    """Trainer-side modules that import the daemon at import time."""
    return {
        (m, t)
        for m, t in _deps(modules, known, ("import",))
        if not inside(m, SERVER) and inside(t, SERVER)
    }


def adapter_imports(modules: dict[str, Module], known: set[str]) -> set[tuple[str, str]]:
    """Adapter imports, at any time, of anything but the public faces and the adapters."""
    adapters = "ckptcache.adapters"
    return {
        (m, t)
        for m, t in _deps(modules, known, ALL_TIMES)
        if inside(m, adapters) and not inside(t, adapters) and t not in PUBLIC_FACES
    }


def format_wire_imports(modules: dict[str, Module], known: set[str]) -> set[tuple[str, str]]:
    """``format/``, ``codec/`` and ``wire/`` imports, at any time, of the daemon or the client."""
    return {
        (m, t)
        for m, t in _deps(modules, known, ALL_TIMES)
        if any(inside(m, p) for p in ("ckptcache.format", "ckptcache.codec", "ckptcache.wire"))
        and not any(inside(t, n) for n in NEUTRAL)
    }


def _check(found: set[tuple[str, str]], allowed: dict[tuple[str, str], str], what: str) -> None:
    new = sorted(found - allowed.keys())
    assert not new, f"{what}: {new}"
    stale = sorted(allowed.keys() - found)
    assert not stale, f"listed imports that are gone: remove them from the list: {stale}"


def test_the_trainer_side_never_imports_the_daemon_at_import_time():
    found = server_imports(_modules(), set(_modules()))
    _check(found, SERVER_ALLOWED, "the trainer side imports the daemon")


def test_the_adapters_import_only_the_public_faces():
    found = adapter_imports(_modules(), set(_modules()))
    _check(found, ADAPTERS_ALLOWED, "adapters import internal modules")


def test_format_and_wire_know_neither_the_daemon_nor_the_client():
    found = format_wire_imports(_modules(), set(_modules()))
    _check(found, FORMAT_WIRE_ALLOWED, "format/ or wire/ imports the daemon or the client")


def torch_in_format(modules: dict[str, Module], known: set[str]) -> set[tuple[str, str]]:
    """``format/`` imports, at any time, of torch or of the codec: the format is the layer
    the daemon reads without torch."""
    return {
        (name, i.target)
        for name, module in modules.items()
        if inside(name, "ckptcache.format")
        for i in imports(module, known)
        if inside(i.target, "torch") or inside(i.target, "ckptcache.codec")
    }


def test_the_format_imports_neither_torch_nor_the_codec():
    assert torch_in_format(_modules(), set(_modules())) == set()
    planted = {"ckptcache.format.planted": parse(
        "ckptcache.format.planted",
        "def f():\n    import torch\n    from ckptcache.codec import shm\n",
    )}  # fmt: skip
    assert torch_in_format(planted, {"ckptcache.codec.shm"}) == {
        ("ckptcache.format.planted", "torch"),
        ("ckptcache.format.planted", "ckptcache.codec.shm"),
    }


def test_the_layer_checks_find_planted_violations():
    known = {"ckptcache.packing", "ckptcache.server.memory.arena", "ckptcache.server.state"}
    planted = {
        "ckptcache.planted": parse(
            "ckptcache.planted",
            "from ckptcache.server import state\n"
            "def run():\n    from ckptcache.server.daemon import run_daemon\n",
        ),
        "ckptcache.adapters.planted": parse(
            "ckptcache.adapters.planted",
            "import ckptcache\nfrom ckptcache import packing, CheckpointNotFound\n"
            "from ckptcache.adapters import _common\nfrom ckptcache.client import Client\n"
            "def hook():\n    from ckptcache._startup import deepspeed_setting\n",
        ),
        "ckptcache.wire.planted": parse(
            "ckptcache.wire.planted",
            "from ckptcache.errors import ProtocolMismatch\nfrom ckptcache.wire import states\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ckptcache.client import Client\n",
        ),
        "ckptcache.format.planted": parse(
            "ckptcache.format.planted",
            "from ckptcache.storage import backend_for\n"
            "def f():\n    from ckptcache.server.memory import arena\n",
        ),
    }
    assert server_imports(planted, known) == {("ckptcache.planted", "ckptcache.server.state")}
    assert adapter_imports(planted, known) == {
        ("ckptcache.adapters.planted", "ckptcache.packing"),
        ("ckptcache.adapters.planted", "ckptcache._startup"),
    }
    assert format_wire_imports(planted, known) == {
        ("ckptcache.wire.planted", "ckptcache.client"),
        ("ckptcache.format.planted", "ckptcache.server.memory.arena"),
    }


# --- the daemon's parts -------------------------------------------------------------------

#: The one module that owns the daemon's lock and condition variable.
STATE_OWNER = "ckptcache.server.state"
#: The only module that touches the daemon's condition variable: parts get its narrow port.
LOCK_PORT = "ckptcache.server.lock"


def _server_modules() -> dict[str, Module]:
    return {name: m for name, m in _modules().items() if inside(name, SERVER)}


def _attributes(module: Module) -> Iterator[ast.Attribute]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute):
            yield node


def test_only_the_lock_port_uses_the_condition_variable():
    """The state owner holds the lock's port (``state.lock``); no part, the owner included,
    reaches the ``threading.Condition`` under it."""
    users = sorted(
        f"{name}:{a.lineno}"
        for name, module in _server_modules().items()
        if name != LOCK_PORT
        for a in _attributes(module)
        if a.attr in ("cond", "_cond")
    )
    assert not users, f"the daemon's condition is used outside {LOCK_PORT}: {users}"
    assert any(a.attr == "_cond" for a in _attributes(_modules()[LOCK_PORT]))
    owner = _modules()[STATE_OWNER].tree
    assert any(isinstance(n, ast.Name) and n.id == "StateLock" for n in ast.walk(owner))


def _own_or_config(value: ast.expr) -> bool:
    """``self.cluster`` (the facade holding its parts) or ``config.cluster`` (a name)."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cfg", "config")
    return isinstance(value, ast.Attribute) and value.attr == "config"


def test_no_back_reference_from_a_part_to_its_builder():
    """``core.cluster = ...``, ``self.core`` or ``cluster.core``: the ways parts used to reach
    each other, gone since the daemon composes them."""
    found = sorted(
        f"{name}:{a.lineno} .{a.attr}"
        for name, module in _server_modules().items()
        if name not in ("ckptcache.server.daemon", "ckptcache.server.service")
        for a in _attributes(module)
        if a.attr == "core" or (a.attr == "cluster" and not _own_or_config(a.value))
    )  # fmt: skip
    assert not found, f"back-references: {found}"


def test_every_listed_submodule_name_imports_its_module():
    """``ckptcache.<name>`` for each name kept for old code leads to a module that exists
    (the format modules moved into ``ckptcache.format``)."""
    import importlib

    for name, module in ckptcache._SUBMODULES.items():
        assert getattr(ckptcache, name) is importlib.import_module(module), name
    assert ckptcache.layout.__name__ == "ckptcache.format.layout"
    assert hasattr(ckptcache, "manifest") and not hasattr(ckptcache, "no_such_module")
