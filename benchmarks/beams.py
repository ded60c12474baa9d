"""Beam search: vLLM's ``LLM.beam_search`` (its front-end loop) against beam search inside the DSBD engine (γ = 0).

One script, both rows side by side on the same prompts and weights (float32 on CPU), temperature 0, one engine at a
time, prefix caching on for both (vLLM's loop relies on it to avoid re-prefilling every beam every step):

* ``vllm beam_search W``: a plain engine, ``LLM.beam_search`` (per token, one engine request per live beam);
* ``in-engine beam search W``: a DSBD engine, the same ``LLM.beam_search`` call (one engine request per prompt, the
  beams a trie in the request's KV slots).

Reported per row: wall seconds, best-beam tokens per second, target passes (vLLM's loop: engine requests it made,
from ``vllm:request_success``; in-engine: ``vllm:dsbd_beam_target_passes``), and KV blocks held per request (in-engine:
measured, ``vllm:dsbd_beam_kv_blocks``; vLLM's loop: its W live beams each hold their prompt + tokens, shared prompt
blocks counted once: computed from the outputs, stated as such), against one plain request of the same prompt and
length. Whether both rows return the same beams is checked and printed.

    python benchmarks/beams.py                 # SmolLM2-135M-Instruct, 8 ShareGPT prompts, W = 4, 32 tokens
    python benchmarks/beams.py --tiny          # the tiny random Llama (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return m
    return None


def _value(llm, name) -> float:
    """A counter summed over its label sets (e.g. ``vllm:request_success`` per finish reason)."""
    return sum(float(getattr(m, "value", 0.0) or 0.0) for m in llm.get_metrics() if m.name == name)


def _run(llm, prompts, width, max_tokens):
    from vllm.sampling_params import BeamSearchParams

    bp = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=width, max_tokens=2))  # warm-up
    req0, pass0 = _value(llm, "vllm:request_success"), _value(llm, "vllm:dsbd_beam_target_passes")
    t0 = time.perf_counter()
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], bp, use_tqdm=False)
    secs = time.perf_counter() - t0
    best = [list(o.sequences[0].tokens[len(p):]) for o, p in zip(outs, prompts)]
    beams = [[list(s.tokens) for s in o.sequences] for o in outs]
    return dict(seconds=secs, best=best, beams=beams, requests=_value(llm, "vllm:request_success") - req0,
                beam_passes=_value(llm, "vllm:dsbd_beam_target_passes") - pass0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--loop-without-prefix-caching", action="store_true",
                    help="also run vLLM's loop with prefix caching off (every beam re-prefilled every step)")
    ap.add_argument("--out", default=str(ROOT / "results" / "beams"))
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    import vllm

    from harness import load_prompts
    from harness_runs import shutdown
    from vllm_dsbd import models

    if args.tiny:
        target, draft = models.tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1,
                                               target_layers=3, draft_layers=2)
        name = "tiny random Llama (3 layers)"
    else:
        import demo_vllm

        target = models.smollm2_dir()
        draft, _ = demo_vllm.draft_folder(target, 8)
        name = "SmolLM2-135M-Instruct"
    tok = models.load_tokenizer(target)
    prompts, prompt_desc, _ = load_prompts(tok, args.num_prompts, 128, args.tiny)
    prompts = prompts[: args.num_prompts]
    W, N, bs = args.width, args.max_tokens, args.block_size
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0, enable_prefix_caching=True,
              block_size=bs, disable_log_stats=False, max_num_seqs=64)
    rows = []
    labels = ["vllm beam_search", "in-engine beam search"]
    if args.loop_without_prefix_caching:
        labels.append("vllm beam_search, no prefix caching,")
    for label in tqdm(labels, desc="engines", unit="engine"):
        extra = {} if label.startswith("vllm") else dict(speculative_config={
            "method": "dsbd", "model": str(draft), "num_speculative_tokens": 3, "width": W})
        if "no prefix caching" in label:
            extra["enable_prefix_caching"] = False
        llm = vllm.LLM(model=str(target), **{**kw, **extra})
        try:
            r = _run(llm, prompts, W, N)
            blocks = _metric(llm, "vllm:dsbd_beam_kv_blocks")
            r["measured_blocks"] = (blocks.sum / blocks.count) if blocks is not None and blocks.count else None
        finally:
            shutdown(llm)
        r["label"] = f"{label} W={W}"
        rows.append(r)
    plain_blocks = sum(math.ceil((len(p) + N) / bs) for p in prompts) / len(prompts)
    loop = rows[0]
    # vLLM's loop: W live beams of prompt + N tokens; the prompt's full blocks shared through the prefix cache
    loop_blocks = sum(len(p) // bs + W * (math.ceil((len(p) + N) / bs) - len(p) // bs) for p in prompts) / len(prompts)
    loop["blocks"], loop["blocks_how"] = loop_blocks, "computed: W beams x (prompt + tokens), prompt blocks shared"
    for r in rows[2:]:  # without prefix caching every beam holds its own prompt too
        r["blocks"] = W * plain_blocks
        r["blocks_how"] = "computed: W beams x (prompt + tokens)"
    rows[1]["blocks"], rows[1]["blocks_how"] = rows[1]["measured_blocks"], "measured (vllm:dsbd_beam_kv_blocks)"
    same = sum(a == b for a, b in zip(rows[0]["beams"], rows[1]["beams"]))
    lines = [f"# Beam search W = {W}: vLLM's front-end loop vs in the DSBD engine", "",
             f"{name}, {prompt_desc} (first {len(prompts)}), {N} tokens, temperature 0, float32, "
             f"{os.cpu_count()} CPU threads available, torch threads 1, block size {bs}, prefix caching on.", "",
             "| row | wall s | best-beam tok/s | target passes | KV blocks / request | vs one plain request |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        toks = sum(len(b) for b in r["best"])
        passes = r["beam_passes"] if r["beam_passes"] else r["requests"]
        blocks = r["blocks"]
        lines.append(f"| {r['label']} | {r['seconds']:.2f} | {toks / r['seconds']:.1f} | {passes:.0f} | "
                     f"{blocks:.1f} ({r['blocks_how']}) | {blocks / plain_blocks:.2f}x |")
    speed = (sum(len(b) for b in rows[1]["best"]) / rows[1]["seconds"]) / (
        sum(len(b) for b in rows[0]["best"]) / rows[0]["seconds"])
    rate = [sum(len(b) for b in r["best"]) / r["seconds"] for r in rows]
    extra_rows = "".join(f" Against {r['label']}: {rate[1] / x:.1f}x." for r, x in zip(rows[2:], rate[2:]))
    lines += ["", f"In-engine / vLLM loop best-beam tokens per second: **{speed:.1f}x**.{extra_rows} Same beams "
              f"(tokens and order) for {same} of {len(prompts)} prompts. One plain request of the same prompt and length holds "
              f"{plain_blocks:.1f} blocks.", "",
              f"Command: `python benchmarks/beams.py {' '.join(argv if argv is not None else sys.argv[1:])}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k not in ("beams",)} for r in rows] + [{"speedup": speed, "same": same}],
        indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
