"""The README job's host work per step on one engine, by part (ad-hoc, this page's): perf_counter wrappers around the
runner's sample_tokens, _sample, _bare_sample, the cost model (_load_levels, _choose_depths, cost.choose_shapes),
drafting (propose_draft_token_ids), the recycle rows' intake (LateRows.add / drain) and StepClock.finish; three calls
after a warm-up call; per call each part's count, median and total (ms).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/sure-floors-2026-12-07/host_parts.py [dsbd|none|plain]
"""
import os, sys, time, statistics, collections
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import demo_vllm as demo
import vllm
from vllm_dsbd.engine import cost, shapes, bare, step_clock, proposing, source_drafter, runner as rmod
kind = sys.argv[1] if len(sys.argv) > 1 else "dsbd"
spec = {"plain": None, "dsbd": {"method": "dsbd"}, "none": {"method": "dsbd", "sources": []}}[kind]
target, prompts, params = demo.readme_job()
llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
               speculative_config=spec)
llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
llm.generate(prompts, params, use_tqdm=False)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
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
