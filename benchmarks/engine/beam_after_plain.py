"""Beam search after plain traffic, first call and again: what the step clock's verdicts do to a beam call.

One engine per source set (``sources_wall.engine``: width 4, cost model ``"auto"``), the sequence of
``sources_wall.py``'s code-edit rows: one warm-up greedy request, the prompts one at a time, the prompts in one call
(plain windows: the plain requests' verdict at batch 1 and 4), a 2-token beam warm-up on one prompt, then
``LLM.beam_search`` W = 4 over the prompts twice. Prints each beam call's wall seconds and, for the first, what the
engine's ``dsbd_load`` counted in it (depths and N chosen, vetoed steps, prompt rows recycled) and its step clock;
``--profile``: the first beam call under cProfile (the 30 functions of most own time). Engines run one after another
in this process; on a shared CPU compare calls of one run only.

    python benchmarks/engine/beam_after_plain.py [--sets "none;recycle,lookup"] [--prompts 4] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sources_wall.py and draftfree.py beside this file

import sources_wall as sw  # noqa: E402  (sets the CPU engine's environment before vLLM)
from draftfree import prompts as kind_prompts  # noqa: E402

KEYS = ("depths", "nodes", "vetoed_steps", "bare_steps", "prompt_rows")


def _delta(a, b):
    if isinstance(b, dict):
        return {k: v - a.get(k, 0) for k, v in b.items() if v - a.get(k, 0)}
    return None if b is None else b - a


def run(source_set: str, folder, draft, enc, profile: bool) -> dict:
    import vllm
    from vllm.sampling_params import BeamSearchParams

    ps = [{"prompt_token_ids": p} for p in enc]
    llm = sw.engine(folder, source_set, draft)
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, extra_args={"dsbd_width": 2})
    llm.generate(ps[:1], sp, use_tqdm=False)
    for p in ps:
        llm.generate([p], sp, use_tqdm=False)
    llm.generate(ps, sp, use_tqdm=False)
    llm.beam_search(ps[:1], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
    bp = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    l0 = llm.collective_rpc("dsbd_load")[0]
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    llm.beam_search(ps, bp)
    if prof:
        prof.disable()
    first = time.perf_counter() - t0
    l1 = llm.collective_rpc("dsbd_load")[0]
    t0 = time.perf_counter()
    llm.beam_search(ps, bp)
    again = time.perf_counter() - t0
    sw.shutdown(llm)
    out = {"set": source_set, "first": first, "again": again, "clock": l1.get("clock"),
           **{k: _delta(l0.get(k), l1.get(k)) for k in KEYS}}
    print(out, flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="none;recycle,lookup")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import torch

    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    draft, _ = draft_folder(folder, 8, Path(__file__).resolve().parents[2])
    enc = [p for k, p in kind_prompts(load_tokenizer(folder), a.prompts) if k == "code-edit"]
    rows = [run(s, folder, draft, enc, a.profile) for s in a.sets.split(";")]
    base = rows[0]
    for r in rows:
        print(f"{r['set']}: first beam call {r['first']:.2f} s ({base['first'] / r['first']:.2f}x {base['set']}), "
              f"again {r['again']:.2f} s ({base['again'] / r['again']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
