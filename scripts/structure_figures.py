"""Print the package's structure figures: module and class sizes, long functions, import
cycles and circles, the modules at the package root, and the repeated code.

    python scripts/structure_figures.py            # the figures of ckptcache/
    python scripts/structure_figures.py --all      # every module's line count too

Read from the source with ``ast``; the import graph is the one ``tests/package/test_imports.py``
checks (``tests/structure.py``), and the exceptions it lists are counted. The repeated code is
counted by the ``duplicates`` command where it is installed; without it, the command to run
is printed instead. docs/contributing.md ("Structure figures") records the figures.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.package import test_imports as rules  # noqa: E402
from tests.structure import PACKAGE_DIR, circles, find_cycle, import_graph, package_modules  # noqa: E402

#: A function longer than this is listed (the most one of client/ may have: issue 26).
LONG_FUNCTION = 50
#: A module longer than this is counted as large.
LARGE_MODULE = 300
DUPLICATES = ["duplicates", "--repo", "ckptcache", "--most", "200", "--seconds", "120"]


def _span(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Lines from the first decorator to the end of the body."""
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return (node.end_lineno or node.lineno) - start + 1


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its qualified name (``Class.method``, ``f.inner``)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="list every module's line count")
    parser.add_argument("--top", type=int, default=12, help="rows of the largest (default 12)")
    args = parser.parse_args()

    modules = package_modules()
    lines = {n: len(m.path.read_text().splitlines()) for n, m in modules.items()}
    sizes = sorted(lines.values())
    print(f"== modules: {len(lines)}, {sum(sizes)} lines; median {statistics.median(sizes):.0f}, "
          f"largest {sizes[-1]}; over {LARGE_MODULE} lines: "
          f"{sum(s > LARGE_MODULE for s in sizes)}")  # fmt: skip
    folders: dict[str, list[int]] = {}
    for name, n in lines.items():
        parts = modules[name].path.relative_to(PACKAGE_DIR).parts
        folders.setdefault(parts[0] + "/" if len(parts) > 1 else "(root)", []).append(n)
    for folder, ns in sorted(folders.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {folder:10s} {len(ns):3d} modules {sum(ns):6d} lines, largest {max(ns)}")
    print(f"  largest {'all' if args.all else args.top}:")
    shown = sorted(lines.items(), key=lambda kv: -kv[1])
    for name, n in shown if args.all else shown[: args.top]:
        print(f"  {n:5d}  {name}")

    classes = [
        (_span(c), sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in c.body),
         f"{name}.{c.name}")
        for name, m in modules.items()
        for c in ast.walk(m.tree)
        if isinstance(c, ast.ClassDef)
    ]  # fmt: skip
    print(f"\n== classes: {len(classes)}; largest by lines (lines, methods)")
    for span, methods, name in sorted(classes, reverse=True)[: args.top]:
        print(f"  {span:5d} {methods:3d}  {name}")
    print("   by methods (lines, methods)")
    for span, methods, name in sorted(classes, key=lambda c: (-c[1], -c[0]))[: args.top]:
        print(f"  {span:5d} {methods:3d}  {name}")

    functions = [
        (_span(f), f"{name}.{q}") for name, m in modules.items() for q, f in _functions(m.tree)
    ]
    long = sorted((f for f in functions if f[0] > LONG_FUNCTION), reverse=True)
    spans = sorted(s for s, _ in functions)
    p90 = spans[int(len(spans) * 0.9)]
    print(f"\n== functions: {len(functions)}; median {statistics.median(spans):.0f} lines, "
          f"p90 {p90}; over {LONG_FUNCTION} lines: {len(long)}")  # fmt: skip
    for span, name in long:
        print(f"  {span:5d}  {name}")

    at_import = import_graph(modules)
    cycle = find_cycle(at_import)
    print("\n== import-time cycle: " + (" -> ".join(cycle) if cycle else "none"))
    groups = circles(import_graph(modules, ("import", "typing", "call")))
    print(f"== circles, annotation-only and deferred imports counted: {len(groups)}")
    for group in groups:
        print("  " + " <-> ".join(group))

    print("== exceptions the import test lists (tests/package/test_imports.py): "
          f"{len(rules.CIRCLE_ALLOWED)} circle edges, {len(rules.PRIVATE_ALLOWED)} private "
          f"reaches (and {len(rules.PRIVATE_KEPT)} kept: other projects' internals, a class's "
          f"own members), {len(rules.ADAPTERS_ALLOWED)} adapter imports of internal modules, "
          f"{len(rules.FORMAT_WIRE_ALLOWED)} format/wire imports of the client, "
          f"{len(rules.SERVER_ALLOWED)} trainer-side imports of the daemon")  # fmt: skip

    root = sorted(p.name for p in PACKAGE_DIR.glob("*.py") if p.name != "__init__.py")
    print(f"\n== modules at the package root (besides __init__.py): {len(root)}")
    print("  " + " ".join(root))

    print(f"\n== repeated code: {' '.join(DUPLICATES)}")
    if shutil.which(DUPLICATES[0]) is None:
        print("  (duplicates is not installed here: run the command above in the repository)")
        return
    out = subprocess.run(DUPLICATES, cwd=REPO, capture_output=True, text=True).stdout
    print("  " + out.splitlines()[0] if out else "  (no output)")


if __name__ == "__main__":
    main()
