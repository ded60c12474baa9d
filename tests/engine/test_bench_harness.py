"""The benchmark harness end to end through the real vLLM on CPU, on a tiny random Llama pair (``--token-prompts``):
plain sampling, vLLM beam search, vLLM ``draft_model`` and one DSBD configuration in one run. Checks the files it
promises (CSV, JSON, PNG plots, results page) and that its numbers are consistent with what each method does."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)
import matplotlib  # noqa: E402,F401

from engine_utils import tiny_pair  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run_harness(tmp_path: Path, *args: str) -> Path:
    """Runs the harness in a subprocess on a tiny random pair with 1 + 1 token prompts; returns its output folder.
    Flat next-token laws (init_std 0.1): the draft's proposals are often accepted at temperature 1."""
    target, draft = tiny_pair()
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "harness" / "harness.py"), "--target", str(target), "--draft", str(draft),
           "--token-prompts", "--num-prompts", "1", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_harness_runs_and_reports(tmp_path):
    out = _run_harness(tmp_path, "--max-tokens", "24", "--widths", "2", "--depths", "2", "--beam-widths", "2",
                       "--configs", "^(plain|beam_search W=2|draft_model g=3|dsbd-single W=2 g=2 dyn)$")
    for name in ("results.csv", "results.json", "README.md", "passes_per_token.png", "tokens_per_s.png",
                 "quality.png", "width_histograms.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = {r["config"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"plain", "beam_search W=2", "draft_model g=3", "dsbd-single W=2 g=2 dyn"}
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    for r in rows.values():
        assert 2 <= r["tokens"] <= 2 * 24, r  # 2 prompts (EOS may end one early)
        assert r["quality_logp"] < 0
    assert rows["plain"]["passes_per_token"] == 1.0 and rows["beam_search W=2"]["passes_per_token"] == 1.0
    for name in ("draft_model g=3", "dsbd-single W=2 g=2 dyn"):
        r = rows[name]
        assert r["drafts"] > 0, r
        # vLLM draft_model: passes = prompts + drafts; DSBD's are counted by the engine (one per request and step),
        # which also counts a last step with no room for a forest; every accepted token saves one
        if r["kind"] == "dsbd":
            assert 2 + r["drafts"] <= r["target_passes"] <= 2 * 2 + r["drafts"], r
        else:
            assert r["target_passes"] == 2 + r["drafts"], r
        assert r["passes_per_token"] <= 1.0, r
        assert r["acceptance_length"] == pytest.approx(1 + r["accepted"] / r["drafts"])
    # DSBD's beam draft is accepted on these flat laws (vLLM's draft_model, a sampling draft of the same laws, may
    # accept none of its few proposals in so short a run: its count is not asserted)
    assert rows["dsbd-single W=2 g=2 dyn"]["accepted"] > 0 and rows["dsbd-single W=2 g=2 dyn"]["passes_per_token"] < 1.0
    hist = rows["dsbd-single W=2 g=2 dyn"]["width_hist"]
    assert set(hist) <= {"1", "2"} and hist, hist  # layers 1..depth
    assert all(1 <= int(w) <= 2 for h in hist.values() for w in h)
    page = (out / "README.md").read_text()
    assert "## Goals" in page and "dsbd-single W=2 g=2 dyn" in page  # the goals section


def test_harness_top_k_reaches_every_engine(tmp_path):
    """``--top-k 1`` at temperature 1 leaves one token per step: plain sampling, vLLM ``draft_model`` and DSBD W = 1
    must then all give the target's greedy tokens, although their seeds and random streams differ. On these flat
    laws any engine that sampled without the truncation would leave the greedy path within a few tokens. DSBD runs
    with the cost model (the default: on these tiny CPU models it may draft nothing) and with pinned shapes
    (``--pinned``: every step drafts), whose drafts are asserted."""
    out = _run_harness(tmp_path, "--max-tokens", "16", "--widths", "1", "--depths", "2", "--beam-widths", "",
                       "--top-k", "1", "--pinned", "--configs",
                       "^(plain|draft_model g=3|dsbd W=1 g=2|dsbd-pinned W=1 g=2)$")
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["top_k"] == 1 and "top-k 1" in (out / "README.md").read_text()
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "draft_model g=3", "dsbd W=1 g=2", "dsbd-pinned W=1 g=2"}
    assert rows["dsbd-pinned W=1 g=2"]["drafts"] > 0 and rows["draft_model g=3"]["drafts"] > 0
    greedy = rows["plain"]["outputs"]
    assert sum(len(o) for o in greedy) >= 16, greedy  # 2 prompts x 16 tokens; EOS may end one early
    for config in ("draft_model g=3", "dsbd W=1 g=2", "dsbd-pinned W=1 g=2"):
        assert rows[config]["outputs"] == greedy, config


@pytest.mark.parametrize("flag", [["--top-p", "0"], ["--top-p", "1.5"], ["--top-k", "-1"]])
def test_harness_rejects_bad_truncation(flag):
    # the harness as a script (its modules import from its folder): argparse's usage error, exit status 2
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "harness" / "harness.py"), *flag],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--top-k must be >= 0" in proc.stderr
