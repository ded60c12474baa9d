"""Shared test setup.

Layout: ``unit/`` (pure Python / torch units), ``kernels/`` (Triton kernels against torch references), ``method/``
(exactness and law of the algorithm without an engine), ``engine/`` (tests that start a vLLM engine), ``serve/``
(OpenAI server and soak subprocesses), ``helpers/`` (modules the tests import: chisq, kernel_utils, engine_utils, ...).

- ``helpers/`` and every test folder are importable (``import chisq``, ``from test_engine_beams import ...``: some
  tests reuse another test module's fixtures); test module names are unique across folders (checked here). The
  repository root is NOT put on sys.path, so `import triton_kernels` can never resolve to our kernels folder.
- Without a GPU, Triton kernels run in the interpreter. Triton decides this when our kernels are first imported, so
  the variable is set here, before any test module imports them.
- Markers (registered in pyproject.toml): ``engine`` is given here to every test under ``engine/`` and ``serve/``;
  ``gpu`` (the set ``benchmarks/gpu/check.sh`` runs) and ``slow`` are set in the test files themselves. With exactly
  ``-m gpu`` a test file without the gpu mark is not even imported: the GPU machine lacks some of what other test
  files import at module level (Ray, matplotlib, ...), and an import error fails a run whatever the selection.
- ``tiny_pair``: the tiny random Llama pair most engine tests use (``engine_utils.tiny_pair``), built once.
"""
import collections
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = ("helpers", "unit", "kernels", "method", "engine", "serve")
ENGINE_FOLDERS = ("engine", "serve")

_names = collections.Counter(f for d in FOLDERS for f in os.listdir(os.path.join(HERE, d))
                             if f.endswith(".py") and f != "conftest.py")
_clashes = sorted(n for n, c in _names.items() if c > 1)
assert not _clashes, f"module names used in two test folders (they share one sys.path): {_clashes}"
for _d in reversed(FOLDERS):
    sys.path.insert(0, os.path.join(HERE, _d))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_ignore_collect(collection_path, config):
    if (config.getoption("markexpr") == "gpu" and collection_path.name.startswith("test_")
            and collection_path.suffix == ".py"):
        return "pytest.mark.gpu" not in collection_path.read_text()
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = os.path.relpath(str(item.path), HERE).split(os.sep)
        if parts[0] in ENGINE_FOLDERS:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_pair():
    """(target folder, draft folder): the tiny random Llama pair (3-layer target, its first 2 layers as the draft)."""
    from engine_utils import tiny_pair as build

    return build()
