"""In-engine beam search (``LLM.beam_search``, W = 4, T = 0) on DSBD engines of several source sets, every engine
alive at once in one process and their calls interleaved: each cycle runs one beam call on every engine, in an order
rotated cycle by cycle, so that this machine's drift (one engine's 1.7 s beam calls spread 24.7-38.1 tok/s over
minutes in ``sources_wall.py``, whose beam row is one call per engine run) falls on every engine alike.

Engines as ``sources_wall.engine`` builds them (width 4, depth 3, cost model ``"auto"``), after its sequence: the
kind's prompts greedy in one call, then a 2-token beam warm-up. Prints every call (the first with what the engine
drafted in it: depths and N chosen, ``dsbd_load``), then per engine each cycle's ratio to the first engine's call of
the same cycle, their median and least, the ratio of all calls' time together (wall and this process's CPU time),
and whether every engine's beams equal the first engine's.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/beam_ab.py [--sets "none;recycle,lookup"] \\
        [--kind code-edit] [--cycles 12]
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


def _drafted(a: dict, b: dict) -> dict:
    return {k: {n: c - a[k].get(n, 0) for n, c in b[k].items() if c - a[k].get(n, 0)} for k in ("depths", "nodes")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="none;recycle,lookup", help="';'-separated source sets, the baseline first")
    ap.add_argument("--kind", default="code-edit")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=12)
    a = ap.parse_args()
    import torch
    import vllm
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    draft, _ = draft_folder(folder, 8, Path(__file__).resolve().parents[2])
    ps = [{"prompt_token_ids": p} for k, p in kind_prompts(load_tokenizer(folder), a.prompts) if k == a.kind]
    sets = a.sets.split(";")
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, extra_args={"dsbd_width": 2})
    bp = BeamSearchParams(beam_width=4, max_tokens=a.beam_tokens, ignore_eos=True)
    llms = {}
    for s in sets:
        llms[s] = sw.engine(folder, s, draft)
        llms[s].generate(ps, sp, use_tqdm=False)
        llms[s].beam_search(ps[:1], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
    secs: dict = {}
    cpus: dict = {}
    beams: dict = {}
    try:
        for cyc in range(a.cycles):
            k = cyc % len(sets)
            for s in sets[k:] + sets[:k]:
                llm = llms[s]
                l0 = llm.collective_rpc("dsbd_load")[0] if cyc == 0 else None
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.beam_search(ps, bp)
                secs[s, cyc], cpus[s, cyc] = time.perf_counter() - t0, time.process_time() - c0
                beams.setdefault(s, [[list(q.tokens) for q in o.sequences] for o in outs])
                n = sum(len(o.sequences[0].tokens) - len(p["prompt_token_ids"]) for o, p in zip(outs, ps))
                note = f", drafted {_drafted(l0, llm.collective_rpc('dsbd_load')[0])}" if l0 else ""
                print(f"cycle {cyc + 1} {s}: {secs[s, cyc]:.3f} s ({cpus[s, cyc]:.2f} CPU-s), "
                      f"{n / secs[s, cyc]:.1f} best-beam tok/s{note}", flush=True)
    finally:
        for llm in llms.values():
            sw.shutdown(llm)
    base = sets[0]
    print(f"\n| engine | ratio to {base}, each cycle | first call | median | least | all calls | per CPU-second "
          "| beams = " + base + "'s |\n|---|---|---|---|---|---|---|---|")
    for s in sets[1:]:
        r = [secs[base, c] / secs[s, c] for c in range(a.cycles)]
        tot = [sum(d[base, c] for c in range(a.cycles)) / sum(d[s, c] for c in range(a.cycles)) for d in (secs, cpus)]
        print(f"| {s} | {' / '.join(f'{x:.2f}' for x in r)} | {r[0]:.2f}x | {statistics.median(r):.2f}x "
              f"| {min(r):.2f}x | {tot[0]:.2f}x | {tot[1]:.2f}x | {'yes' if beams[s] == beams[base] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
