"""Each engine step's wall time at batch 128 (batch_ab.py's prompts, the user's engine at 6469b0e, 3 calls), from
``execute_model`` to the end of ``sample_tokens``, with its rows, scheduled tokens, whether it held a prefill (a new
or resumed request's), the forests it verified (planned the step before) and those it drafted; printed for steps with
forests or over 0.6 s, and the median bare decode step at 100 rows or more.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/kv-pressure-2026-12-08/step_times.py
"""
import statistics
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import sources_wall  # noqa: E402,F401  (sets the CPU engine's environment before vLLM)
from batch_ab import _mixed  # noqa: E402
from draftfree import prompts as kind_prompts  # noqa: E402
def main():
    import torch, vllm
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir
    torch.set_num_threads(2)
    folder = smollm2_dir()
    prompts = [{"prompt_token_ids": p} for p in _mixed(kind_prompts(load_tokenizer(folder), 32))][:128]
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=48)
    llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                   max_num_seqs=128, speculative_config={"method": "dsbd"})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    last = [0]; log = []
    cd = runner._choose_depths
    def cdw(levels, shapes, states, discard, catch_ups=None):
        out = cd(levels, shapes, states, discard, catch_ups); last[0] = sum(lv.depth > 0 for lv in out); return out
    runner._choose_depths = cdw
    em, st = runner.execute_model, runner.sample_tokens
    t = {}
    def emw(*a, **k):
        so = a[0] if a else k["scheduler_output"]
        t["f"] = last[0]; t["rows"] = len(so.num_scheduled_tokens); t["tok"] = so.total_num_scheduled_tokens
        t["new"] = bool(so.scheduled_new_reqs or so.scheduled_cached_reqs.resumed_req_ids); t["t0"] = time.perf_counter()
        return em(*a, **k)
    def stw(*a, **k):
        last[0] = 0
        out = st(*a, **k)
        log.append((t["rows"], t["tok"], t["new"], t["f"], last[0], time.perf_counter() - t["t0"]))
        return out
    runner.execute_model, runner.sample_tokens = emw, stw
    for c in range(3):
        log.clear(); t0 = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
        print(f"call {c}: {time.perf_counter() - t0:.2f} s, {len(log)} steps")
        print("  (rows, tokens, prefill, forests verified, forests drafted, seconds) of steps with forests or > 0.6 s:")
        for r in log:
            if r[3] or r[4] or r[5] > 0.6:
                print("   ", r[:5], f"{r[5]:.3f}")
        bare = [r[5] for r in log if not r[2] and not r[3] and not r[4] and r[0] >= 100]
        if bare: print(f"  bare decode steps at >= 100 rows: median {statistics.median(bare):.3f} s over {len(bare)}")
main()
