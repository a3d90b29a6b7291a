"""The package's structure as its source states it: which module imports which, and when, and
which private names of one module another one reaches for.

Everything is read with :mod:`ast`; nothing of the package is imported, so a module that would
fail or be slow to import is still read. Used by ``tests/package/test_imports.py`` (the rules) and
``scripts/structure_figures.py`` (the figures).

When an import runs:

* ``"import"``: when the module is imported: module-level statements, also inside
  module-level ``if``/``try``/``with`` blocks and class bodies. Only these can make a cycle that
  breaks a partial import.
* ``"typing"``: under ``if TYPE_CHECKING:`` (annotations only, never run).
* ``"call"``: inside a function (deferred to call time).

Imports by string (``importlib.import_module``, the package's lazy ``__getattr__``) are not
seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ckptcache"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

#: Underscore names that are public by design: the namedtuple API.
PUBLIC_UNDERSCORE = frozenset({"_asdict", "_fields", "_field_defaults", "_make", "_replace"})


@dataclass(frozen=True)
class Import:
    """One module an import statement depends on."""

    target: str
    line: int
    when: str  # "import", "typing" or "call"


@dataclass(frozen=True)
class Reach:
    """A use of a private name from outside the module, package or object that owns it.

    ``kind``: ``"import"`` (``from x import _y``, ``import x._y`` outside ``x``),
    ``"module"`` (``x._y`` on an imported module ``x``) or ``"object"`` (``obj._y`` on
    anything but ``self``/``cls``/``super()``). ``what`` is the name or expression as written.
    """

    kind: str
    what: str
    line: int


@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name and its parsed source."""

    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def module_name(path: Path, root: Path = PACKAGE_DIR) -> str:
    """``ckptcache/server/core.py`` -> ``ckptcache.server.core`` (a package: its folder)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = PACKAGE_DIR) -> dict[str, Module]:
    """Every module below ``root`` by name, parsed."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def parse(name: str, source: str, *, package: bool = False) -> Module:
    """A module from source text (a planted example in a test)."""
    path = Path(*name.split("."), "__init__.py" if package else "")
    return Module(name, path if package else path.with_suffix(".py"), ast.parse(source))


def inside(name: str, owner: str) -> bool:
    """Whether module ``name`` is ``owner`` or below it."""
    return name == owner or name.startswith(owner + ".")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: Iterable[ast.stmt], when: str) -> Iterator[tuple[ast.stmt, str]]:
    """Every statement of ``body`` (recursively) with when it runs."""
    for node in body:
        yield node, when
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _statements(node.body, "typing")
            yield from _statements(node.orelse, when)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _statements(node.body, "typing" if when == "typing" else "call")
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, ()):
                    if isinstance(child, ast.stmt):
                        yield from _statements([child], when)
                    else:  # except handler, match case: statements of its own
                        yield from _statements(child.body, when)


def _base(module: Module, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, node.module] if node.module else package)


def imports(module: Module, known: set[str]) -> list[Import]:
    """The modules the import statements of ``module`` load, with when they run (``known``:
    the package's module names). ``from a import b`` depends on the module ``a.b`` when there
    is one (``a`` is only its parent, loaded first in any case), else on ``a``'s name ``b``."""
    found = []
    for node, when in _statements(module.tree.body, "import"):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno, when) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append(Import(name if name in known else base, node.lineno, when))
    return list(dict.fromkeys(found))  # one entry for ``from a import x, y``


def import_graph(
    modules: dict[str, Module], when: Iterable[str] = ("import",)
) -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` (at the times in ``when``)."""
    wanted = set(when)
    return {
        name: {
            i.target
            for i in imports(module, set(modules))
            if i.when in wanted and i.target in modules and i.target != name
        }
        for name, module in modules.items()
    }


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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a circle (the
    strongly connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def _module_aliases(module: Module, known: set[str]) -> tuple[dict[str, str], set[str]]:
    """Local names bound to the package's modules (``name -> module``), and local names bound
    to other packages' modules by ``import x`` (their internals are not ours to judge)."""
    ours: dict[str, str] = {}
    theirs: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else local
                if inside(target, PACKAGE):
                    ours[local] = target
                else:
                    theirs.add(local)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    ours[alias.asname or alias.name] = f"{base}.{alias.name}"
    return ours, theirs


def _resolve(node: ast.expr, aliases: dict[str, str], known: set[str]) -> str | None:
    """The package module an expression names (``ckptcache.api``, ``m`` for an alias)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _resolve(node.value, aliases, known)
        if parent is not None and f"{parent}.{node.attr}" in known:
            return f"{parent}.{node.attr}"
    return None


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _names(module: Module, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The full names an import statement names (``from a import b``: ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _base(module, node)
    return [f"{base}.{alias.name}" for alias in node.names]


def private_reaches(module: Module, known: set[str]) -> list[Reach]:
    """Every use in ``module`` of a private name it does not own (``known``: the package's
    module names). A private name is owned by the module or package that holds it, and usable
    anywhere below that: ``ckptcache._atomic`` by all of ``ckptcache``, ``adapters._common`` by
    the adapters, ``client._x`` by ``client`` alone."""
    found = []
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        for name in _names(module, node):
            parts = name.split(".")
            if not inside(name, PACKAGE):
                continue
            for i, part in enumerate(parts):
                if is_private(part) and not inside(module.name, ".".join(parts[:i])):
                    found.append(Reach("import", name, node.lineno))
                    break
    aliases, theirs = _module_aliases(module, known)
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        if node.attr in PUBLIC_UNDERSCORE:
            continue
        owner = _resolve(node.value, aliases, known)
        if owner is not None:
            if not inside(module.name, owner):
                found.append(Reach("module", ast.unparse(node), node.lineno))
            continue
        root = _root(node.value)
        if _own(node.value) or (isinstance(root, ast.Name) and root.id in theirs):
            continue
        found.append(Reach("object", ast.unparse(node), node.lineno))
    return sorted(found, key=lambda r: (r.line, r.kind, r.what))
