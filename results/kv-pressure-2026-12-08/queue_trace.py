"""Where the user's engine drafts at batch 128 (batch_ab.py's prompts, KV cache full): for each call, the request-steps
with a forest by (requests waiting, exploration budget open, the step clock's verdict at the batch's size, warm-up),
the steps by the same, and a trace of every step with a forest or a queue: (waiting, budget open, verdict, requests,
forests, preemptions so far); the first steps under a queue that drafted more than 10 forests print the table the
model priced them with, the clock's summary and the chosen (rate, N', depth, probe) counts.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/kv-pressure-2026-12-08/queue_trace.py [--batch 128] \\
        [--calls 4]
"""
import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))

import sources_wall as sw  # noqa: E402,F401  (sets the CPU engine's environment before vLLM)
from batch_ab import _count_preemptions, _mixed  # noqa: E402
from draftfree import prompts as kind_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    import torch
    import vllm

    from vllm_dsbd.engine import cost
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    prompts = [{"prompt_token_ids": p} for p in _mixed(kind_prompts(load_tokenizer(folder), -(-a.batch // 4)))]
    prompts = prompts[:a.batch]
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=48)
    llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                   max_num_seqs=128, speculative_config={"method": "dsbd"})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    pre = collections.Counter()
    _count_preemptions(llm, "dsbd", pre)
    log, printed = [], [0]
    choose_depths = runner._choose_depths

    def traced(levels, shapes, states, discard, catch_ups=None):
        explore, clock = runner.dsbd_explore.open(), runner._dsbd_clock
        rows = sum(1 for s, d in zip(states, discard) if s is not None and not d)
        verdict = clock.verdict(rows) if clock is not None else None
        warm = clock.warming() if clock is not None else None
        out = choose_depths(levels, shapes, states, discard, catch_ups)
        log.append((runner._dsbd_waiting, explore, verdict, warm, rows, sum(lv.depth > 0 for lv in out), pre["dsbd"]))
        return out

    runner._choose_depths = traced
    choose_shapes = cost.choose_shapes

    def shown(cands, table, floor=None, left=None):
        out = choose_shapes(cands, table, floor=floor, left=left)
        if sum(d > 0 for _, d in out) > 10 and runner._dsbd_waiting and printed[0] < 3:
            printed[0] += 1
            summary = {k: round(v, 4) if isinstance(v, float) else v
                       for k, v in runner._dsbd_clock.summary().items() if k != "beam"}
            chosen = collections.Counter((round(c.rate, 2), w, d, c.probe) for c, (w, d) in zip(cands, out))
            print(f"  step under a queue: {len(cands)} requests, {sum(d > 0 for _, d in out)} forests, "
                  f"{runner._dsbd_waiting} waiting\n    table {table.describe()}\n    clock {summary}\n"
                  f"    (rate, N', depth, probe): count {sorted(chosen.items())}")
        return out

    cost.choose_shapes = shown
    for c in range(a.calls):
        log.clear()
        pre.clear()
        printed[0] = 0
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        print(f"call {c}: {time.perf_counter() - t0:.2f} s, {len(log)} steps, {pre['dsbd']} preemptions")
        forests, steps = collections.Counter(), collections.Counter()
        for w, ex, v, wm, _, nf, _ in log:
            forests[(w > 0, ex, v, wm)] += nf
            steps[(w > 0, ex, v, wm)] += 1
        print("  (waiting, budget open, verdict, warm-up): steps, request-steps with a forest")
        for k in sorted(steps, key=str):
            print(f"    {k}: {steps[k]}, {forests[k]}")
        print("  trace (waiting, budget open, verdict, requests, forests, preemptions so far):\n   ",
              [(w, int(ex), v, rows, nf, p) for w, ex, v, _, rows, nf, p in log if nf or w])


if __name__ == "__main__":
    main()
