"""A/B of the static draft loops on one engine configuration (CPU): ``python ab_static_drafting.py BATCH TEMPERATURE
STATIC [profile]`` runs benchmarks/engine/step_overhead.py's beam row (W = 4, depth 3 pinned, 24 tokens) at BATCH with the
drafter's ``static_drafting`` set to STATIC (1 / 0) and prints the row; a fourth argument adds a cProfile of the
package's functions over the engine steps."""
import cProfile, importlib.util, pathlib, pstats, sys, os
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import torch; torch.set_num_threads(1)
_spec = importlib.util.spec_from_file_location(  # the benchmark, loaded from its file
    "step_overhead", pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "engine" / "step_overhead.py")
so = sys.modules["step_overhead"] = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(so)
from vllm_dsbd.engine import drafter as dm
static = sys.argv[3] == "1"
init = dm.DSBDDrafter.__init__
def new_init(self, *a, **k):
    init(self, *a, **k); self.static_drafting = static
dm.DSBDDrafter.__init__ = new_init
from vllm.v1.engine.llm_engine import LLMEngine
pr = cProfile.Profile()
orig = LLMEngine.step
prof = len(sys.argv) > 4
def step(self, *a, **k):
    if prof: pr.enable()
    try: return orig(self, *a, **k)
    finally:
        if prof: pr.disable()
LLMEngine.step = step
from vllm_dsbd.testing.models import tiny_llama_pair
t, d = tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3, draft_layers=2)
cfg = {"name": "x", "width": 4, "depth": 3, "beam": 4, "temperature": float(sys.argv[2])}
r = so.measure(t, d, cfg, int(sys.argv[1]), 24)
print("RESULT", static, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
if prof:
    st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats("vllm_dsbd|triton_kernels", 40)
