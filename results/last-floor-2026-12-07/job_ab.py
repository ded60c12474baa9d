"""The README job's 8 prompts (greedy, 48 tokens) on engines in turn, three calls each, over ROUNDS rounds, in one
process; per call index each round's ratio to the first engine's and the median. Variants: plain vLLM, the user's
engine ("dsbd"), the same with the recycle source's prompt rows off ("norows", ``source_drafter.PROMPT_ROWS`` = 0);
AB_EXTRA=extra_last.py adds "uniform" (the floor rule before this page) and "none" (``"sources": []``). The
ad-hoc script of results/unbuilt-layers-2026-12-07 (floor_ab.py generalised):

    VLLM_CPU_OMP_THREADS_BIND=nobind [AB_EXTRA=results/last-floor-2026-12-07/extra_last.py] \
        .venv/bin/python results/last-floor-2026-12-07/job_ab.py ROUNDS [plain,dsbd,norows]
"""
import gc, os, sys, time, statistics
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import demo_vllm as demo
import vllm
from vllm_dsbd.testing import models
from vllm_dsbd.testing.engines import shutdown
import vllm_dsbd.engine.source_drafter as SD
target = models.smollm2_dir(); tok = models.load_tokenizer(target)
prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
           for p in demo.code_edits(demo.CODE_EDITS) + demo.PROMPTS]
print("prompt tokens", [len(tok(p).input_ids) for p in prompts])
params = vllm.SamplingParams(max_tokens=48, temperature=0)
def set_rows(n):
    SD.PROMPT_ROWS = n
VARIANTS = {"plain": (None, lambda: None), "dsbd": ({"method": "dsbd"}, lambda: set_rows(1024)),
            "norows": ({"method": "dsbd"}, lambda: set_rows(0))}
extra = os.environ.get("AB_EXTRA")
if extra:
    exec(open(extra).read())
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
rounds = int(sys.argv[1]); calls = 3
res = {}
for rnd in range(rounds):
    for name in names:
        spec, setup = VARIANTS[name]; setup()
        llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                       speculative_config=spec)
        llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
        for c in range(calls):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            secs = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs); res[name, rnd, c] = n / secs
            print(f"r{rnd} {name} call{c}: {n / secs:.1f} tok/s", flush=True)
        shutdown(llm); del llm; gc.collect()
for c in range(calls):
    for name in names[1:]:
        r = [res[name, k, c] / res[names[0], k, c] for k in range(rounds)]
        print(f"call {c + 1} {name}: " + " / ".join(f"{x:.2f}" for x in r) + f"  median {statistics.median(r):.2f}")
