"""Where the cost model's beam tries go on this machine: per step, what the model chose (forest nodes, depth, the
rates it planned with), what the table predicted for the step's window and what the window took, for a draft-free
engine (``sources`` as given) beside the same engine with ``"sources": []``, run alternately in one process.

Rows (stdout, ``--json``): per engine the steps, the share that drafted, beam steps per target pass, the mean window
of bare and drafting steps, the predicted vs measured window of drafting steps, and the first/last step that
drafted; per-step records in the JSON. SmolLM2-135M float32, code-edit prompts of ``draftfree.py``,
``LLM.beam_search`` W = 4 (as ``sources_wall.py``'s beam row).

    python benchmarks/engine/beam_cost_profile.py [--kind code-edit] [--prompts 4] [--steps 16] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftfree import prompts as kind_prompts  # noqa: E402


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def profile(llm, ps, bp) -> dict:
    """Per-step records of one timed ``beam_search`` call on ``llm``."""
    from vllm_dsbd.engine import cost

    r = runner_of(llm)
    recs: list[dict] = []
    cur: dict = {}
    orig_choose, orig_exec, orig_sample = cost.choose_shapes, r.execute_model, r.sample_tokens

    def choose(cands, table, floor=None, left=None):
        shapes = orig_choose(cands, table, floor, left)
        cur["shapes"] = [(w, d) for w, d in shapes]
        cur["rates"] = [round(c.rate, 3) for c in cands]
        cur["predicted_draft"] = cost.draft_seconds(cands, shapes, table)
        cur["step_ms"], cur["draft_step_ms"] = 1e3 * table.step, 1e3 * table.draft_step
        cur["drafts"] = any(d for _, d in shapes)
        cur["tokens_if"] = sum(c.leaves for c in cands) + sum(w * d for w, d in shapes)
        cur["predicted_ms"] = 1e3 * (table.step + table.target_time(cur["tokens_if"]) + cur["predicted_draft"])
        return shapes

    def execute(*a, **k):
        so = a[0] if a else k["scheduler_output"]
        cur.clear()
        cur["t0"] = time.perf_counter()
        cur["tokens"] = so.total_num_scheduled_tokens
        cur["prefill"] = bool(so.scheduled_new_reqs)
        return orig_exec(*a, **k)

    def sample(*a, **k):
        out = orig_sample(*a, **k)
        if "t0" in cur:
            cur["window_ms"] = 1e3 * (time.perf_counter() - cur.pop("t0"))
            recs.append(dict(cur))
        return out

    cost.choose_shapes, r.execute_model, r.sample_tokens = choose, execute, sample
    try:
        t0 = time.perf_counter()
        llm.beam_search(ps, bp)
        secs = time.perf_counter() - t0
    finally:
        cost.choose_shapes = orig_choose
        del r.execute_model, r.sample_tokens
    return {"seconds": secs, "steps": recs}


def summary(name: str, got: dict) -> dict:
    recs = [s for s in got["steps"] if not s["prefill"]]
    draft = [s for s in recs if s.get("drafts")]
    verify = [i for i, s in enumerate(recs) if i > 0 and recs[i - 1].get("drafts")]
    bare = [s for i, s in enumerate(recs) if not s.get("drafts") and i not in verify]

    def mean(xs):
        return statistics.fmean(xs) if xs else float("nan")

    out = {"engine": name, "seconds": got["seconds"], "decode steps": len(recs), "drafting steps": len(draft),
           "bare window ms": mean([s["window_ms"] for s in bare]),
           "bare predicted ms": mean([s["predicted_ms"] for s in bare if "predicted_ms" in s]),
           "drafting window ms": mean([s["window_ms"] for s in draft]),
           "drafting predicted ms": mean([s["predicted_ms"] for s in draft]),
           "verifying window ms": mean([recs[i]["window_ms"] for i in verify]),
           "verifying tokens": mean([recs[i]["tokens"] for i in verify]),
           "drafting steps at": [i for i, s in enumerate(recs) if s.get("drafts")]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="code-edit")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sources", default="recycle,lookup")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    import vllm
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.testing.engines import shutdown
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    ps = [{"prompt_token_ids": p} for k, p in kind_prompts(load_tokenizer(folder), a.prompts) if k == a.kind]
    bp = BeamSearchParams(beam_width=4, max_tokens=a.steps, ignore_eos=True)
    results = []
    for rep in range(a.repeats):
        for s in (["none", a.sources] if rep % 2 == 0 else [a.sources, "none"]):
            spec = {"method": "dsbd", "width": 4, "sources": [] if s == "none" else s.split(",")}
            if s != "none":
                spec["num_speculative_tokens"] = 3
            llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                           max_num_seqs=8, disable_log_stats=False, speculative_config=spec)
            llm.beam_search(ps[:1], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
            got = profile(llm, ps, bp)
            shutdown(llm)
            sm = summary(s, got)
            print(json.dumps(sm), flush=True)
            results.append({"summary": sm, "steps": got["steps"]})
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
