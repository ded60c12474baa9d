"""The GPU benchmark scripts' flows on CPU (``--tiny``), so a GPU loan never finds them broken: ``large_model.py`` with
the plain and DSBD engines (with the draft model, draft-free, with an EAGLE-3 head alone and mixed with the sources),
``step_profile.py`` with the DSBD engine, and ``decompose.py`` (plain vLLM against DSBD without forests, the rows that
need CUDA skipped with the reason, the time budget), each in a subprocess through the real vLLM.
Checked beyond "it ran": rows that say "depth 3 pinned" drafted depth 3 in every decision the engine counted and
needed fewer target passes than tokens at the set rate 0.8; rows of the user's engine (cost model) record the depths
it chose, one per request and decoding step; the report has every row."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm  # noqa: F401  (a broken vLLM must fail the suite, never skip it)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, script: str, *args: str) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / script), "--tiny", "--work", str(tmp_path / "models"),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_large_model_rows_say_what_they_drafted(tmp_path):
    out = tmp_path / "lm"
    _run(tmp_path, "large_model.py", "--engines", "plain,dsbd,dsbd_free,dsbd_head,dsbd_head_mixed", "--batches", "1",
         "--b1-prompts", "1",
         "--max-tokens", "8", "--beam-tokens", "5", "--rates", "0.8", "--widths", "4", "--out", str(out))
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    methods = [r["method"] for r in rows]
    assert methods[:2] == ["plain sampling", "vLLM beam_search"], methods
    pinned_plain = next(r for r in rows if r["method"] == "DSBD plain requests, depth 3 pinned (set rate)")
    assert pinned_plain["depths"] == {"3": pinned_plain["passes"]}, pinned_plain
    assert pinned_plain["passes"] < pinned_plain["tokens"], pinned_plain  # layers passed at rate 0.8
    auto = next(r for r in rows if r["method"] == "DSBD plain requests, cost model (set rate)")
    assert sum(auto["depths"].values()) == auto["passes"], auto  # one decision per decoding step (batch 1)
    pinned_beam = next(r for r in rows if r["method"] == "DSBD beam search, depth 3 pinned (set rate)")
    assert pinned_beam["passes"] < pinned_beam["tokens"], pinned_beam
    depth0 = next(r for r in rows if r["method"] == "in-engine beam search (depth 0)")
    assert depth0["passes"] == depth0["tokens"], depth0
    free = next(r for r in rows if r["method"] == "DSBD draft-free plain requests, depth 3 pinned (set rate)")
    assert free["depths"] == {"3": free["passes"]}, free  # the engine without a draft model drafted its forests
    head = next(r for r in rows if r["method"] == "DSBD EAGLE-3 head plain requests, depth 3 pinned (set rate)")
    assert head["depths"] == {"3": head["passes"]} and head["passes"] < head["tokens"], head  # the head drafted
    head_beam = next(r for r in rows if r["method"] == "DSBD EAGLE-3 head beam search, depth 3 pinned (set rate)")
    assert head_beam["passes"] < head_beam["tokens"], head_beam
    mixed = next(r for r in rows
                 if r["method"] == "DSBD EAGLE-3 head + sources plain requests, depth 3 pinned (set rate)")
    assert mixed["depths"] == {"3": mixed["passes"]} and mixed["passes"] < mixed["tokens"], mixed
    report = (out / "README.md").read_text()
    assert report.count("\n| ") == len(rows) + 1, report  # header + one line per row


def test_step_profile_rows_say_what_they_drafted(tmp_path):
    out = tmp_path / "sp"
    _run(tmp_path, "step_profile.py", "--engines", "dsbd", "--batches", "1", "--widths", "4", "--steps", "3",
         "--out", str(out))
    rows = {r["engine"]: r for r in json.loads((out / "step_profile.json").read_text())["rows"]}
    assert set(rows) == {"DSBD W=4 d=3 pinned", "DSBD W=4, cost model"}, rows
    pinned = rows["DSBD W=4 d=3 pinned"]
    assert set(pinned["depths"]) == {"3"} and pinned["draft forward"] > 0, pinned
    auto = rows["DSBD W=4, cost model"]
    assert sum(auto["depths"].values()) > 0, auto
    assert all(r["step_ms"] > 0 and r["target forward"] > 0 for r in rows.values()), rows


def test_decompose_rows_are_numbers_or_say_why(tmp_path):
    """decompose.py (issue 47 item 1) on CPU: plain vLLM (d) and DSBD ``"sources": []`` start together in subprocesses
    of their own and measure one after the other; the rows that need CUDA or the V2 runner say so."""
    out = tmp_path / "dec"
    _run(tmp_path, "decompose.py", "--engines", "d,dsbd_none,a,b,ngram_gpu", "--batches", "1,2", "--steps", "3",
         "--prof-steps", "2", "--out", str(out))
    engines = json.loads((out / "decompose.json").read_text())["engines"]
    for name, spec in (("d", None), ("dsbd_none", "dsbd")):
        res = engines[name]
        assert not res.get("error") and res["info"]["runner"] == "V1" and res["info"]["spec"] == spec, res
        assert [r["batch"] for r in res["rows"]] == [1, 2], res
        for r in res["rows"]:
            assert r["step_ms"] > 0 and r["ms_per_token"] > 0 and r["phases_ms"]["forward"] > 0, r
            assert r["tokens_per_req_step"] == 1.0 and r["spec_slots_per_step"] == 0, r  # nothing drafted
            assert r["profile"]["aten ops"] > 0 and r["sync"] is None, r  # no CUDA: no sync-debug pass
    assert engines["dsbd_none"]["rows"][0]["depths"] == {}, engines["dsbd_none"]  # a DSBD engine, no forests
    for name in ("a", "b", "ngram_gpu"):
        assert engines[name]["skipped"].startswith("needs CUDA: "), engines[name]
    readme = (out / "README.md").read_text()
    tax = next(line for line in readme.splitlines() if line.startswith("| 1 | - | - | - | "))
    assert tax.split(" | ")[9] not in ("-", ""), tax  # DSBD [] - (d) at batch 1
    assert "V2 model runner" in readme, readme


def test_decompose_keeps_to_its_budget(tmp_path):
    """No time left: no engine starts, each says why (the parent alone: no vLLM engine)."""
    out = tmp_path / "dec"
    _run(tmp_path, "decompose.py", "--engines", "d,c", "--budget-s", "1", "--out", str(out))
    engines = json.loads((out / "decompose.json").read_text())["engines"]
    assert engines["d"]["skipped"].startswith("not run: ") and "budget" in engines["d"]["skipped"], engines
    assert engines["c"]["skipped"].startswith("needs CUDA"), engines


def test_decompose_counters_without_an_engine(monkeypatch):
    """The GPU-only sync-debug pass (stacks of torch's "called a synchronizing CUDA operation" warnings) and the
    profiler's counters, driven by a stand-in engine: no CUDA and no vLLM needed."""
    import warnings

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import decompose

    class Engine:
        def step(self):
            torch.ones(8).add_(1).sum()
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    got = decompose.sync_stacks(Engine(), 3)
    assert got["syncs per step"] == 1 and len(got["stacks"]) == 1 and got["stacks"][0][1] == 3, got
    assert "test_gpu_scripts_tiny.py:" in got["stacks"][0][0], got
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = decompose.profile_counts(Engine(), 2, cuda=False)
    assert counts["aten ops"] >= 3 and "launches" not in counts, counts


def test_decompose_report_of_a_gpu_run(monkeypatch):
    """The tables a GPU run writes (every engine, the profiler's CUDA counts, sync stacks), from made-up rows: the tax
    columns are the differences of the right rows and the V1 question is answered."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import decompose

    step = {"a": 6.0, "b": 6.6, "c": 7.0, "d": 8.0, "dsbd_none": 19.0, "dsbd_default": 20.0, "ngram": 9.0,
            "ngram_gpu": 7.0}
    cfg = {"a": ("V2", "FULL_AND_PIECEWISE", True), "b": ("V1", "FULL_AND_PIECEWISE", True),
           "c": ("V1", "PIECEWISE", True), "ngram_gpu": ("V1", "FULL_AND_PIECEWISE", True)}
    profile = {"launches": 900, "graph launches": 33, "kernels run": 1200, "memcpy HtoD": 5, "memcpy DtoH": 3,
               "memcpy DtoD": 1, "syncs": 4, "blocking cudaMemcpy": 0, "gpu busy ms": 6.5, "aten ops": 700}
    results = {n: {"name": n, "info": dict(zip(("runner", "cudagraph_mode", "async"), cfg.get(n, ("V1", "PIECEWISE",
                                                                                                 False))),
                                           startup_s=40.0, spec=None),
                   "rows": [{"batch": b, "step_ms": ms * (1 + (b > 1)), "ms_per_token": ms, "tokens_per_req_step": 1.0,
                             "spec_slots_per_step": 0.0, "phases_ms": dict.fromkeys(decompose.COLUMNS, 0.1),
                             "profile": profile, "sync": {"syncs per step": 4, "stacks": [("vllm_dsbd/x.py:1 f", 8)]},
                             **({"depths": {"0": 10}} if n.startswith("dsbd") else {})} for b in (1, 32)]}
               for n, ms in step.items()}
    results["ngram_gpu_sync"] = {"name": "ngram_gpu_sync", "skipped": "not run: 10 s of the 230 s budget left"}
    args = argparse.Namespace(tiny=False, prompt_len=128, steps=10, parallel=3, batches=[1, 32], prof_steps=3,
                              sync_steps=2)
    text = decompose.report(args, results, "NVIDIA H100 80GB HBM3")
    tax = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines()
           if line.startswith(("| 1 |", "| 32 |"))}
    assert tax["| 1"][5:10] == ["+0.60", "+0.40", "+1.00", "+2.00", "+11.00"], tax  # b-a, c-b, d-c, d-a, DSBD [] - d
    assert tax["| 1"][-1] == "yes (+10.0%) |" and tax["| 32"][12] == "+0.80", tax  # (b)/(a); ngram_gpu - (b)
    assert "`vllm_dsbd/x.py:1 f`" in text and "| 900.0 | 33.0 |" in text, text
    assert "- vLLM ngram_gpu, sync (`ngram_gpu_sync`): not run: 10 s" in text, text
