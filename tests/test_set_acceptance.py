"""The benchmark-only set-rate acceptance (``benchmarks/set_acceptance.py``): its accepted path is a real
root-to-leaf path of the forest, and the package never imports it (the serving path cannot reach it)."""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import set_acceptance  # noqa: E402


def test_chain_is_the_path_to_the_first_deepest_node():
    # compact order: depth 1 nodes 0, 1; depth 2 nodes 2 (child of 1), 3 (child of 0); depth 3 node 4 (child of 3)
    parents, depths = [-1, -1, 1, 0, 3], [1, 1, 2, 2, 3]
    assert set_acceptance.chain(parents, depths) == [0, 3, 4]
    assert set_acceptance.chain([-1, -1, 1], [1, 1, 2]) == [1, 2]
    assert set_acceptance.chain([], []) == []


def test_package_never_imports_it():
    hits = [p for p in (ROOT / "vllm_dsbd").rglob("*.py") if "set_acceptance" in p.read_text()]
    assert hits == []
