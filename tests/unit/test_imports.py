"""The daemon's modules import each other without a cycle.

Only imports that run when a module is imported count: module-level statements (also inside
module-level ``if``/``try``/``with``), but not ``if TYPE_CHECKING:`` blocks (annotations only)
and not imports inside functions (deferred to call time: ``core`` builds its ``Cluster`` that
way). A cycle among what is left makes import order matter and breaks partial imports.
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
    # Deferred: under TYPE_CHECKING (persist -> core) or inside a function (core -> cluster).
    assert "ckptcache.server.core" not in graph["ckptcache.server.persist"]
    assert "ckptcache.server.cluster" not in graph["ckptcache.server.core"]


def test_no_import_cycle_in_the_daemon():
    graph = import_graph()
    for src, dst in ALLOWED:
        graph[src].discard(dst)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
