"""Every choice of the cost model with a forest in the README job (ad-hoc, this page's): the call, the requests, the
step clock's verdict at that batch size (True: forests measured to pay, False: to lose, None: unmeasured), the
exploration budget's credit, whether a request waits, each candidate's probe flag and rate, the shapes and the floors;
five calls after a warm-up call.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/sure-floors-2026-12-07/choices_trace.py
"""
import os, sys, time, collections
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import demo_vllm as demo
import vllm
from vllm_dsbd.engine import cost, shapes
target, prompts, params = demo.readme_job()
llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
               speculative_config={"method": "dsbd"})
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
o_cs = cost.choose_shapes
call = [0]
def cs(cands, table, floor=None):
    r = o_cs(cands, table, floor)
    if any(d for _, d in r):
        clk = runner._dsbd_clock
        v = clk.verdict(len(cands)) if clk else None
        print(f"call {call[0]} reqs {len(cands)} verdict {v} credit {runner.dsbd_explore.credit:.2f} waiting {runner._dsbd_waiting} "
              f"probe {[int(c.probe) for c in cands]} rates {[round(c.rate,2) for c in cands]} shapes {r} floors {None if floor is None else [round(f,3) for f in floor]}", flush=True)
    return r
cost.choose_shapes = cs
llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
for c in range(5):
    call[0] = c + 1
    llm.generate(prompts, params, use_tqdm=False)
