"""The README job's host work per step outside the target's forward: the runner's ``sample_tokens`` (vLLM's sampler
and bookkeeping, and on a DSBD engine verification, the recycle harvest, the cost model and drafting), timed by a
wrapper, on one engine (plain, dsbd, none = ``"sources": []``), three calls after a warm-up call. Ad-hoc, this page's.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/last-floor-2026-12-07/host_per_step.py ENGINE
"""
import os, sys, time, statistics
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import demo_vllm as demo
import vllm
kind = sys.argv[1]
spec = {"plain": None, "dsbd": {"method": "dsbd"}, "none": {"method": "dsbd", "sources": []}}[kind]
target, prompts, params = demo.readme_job()
llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
               speculative_config=spec)
llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
llm.generate(prompts, params, use_tqdm=False)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
cls, times = type(runner), []
orig = cls.sample_tokens
def timed(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); times.append(time.perf_counter() - t); return r
cls.sample_tokens = timed
for c in range(3):
    times.clear(); t0 = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    print(f"{kind} call {c + 2}: {secs:.2f} s, {len(times)} steps; "
          f"sample_tokens median {1e3 * statistics.median(times):.2f} ms, "
          f"total {1e3 * sum(times):.0f} ms ({100 * sum(times) / secs:.1f}% of the call)", flush=True)
