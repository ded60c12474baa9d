"""The user's engine (``{"method": "dsbd"}``: the default draft-free sources, the cost model on) against plain vLLM
on plain greedy requests at several batch sizes, both engines alive at once in one process and their calls
interleaved (one call each per cycle, the order alternating), so that this machine's drift falls on both alike.
Issue 47's goal "the user's engine on plain requests >= 0.95x plain vLLM at batch 1, 8, 32 and 128", on CPU.

SmolLM2-135M-Instruct, float32, eager; the prompts of ``draftfree.py`` (summaries, rewrites, code edits, chats), their
kinds taken in turn so that every batch mixes them; T = 0, ``--tokens`` new tokens (EOS ends a request, as the README's
job). Each call prints its engine's preemptions (counted on its scheduler: vLLM's metrics registry, one per process,
holds the last engine's counters) and, on DSBD, its request-steps with a forest. Each batch's prompts are prefilled
once on both engines before its cycles (vLLM's prefix cache), so the calls time mostly decode steps. Batch 1 is
``--prompts-b1`` requests one at a time; batch B is the first B prompts in one call. Prints every call, then per batch
size each cycle's ratio (DSBD's tokens/s over plain vLLM's in the same cycle), their median and least, all calls'
tokens/s together (wall and this process's CPU time), tokens per target pass, and whether DSBD's tokens equal plain
vLLM's.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/batch_ab.py [--batches 1,8,32,128] \\
        [--cycles 4] [--tokens 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sources_wall.py and draftfree.py beside this file

import sources_wall as sw  # noqa: E402  (sets the CPU engine's environment before vLLM)
from draftfree import prompts as kind_prompts  # noqa: E402


def _mixed(enc: list[tuple[str, list[int]]]) -> list[list[int]]:
    """The prompts with their kinds taken in turn."""
    by_kind: dict[str, list] = {}
    for k, p in enc:
        by_kind.setdefault(k, []).append(p)
    cols = list(by_kind.values())
    return [c[i] for i in range(max(map(len, cols))) for c in cols if i < len(c)]


def _forests(llm, name: str) -> int | None:
    """A DSBD engine's request-steps with a forest so far (``dsbd_load``'s depths chosen above 0); plain: None."""
    if name == "plain":
        return None
    return sum(c for d, c in llm.collective_rpc("dsbd_load")[0]["depths"].items() if d > 0)


def _count_preemptions(llm, name: str, counts: dict) -> None:
    """Counts ``llm``'s preemptions into ``counts[name]`` (a wrapper on its scheduler's ``_preempt_request``)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    orig = sched._preempt_request

    def preempt(*args, **kwargs):
        counts[name] += 1
        return orig(*args, **kwargs)

    sched._preempt_request = preempt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts-b1", type=int, default=4)
    a = ap.parse_args()
    import torch
    import vllm

    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    batches = [int(b) for b in a.batches.split(",")]
    folder = smollm2_dir()
    ps = [{"prompt_token_ids": p} for p in _mixed(kind_prompts(load_tokenizer(folder), -(-max(batches) // 4)))]
    assert len(ps) >= max(batches), (len(ps), batches)
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=a.tokens)
    llms = {}
    for name, spec in (("plain", None), ("dsbd", {"method": "dsbd"})):
        llms[name] = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                              max_num_seqs=max(batches), disable_log_stats=False, speculative_config=spec)
        llms[name].generate(ps[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as the demo's
    preempted = {name: 0 for name in llms}  # each engine's own (vLLM's metrics registry holds the last engine's)
    for name, llm in llms.items():
        _count_preemptions(llm, name, preempted)
    res: dict = {}
    try:
        for b in batches:
            calls = [[p] for p in ps[:a.prompts_b1]] if b == 1 else [ps[:b]]
            for llm in llms.values():  # untimed: the prompts' prefill into vLLM's prefix cache, on both engines
                llm.generate([p for c in calls for p in c], vllm.SamplingParams(max_tokens=1), use_tqdm=False)
            for cyc in range(a.cycles):
                for name in (("plain", "dsbd") if cyc % 2 == 0 else ("dsbd", "plain")):
                    llm = llms[name]
                    p0 = sw.metric(llm, "vllm:dsbd_target_passes")
                    q0, f0 = preempted[name], _forests(llm, name)
                    t0, c0 = time.perf_counter(), time.process_time()
                    outs = [o for c in calls for o in llm.generate(c, sp, use_tqdm=False)]
                    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                    toks = [list(o.outputs[0].token_ids) for o in outs]
                    n = sum(map(len, toks))
                    res[b, name, cyc] = (n, secs, cpu, sw.metric(llm, "vllm:dsbd_target_passes") - p0, toks)
                    print(f"batch {b} cycle {cyc + 1} {name}: {n} tokens in {secs:.2f} s ({cpu:.2f} CPU-s), "
                          f"{n / secs:.1f} tok/s, {preempted[name] - q0} preemptions"
                          + (f", {_forests(llm, name) - f0} request-steps with a forest" if f0 is not None else ""),
                          flush=True)
    finally:
        for llm in llms.values():
            sw.shutdown(llm)
    print("\n| batch | DSBD over plain vLLM, each cycle | median | least | all calls (wall / CPU) | tokens per target "
          "pass | tokens equal |\n|---|---|---|---|---|---|---|")
    for b in batches:
        cy = range(a.cycles)
        r = [(res[b, "dsbd", c][0] / res[b, "dsbd", c][1]) / (res[b, "plain", c][0] / res[b, "plain", c][1])
             for c in cy]
        tot = [sum(res[b, e, c][0] for c in cy) / sum(res[b, e, c][i] for c in cy)
               for i in (1, 2) for e in ("plain", "dsbd")]
        per_pass = sum(res[b, "dsbd", c][0] for c in cy) / max(1, sum(res[b, "dsbd", c][3] for c in cy))
        same = all(res[b, "dsbd", c][4] == res[b, "plain", c][4] for c in cy)
        print(f"| {b} | {' / '.join(f'{x:.2f}' for x in r)} | {statistics.median(r):.2f}x | {min(r):.2f}x "
              f"| {tot[1] / tot[0]:.2f}x / {tot[3] / tot[2]:.2f}x | {per_pass:.2f} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
