"""Every choice of the cost model with a forest in the README job (ad-hoc, this page's): the call, the requests, the
step clock's verdict at that batch size (True: forests measured to pay, False: to lose, None: unmeasured), the
exploration budget's credit, whether a request waits, each candidate's probe flag and rate, the shapes and the floors;
five calls after vLLM's warm-up call (``_engine.readme_engine``).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/sure-floors-2026-12-07/choices_trace.py
"""
from _engine import readme_engine
from vllm_dsbd.engine import cost

llm, runner, prompts, params = readme_engine("dsbd")
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
for c in range(5):
    call[0] = c + 1
    llm.generate(prompts, params, use_tqdm=False)
