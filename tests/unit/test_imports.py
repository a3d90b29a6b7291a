"""The daemon's modules import each other without a cycle, and hold no back-references.

Only imports that run when a module is imported count: module-level statements (also inside
module-level ``if``/``try``/``with``), but not ``if TYPE_CHECKING:`` blocks (annotations only)
and not imports inside functions (deferred to call time: ``daemon`` builds the ``Cluster``
that way). A cycle among what is left makes import order matter and breaks partial imports.

The parts meet only in ``daemon.build_core``: the state owner (``state.py``) is the only module
that touches the condition variable, and no module reaches into another object's private
attributes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import ckptcache

PACKAGE = "ckptcache.server"
SOURCE = Path(ckptcache.__file__).parent / "server"

#: Edges of a known cycle, waiting for a restructuring (empty: none known).
ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_at_import(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of ``body`` that run when the module is imported (recursively)."""
    for node in body:
        if isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _run_at_import(node.body)
            yield from _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _run_at_import(block)
            for handler in node.handlers:
                yield from _run_at_import(handler.body)
        elif isinstance(node, ast.With):
            yield from _run_at_import(node.body)
        else:
            yield node


def _imported(module: str, path: Path) -> set[str]:
    """Every module name an import statement of ``module`` may load (``from a import b``
    names both ``a`` and ``a.b``: ``b`` may be a submodule)."""
    names: set[str] = set()
    for node in _run_at_import(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the daemon package it imports at import time``."""
    paths = {_module_name(p): p for p in sorted(SOURCE.rglob("*.py"))}
    return {m: {d for d in _imported(m, p) if d in paths and d != m} for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` when it has none."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str]:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return []

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return []


def test_the_graph_sees_real_imports_and_skips_deferred_ones():
    graph = import_graph()
    assert "ckptcache.server.persist" in graph["ckptcache.server.core"]
    assert "ckptcache.server.core" in graph["ckptcache.server.service"]
    assert "ckptcache.server.state" in graph["ckptcache.server.saves"]
    # Deferred: under TYPE_CHECKING (persist -> state) or inside a function (daemon -> cluster).
    assert "ckptcache.server.state" not in graph["ckptcache.server.persist"]
    assert "ckptcache.server.cluster" not in graph["ckptcache.server.daemon"]


def test_no_import_cycle_in_the_daemon():
    graph = import_graph()
    for src, dst in ALLOWED:
        graph[src].discard(dst)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


#: The one module that owns the daemon's lock and condition variable.
STATE_OWNER = "ckptcache.server.state"
#: Private attributes of other objects a module may use: rpyc's own hooks.
PRIVATE_ALLOWED = {
    ("ckptcache.server.service", "_connect"),
    ("ckptcache.server.service", "_config"),
}


def _attributes(path: Path) -> Iterator[ast.Attribute]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            yield node


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SOURCE.rglob("*.py"))}


def test_only_the_state_owner_uses_the_condition_variable():
    users = sorted(
        f"{name}:{a.lineno}"
        for name, path in _modules().items()
        if name != STATE_OWNER
        for a in _attributes(path)
        if a.attr in ("cond", "_cond")
    )
    assert not users, f"the daemon's condition is used outside {STATE_OWNER}: {users}"
    assert any(a.attr == "_cond" for a in _attributes(_modules()[STATE_OWNER]))


def test_no_module_reaches_into_another_objects_private_attributes():
    found = sorted(
        f"{name}:{a.lineno} .{a.attr}"
        for name, path in _modules().items()
        for a in _attributes(path)
        if a.attr.startswith("_") and not a.attr.startswith("__")
        and not (isinstance(a.value, ast.Name) and a.value.id in ("self", "cls"))
        and (name, a.attr) not in PRIVATE_ALLOWED
    )  # fmt: skip
    assert not found, f"private attributes used from outside their object: {found}"


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
        for name, path in _modules().items()
        if name not in ("ckptcache.server.daemon", "ckptcache.server.service")
        for a in _attributes(path)
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
