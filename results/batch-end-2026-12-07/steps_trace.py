"""The README job's calls step by step under the batch's end (ad-hoc, this page's): per call, the engine's steps, the
cost model's choices and those with a forest, and the tokens; the user's engine as it is (``end``) and with
``choose_shapes`` called without ``left`` (``noend``: the floors alone, the rule before), five calls each after
vLLM's warm-up call (the engine of results/sure-floors-2026-12-07/_engine.py).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/batch-end-2026-12-07/steps_trace.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sure-floors-2026-12-07"))
from _engine import readme_engine  # noqa: E402

from vllm_dsbd.engine import cost  # noqa: E402

llm, runner, prompts, params = readme_engine("dsbd")
choose, step = cost.choose_shapes, llm.llm_engine.step
count = {}


def traced(cands, table, floor=None, left=None):
    got = choose(cands, table, floor, left if count["rule"] == "end" else None)
    count["choices"] += 1
    count["forests"] += any(d for _, d in got)
    return got


def counted():
    count["steps"] += 1
    return step()


cost.choose_shapes, llm.llm_engine.step = traced, counted
for rule in ("end", "noend"):
    for c in range(5):
        count.update(rule=rule, steps=0, choices=0, forests=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{rule} call {c + 1}: {count['steps']} engine steps, {count['choices']} choices, "
              f"{count['forests']} with a forest, {n} tokens", flush=True)
