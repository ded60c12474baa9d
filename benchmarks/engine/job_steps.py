"""Where the README main job's time goes, step by step (CPU): the job's 8 prompts (greedy, 48 tokens) on one engine,
``--calls`` calls after the demo's warm-up, the engine core in this process.

Per call, the steps grouped by batch size and by whether forest nodes were scheduled (``spec``) or none (``bare``),
prefill steps apart; per group the median milliseconds of the step (``EngineCore.step``), the target forward
(``_model_forward``) and inside it vLLM's CPU attention kernel and its GEMMs (``onednn_mm``), the forest attention's
recompute, the runner's ``sample_tokens`` / ``_sample`` (verification), drafting (``propose_draft_token_ids``) and
``_prepare_inputs``. On a DSBD engine also the cost model's account of the call: the nodes it asked for, the nodes the
drafter built (``draft_nodes``), the extra tokens it expected and those accepted (tokens emitted beyond one per request
per pass).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/job_steps.py [--engine dsbd|none|plain]
        [--calls 3]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_vllm as demo  # noqa: E402

ENGINES = {"plain": None, "dsbd": {"method": "dsbd"}, "none": {"method": "dsbd", "sources": []}}
COLUMNS = ["step", "_model_forward", "cpu_attn", "onednn_mm", "recompute", "sample_tokens", "_sample",
           "propose_draft_token_ids", "_prepare_inputs"]


def _timed(obj, name: str, key: str, acc: collections.Counter, calls: collections.Counter | None = None) -> None:
    """``obj.name`` wrapped on the instance: its wall seconds into ``acc[key]`` (and its calls into ``calls[key]``)."""
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
            if calls is not None:
                calls[key] += 1

    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="dsbd", choices=list(ENGINES))
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import vllm
    import vllm._custom_ops as ops

    from vllm_dsbd.engine import attention, cost
    from vllm_dsbd.testing.engines import shutdown

    target, prompts, params = demo.readme_job()
    acc, asked = collections.Counter(), []
    _timed(attention, "recompute_forest_outputs", "recompute", acc)
    for name in ("cpu_attention_with_kv_cache", "onednn_mm"):
        _timed(ops, name, name.split("_with")[0].replace("cpu_attention", "cpu_attn"), acc)
    choose = cost.choose_shapes

    def traced(cands, table, floor=None, left=None):
        shapes = choose(cands, table, floor, left)
        step = cost._Step(cands, list(shapes), table)
        asked.append((sum(step.expect) - len(cands), sum(w * d for w, d in shapes)))
        return shapes

    cost.choose_shapes = traced
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                   speculative_config=ENGINES[args.engine])
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    for name in COLUMNS[5:] + ["_model_forward"]:
        if hasattr(runner, name):
            _timed(runner, name, name, acc)
    info, rec = {}, []
    schedule, step_fn = core.scheduler.schedule, core.step_fn

    def sched(*a, **k):
        out = schedule(*a, **k)
        info.update(n=out.total_num_scheduled_tokens, reqs=len(out.num_scheduled_tokens),
                    spec=sum(len(v) for v in out.scheduled_spec_decode_tokens.values()))
        return out

    def step():
        acc.clear()
        t0 = time.perf_counter()
        out = step_fn()
        rec.append(dict(acc, step=time.perf_counter() - t0, **info))
        return out

    core.scheduler.schedule, core.step_fn = sched, step
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # the demo's warm-up
    stats = getattr(runner, "dsbd_stats", None)
    for c in range(args.calls):
        rec.clear()
        asked.clear()
        before = None if stats is None else (stats.iterations, stats.tokens, stats.draft_nodes)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"\ncall {c + 1} ({args.engine}): {n} tokens in {secs:.2f} s, {n / secs:.1f} tok/s, {len(rec)} steps")
        if before is not None:
            iters, toks, nodes = (stats.iterations - before[0], stats.tokens - before[1],
                                  stats.draft_nodes - before[2])
            print(f"  cost model: {sum(a for _, a in asked)} nodes asked in {sum(a > 0 for _, a in asked)} of "
                  f"{len(asked)} choices, {nodes} built; {sum(e for e, _ in asked):.1f} extra tokens expected, "
                  f"{toks - iters} accepted")
        groups = collections.defaultdict(list)
        for r in rec:
            if not r.get("reqs"):
                continue
            key = "prefill" if r["n"] - r["spec"] > r["reqs"] else f"b{r['reqs']} {'spec' if r['spec'] else 'bare'}"
            groups[key].append(r)
        print(f"  {'group':10s} {'steps':>5s} {'nodes':>5s} | " + " ".join(f"{k.strip('_')[:10]:>10s}" for k in COLUMNS)
              + "   (median ms)")
        for key in sorted(groups, key=lambda g: (g == "prefill", g)):
            rs = groups[key]
            print(f"  {key:10s} {len(rs):5d} {sum(r['spec'] for r in rs) / len(rs):5.1f} | "
                  + " ".join(f"{1e3 * statistics.median(r.get(k, 0.0) for r in rs):10.1f}" for k in COLUMNS))
    shutdown(llm)


if __name__ == "__main__":
    main()
