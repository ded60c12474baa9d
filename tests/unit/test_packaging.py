"""The kernels folder never stands in for Triton's `triton_kernels`, even with the repository root on sys.path."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str) -> subprocess.CompletedProcess:
    # `python -c` from the repository root puts the root first on sys.path: the dangerous case
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_import_triton_kernels_from_repo_root_fails_cleanly():
    r = run("import triton_kernels")
    assert r.returncode != 0 and "dsbd_kernels" in r.stderr


def test_dsbd_kernels_imports():
    r = run("import dsbd_kernels, vllm_dsbd.core; print(dsbd_kernels.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "dsbd_kernels"


def test_vllm_does_not_take_our_folder_for_triton_kernels():
    r = run("from vllm.utils.import_utils import _has_module; print(_has_module('triton_kernels'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_vllm_cli_runs_and_offers_speculative_method():
    """The CLI needs the `vllm` metadata stub of scripts/setup_env.sh (with its +cpu tag, which vLLM's platform
    detection reads) and shows the plugin's alias."""
    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
                       cwd="/", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--speculative-method" in r.stdout and "dsbd" in r.stdout
