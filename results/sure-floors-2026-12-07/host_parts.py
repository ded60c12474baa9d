"""The README job's host work per step on one engine, by part (ad-hoc, this page's): perf_counter wrappers around the
runner's sample_tokens, _sample, _bare_sample, the cost model (_load_levels, _choose_depths, cost.choose_shapes),
drafting (propose_draft_token_ids), the recycle rows' intake (LateRows.add / drain) and StepClock.finish; three calls
after a warm-up call; per call each part's count, median and total (ms).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/sure-floors-2026-12-07/host_parts.py [dsbd|none|plain]
"""
import collections, statistics, sys, time

from _engine import readme_engine
from vllm_dsbd.engine import bare, shapes, step_clock

kind = sys.argv[1] if len(sys.argv) > 1 else "dsbd"
llm, runner, prompts, params = readme_engine(kind)
llm.generate(prompts, params, use_tqdm=False)
acc = collections.defaultdict(list)
def wrap(obj, name, key):
    fn = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: acc[key].append(time.perf_counter() - t)
    setattr(obj, name, w)
cls = type(runner)
for name in ["sample_tokens", "_sample", "_choose_depths", "_load_levels", "propose_draft_token_ids", "_bare_sample"]:
    for k in cls.__mro__:
        if name in k.__dict__:
            wrap(k, name, name); break
wrap(shapes.cost, "choose_shapes", "choose_shapes")
wrap(bare.LateRows, "add", "late_add"); wrap(bare.LateRows, "drain", "late_drain")
wrap(step_clock.StepClock, "finish", "clock_finish")
for c in range(3):
    acc.clear(); t0 = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); secs = time.perf_counter() - t0
    print(f"{kind} call {c+2}: {secs:.2f} s; " + "; ".join(f"{k} n={len(v)} med {1e3*statistics.median(v):.2f} tot {1e3*sum(v):.0f}" for k, v in acc.items()), flush=True)
