"""Every choice with a forest in the README job under the batch's end (ad-hoc, this page's): each candidate's probe
flag, the tokens left, its rate and the layers behind it, and the shapes; five calls after vLLM's warm-up call (the
engine of results/sure-floors-2026-12-07/_engine.py). probe_trace.txt is its output at af01e12, before
``cost._probes_alone``: each call's probe step (one request trying at 0.95) let all eight draft.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/batch-end-2026-12-07/probe_trace.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sure-floors-2026-12-07"))
from _engine import readme_engine  # noqa: E402

from vllm_dsbd.engine import cost  # noqa: E402

llm, runner, prompts, params = readme_engine("dsbd")
choose = cost.choose_shapes


def traced(cands, table, floor=None, left=None):
    got = choose(cands, table, floor, left)
    if any(d for _, d in got):
        print("probe", [int(c.probe) for c in cands], "left", left, "rates", [round(c.rate, 2) for c in cands],
              "tried", [round(c.tried) for c in cands], "shapes", got, flush=True)
    return got


cost.choose_shapes = traced
for c in range(5):
    print("call", c + 1, flush=True)
    llm.generate(prompts, params, use_tqdm=False)
