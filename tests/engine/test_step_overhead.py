"""The step-overhead benchmark (benchmarks/engine/step_overhead.py) runs and measures what it says: a smoke run at
batch 1 and 2, 12 tokens (with 6, a W = 1 request can finish in three steps, and its one measured middle step need
not draft). Its numbers are not asserted (speed is measured in benchmarks, never in tests), only that each row
timed real forward passes: the target's in every row, the draft's in the DSBD plain-request rows (the beam-search
row's median step may run no draft pass) and never in plain vLLM's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_step_overhead_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "step_overhead.py"),
                          "--batches", "1", "2",
                          "--max-tokens", "12", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    names = ("plain vLLM", "DSBD W=1 d=3", "DSBD W=2 d=3", "DSBD beam search W=4 d=3", "DSBD beam sampling W=4 d=3 T=1")
    assert {(r["config"], r["batch"]) for r in rows} == {(c, b) for c in names for b in (1, 2)}
    for r in rows:
        assert r["steps"] >= 1 and r["step_ms"] > 0 and r["target_fwd_ms"] > 0
        if "beam" not in r["config"]:
            assert (r["draft_fwd_ms"] > 0) == r["config"].startswith("DSBD"), r
        assert 0 < r["non_model_ms"] < r["step_ms"]
    assert "| config | batch |" in (tmp_path / "README.md").read_text()
