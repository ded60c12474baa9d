"""Lists the imports among vllm_dsbd's modules and reports any circle (exit status 1 if there is one).

Usage: ``python scripts/import_cycles.py [package folder ...]`` (default: vllm_dsbd). Reads the sources with ``ast``
(imports nothing). Every import statement counts, at module level or inside a function or class body (a lazy import
is still a dependency); only those under ``if TYPE_CHECKING:`` do not. ``from X import name`` points at ``X.name``
when that is a module of the package, else at ``X``. The implicit import of a module's parent packages is not counted
(a package's ``__init__`` importing its own submodules is the usual, harmless pattern). ``-v`` prints every edge,
lazy ones marked. ``tests/unit/test_import_cycles.py`` runs it in CI.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(body: list[ast.stmt], lazy: bool = False):
    """(import statement, whether it runs only when a function is called) for every import in ``body``, at any
    depth, except under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        elif isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name != "TYPE_CHECKING":
                yield from _imports(node.body, lazy)
            yield from _imports(node.orelse, lazy)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports(node.body, True)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                part = getattr(node, field, None)
                if isinstance(part, list):
                    yield from _imports([x for x in part if isinstance(x, ast.AST)], lazy)


def edges(mods: dict[str, Path], lazy_out: set[tuple[str, str]] | None = None) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any level); ``lazy_out`` collects the edges made only by
    imports inside functions."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    eager: set[tuple[str, str]] = set()
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node, lazy in _imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:  # ``import a.b.c`` of a non-module attribute: its module
                    t = t.rpartition(".")[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
                    if not lazy:
                        eager.add((mod, t))
    if lazy_out is not None:
        lazy_out.update((m, t) for m in graph for t in graph[m] if (m, t) not in eager)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    roots = [Path(a) for a in argv if a != "-v"] or [Path(__file__).resolve().parent.parent / "vllm_dsbd"]
    mods: dict[str, Path] = {}
    for root in roots:
        mods.update(modules(root))
    lazy: set[tuple[str, str]] = set()
    graph = edges(mods, lazy)
    if verbose:
        for m in sorted(graph):
            for t in sorted(graph[m]):
                print(f"{m} -> {t}" + (" (lazy)" if (m, t) in lazy else ""))
    found = cycles(graph)
    print(f"{len(mods)} modules, {sum(map(len, graph.values()))} imports among them ({len(lazy)} only inside "
          f"functions), {len(found)} circle(s)")
    for comp in found:
        print("circle:", " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
