"""The package's import graph has no circle (``scripts/import_cycles.py``, imports inside functions counted), and the
script would see one: a planted package whose circle closes only through a function-level import is reported.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _graph(ic, root: Path):
    lazy: set[tuple[str, str]] = set()
    return ic.edges(ic.modules(root), lazy), lazy


def test_no_import_cycle():
    ic = _script()
    graph, lazy = _graph(ic, ROOT / "vllm_dsbd")
    assert len(graph) > 50 and lazy, "the script read too little of the package"
    assert ic.cycles(graph) == []
    assert ic.main([str(ROOT / "vllm_dsbd")]) == 0


def test_function_level_circle_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n\n"
                              "def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("try:\n    from pkg.a import f\nexcept ImportError:\n    f = None\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    ic = _script()
    graph, lazy = _graph(ic, pkg)
    assert ("pkg.b", "pkg.c") in lazy and ("pkg.a", "pkg.b") not in lazy
    assert graph["pkg.d"] == set()  # under TYPE_CHECKING: not an import at run time
    assert ic.cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert ic.main([str(pkg)]) == 1
