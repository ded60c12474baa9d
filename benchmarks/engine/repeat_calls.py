"""The README main job's 8 prompts (4 code edits, 4 chat; greedy, 48 tokens) sent REPS times to one engine: tok/s
of each call, and after each call a DSBD engine's ``dsbd_load`` counts (vetoed steps, bare steps). Shows the step
clock's calibration (the first call) against the steady state (the later ones); results/never-slower-2026-12-06.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/repeat_calls.py plain
    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/repeat_calls.py '{"method": "dsbd"}'

Environment: REPS (default 3), MT (max tokens, default 48).
"""
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_vllm as demo  # noqa: E402


def main():
    import vllm
    from vllm_dsbd.testing import models

    target = models.smollm2_dir()
    tok = models.load_tokenizer(target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in demo.code_edits(demo.CODE_EDITS) + demo.PROMPTS]
    params = vllm.SamplingParams(max_tokens=int(os.environ.get("MT", 48)), temperature=0)
    which = sys.argv[1] if len(sys.argv) > 1 else "plain"
    spec = None if which == "plain" else json.loads(which)
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                   speculative_config=spec)
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as the demo's
    for rep in range(int(os.environ.get("REPS", 3))):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        line = f"{which} call {rep + 1}: {n} tokens in {secs:.2f} s, {n / secs:.1f} tok/s"
        if spec:
            load = llm.collective_rpc("dsbd_load")[0]
            line += f"; vetoed steps {load['vetoed_steps']}, bare steps {load['bare_steps']}"
        print(line, flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
