"""The README main job's 8 prompts (greedy, 48 tokens) on plain vLLM and on the user's DSBD engine with and without
the cost model's floor per request (``cost.FLOOR``; off: ``None``, the rule until 2026-12-07), three calls per engine,
the three engines in turn for ``--rounds`` rounds in one process (the engine core in process, so the floor is
switched in this process). Prints every call and, per call index, each round's ratio to that round's plain vLLM and
the median over rounds. On a shared CPU (this project's: calls of one engine vary by 10-30%) only many rounds say
anything.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/floor_ab.py [--rounds 3] [--calls 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_vllm as demo  # noqa: E402

ENGINES = ("plain", "floor", "no floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import vllm

    from vllm_dsbd.engine import cost

    target, prompts, params = demo.readme_job()
    floor, rates = cost.FLOOR, {}
    for rnd in range(args.rounds):
        for name in ENGINES:
            cost.FLOOR = None if name == "no floor" else floor
            llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                           speculative_config=None if name == "plain" else {"method": "dsbd"})
            llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as the demo's
            for c in range(args.calls):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                secs = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[name, rnd, c] = n / secs
                print(f"round {rnd + 1} {name} call {c + 1}: {n} tokens in {secs:.2f} s, {n / secs:.1f} tok/s",
                      flush=True)
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    cost.FLOOR = floor
    print("\n| call | engine | ratio to plain vLLM, each round | median |\n|---|---|---|---|")
    for c in range(args.calls):
        for name in ENGINES[1:]:
            r = [rates[name, k, c] / rates["plain", k, c] for k in range(args.rounds)]
            print(f"| {c + 1} | {name} | {' / '.join(f'{x:.2f}x' for x in r)} | {statistics.median(r):.2f}x |")


if __name__ == "__main__":
    main()
