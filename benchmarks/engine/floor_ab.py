"""The README main job's 8 prompts (greedy, 48 tokens) on plain vLLM and on DSBD engines under the cost model's
floor rules, every engine alive at once in one process and their calls interleaved: each cycle runs one call on
every engine, in an order rotated cycle by cycle, so that this machine's drift (calls of one engine vary by 10-30%
over minutes) falls on every engine alike. Prints every call, then per engine each cycle's ratio to plain vLLM's call
of the same cycle, their median and least, and the ratio of all calls' time together, wall and this process's CPU
time (the engine core runs in it).

Engines (``--engines``): ``plain`` (plain vLLM), ``dsbd`` (the user's engine: floors by tokens left,
``cost.request_floors``, and the batch's end, ``batch_end``), ``noend`` (the same floors without the batch's end, the
rule until 2026-12-07's night), ``uniform`` (every request at ``cost.FLOOR`` while none waits, the rule before
2026-12-07's evening), ``nofloor`` (no floor, the rule before 2026-12-07), ``rows1`` / ``norows`` (the user's engine
with the recycle source's prompt rows at 1% / 0% of a request's time, ``cost.PROMPT_SHARE``), ``lookup`` (``"sources":
["lookup"]``: no recycle harvest, no prompt rows), ``none`` (``"sources": []``).
The rules are module state of the in-process engine core, so they are set before each call.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/floor_ab.py [--cycles 8] \\
        [--engines plain,dsbd,uniform,none]
"""
from __future__ import annotations

import argparse
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


def _rules(cost) -> dict:
    """Each engine's (speculative config, floors rule, prompt rows' share)."""
    by_left, dsbd, share = cost.request_floors, {"method": "dsbd"}, cost.PROMPT_SHARE
    return {"plain": (None, by_left, share), "dsbd": (dsbd, by_left, share),
            "uniform": (dsbd, lambda left: [cost.FLOOR] * len(left), share),
            "nofloor": (dsbd, lambda left: None, share), "rows1": (dsbd, by_left, 0.01), "norows": (dsbd, by_left, 0.0),
            "lookup": ({"method": "dsbd", "sources": ["lookup"]}, by_left, share),
            "none": ({"method": "dsbd", "sources": []}, by_left, share),
            "noend": (dsbd, by_left, share, False)}


_CHOOSE = {}


def _set(cost, rule) -> None:
    """The rule's floors and prompt rows' share; with a fourth element False, ``choose_shapes`` without ``left`` (no
    batch's end)."""
    choose = _CHOOSE.setdefault("shapes", cost.choose_shapes)
    cost.request_floors, cost.PROMPT_SHARE = rule[1], rule[2]
    cost.choose_shapes = choose if len(rule) < 4 or rule[3] else (
        lambda cands, table, floor=None, left=None: choose(cands, table, floor))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--engines", default="plain,dsbd,uniform,none", help="comma-separated; plain first")
    args = ap.parse_args()
    import vllm

    from vllm_dsbd.engine import cost
    from vllm_dsbd.testing.engines import shutdown

    names = args.engines.split(",")
    assert names[0] == "plain", "the ratios are to plain vLLM: name it first"
    rules = _rules(cost)
    rule = (None, cost.request_floors, cost.PROMPT_SHARE)
    target, prompts, params = demo.readme_job()
    llms = {}
    for name in names:
        _set(cost, rules[name])
        llms[name] = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                              speculative_config=rules[name][0])
        llms[name].generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as the demo's
    rates: dict = {}
    cpus: dict = {}
    try:
        for cyc in range(args.cycles):
            k = cyc % len(names)
            for name in names[k:] + names[:k]:
                _set(cost, rules[name])
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llms[name].generate(prompts, params, use_tqdm=False)
                secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[name, cyc], cpus[name, cyc] = n / secs, n / cpu
                print(f"cycle {cyc + 1} {name}: {n} tokens in {secs:.2f} s ({cpu:.2f} CPU-s), {n / secs:.1f} tok/s",
                      flush=True)
    finally:
        _set(cost, rule)
        for llm in llms.values():
            shutdown(llm)
    print("\n| engine | ratio to plain vLLM, each cycle | median | least | all calls' tokens/s | per CPU-second |\n"
          "|---|---|---|---|---|---|")
    for name in names[1:]:
        r = [rates[name, c] / rates["plain", c] for c in range(args.cycles)]
        total = [sum(1 / d[name, c] for c in range(args.cycles)) for d in (rates, cpus)]  # seconds per token, summed
        plain = [sum(1 / d["plain", c] for c in range(args.cycles)) for d in (rates, cpus)]
        print(f"| {name} | {' / '.join(f'{x:.2f}' for x in r)} | {statistics.median(r):.2f}x | {min(r):.2f}x "
              f"| {plain[0] / total[0]:.2f}x | {plain[1] / total[1]:.2f}x |")


if __name__ == "__main__":
    main()
