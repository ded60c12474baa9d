"""How often cost.floors_exclude returns the README job's choices at once (ad-hoc, this page's): wraps
cost.choose_shapes / none_can_pay / floors_exclude over three calls after a warm-up call; prints the counts, the median
time of choices with and without a forest (ms), and up to three choices without a forest where the bound did not fire
(their table, floors, the choice without floors, the candidates).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/sure-floors-2026-12-07/bound_fires.py
"""
import collections, statistics, time

from _engine import readme_engine
from vllm_dsbd.engine import cost

llm, runner, prompts, params = readme_engine("dsbd")
llm.generate(prompts, params, use_tqdm=False)
cnt = collections.Counter(); tm = collections.defaultdict(list); ex = []
o_cs, o_ncp, o_fe = cost.choose_shapes, cost.none_can_pay, cost.floors_exclude
def ncp(*a):
    r = o_ncp(*a); cnt["none_can_pay"] += r; return r
def fe(*a):
    r = o_fe(*a); cnt["floors_exclude"] += r; return r
def cs(cands, table, floor=None):
    f0 = cnt["floors_exclude"]
    t = time.perf_counter(); r = o_cs(cands, table, floor); dt = time.perf_counter() - t
    fired = cnt["floors_exclude"] > f0
    nodes = sum(w*d for w, d in r); cnt["calls"] += 1; cnt["forest"] += nodes > 0
    tm["forest" if nodes else "none"].append(dt)
    if nodes == 0 and len(ex) < 6 and floor is not None and not fired and len(cands) > 1: ex.append((cands, table, floor))
    return r
cost.none_can_pay, cost.floors_exclude, cost.choose_shapes = ncp, fe, cs
for c in range(3):
    llm.generate(prompts, params, use_tqdm=False)
print(dict(cnt), {k: (len(v), round(1e3*statistics.median(v), 3)) for k, v in tm.items()})
for cands, table, floor in ex[:3]:
    print(table.describe()); print("floors", [round(f,3) for f in floor]); print("nofloor", o_cs(cands, table, None))
    for c in cands: print("  ", c)
