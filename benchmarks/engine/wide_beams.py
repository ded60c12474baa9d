"""Wide beams (W = 16 .. 256, short outputs) in a DSBD engine against vLLM's own ``LLM.beam_search`` loop, on CPU.

One process, one engine at a time (the machine is shared): phase A runs vLLM's loop on a plain engine for every W,
phase B the same calls on a DSBD engine (no forest source, ``max_beam_slots`` so the beams' KV slots need not fit
``max_model_len``), phase C vLLM's loop again, so drift in the machine's load shows as A != C; the ratio uses the mean
of A and C. Both engines: float32 weights, prefix caching on (vLLM's loop leans on it: each beam's one-token request is
a prefill of prompt + beam), the same ``max_model_len``. Per W it records requests/s, time per request, whether every
prompt's best beam is the same token for token, the most KV blocks in use at any step (total minus the scheduler's free
blocks) and the process's peak RSS growth during the call (sampled every 20 ms); a plot of time per request against W
(both sides) and a JSON of the rows go to ``--out``.

    python benchmarks/engine/wide_beams.py --model TARGET --widths 16 64 256 --prompts 8 --tokens 8 --out DIR

``--model tiny`` builds the tiny random Llama of the tests with a 2048-token vocabulary (vLLM's loop asks for 2W
logprobs, so V >= 2W). Structured (``choice``) beams are refused for beam requests on a DSBD engine today, so this
runs without a constraint.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class _Peak:
    """Peak RSS growth of this process while the block runs (sampled)."""

    def __enter__(self):
        import psutil

        self.proc, self.stop, self.base = psutil.Process(), False, psutil.Process().memory_info().rss
        self.peak = self.base
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.mib = (self.peak - self.base) / 2**20


def _engine(model, max_model_len, dsbd: dict | None, max_w: int):
    import vllm

    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=0,
              enable_prefix_caching=True, max_logprobs=2 * max_w, max_num_seqs=256, disable_log_stats=False)
    if dsbd is not None:
        kw["speculative_config"] = {"method": "dsbd", **dsbd}
        kw["max_num_seqs"] = 64
    return vllm.LLM(**kw)


def _shutdown(llm):
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _run(llm, prompts, width, tokens):
    from vllm.sampling_params import BeamSearchParams

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    total, low = pool.get_num_free_blocks(), [pool.get_num_free_blocks()]
    orig = sched.schedule

    def spy(*a, **k):
        out = orig(*a, **k)
        low[0] = min(low[0], pool.get_num_free_blocks())
        return out

    sched.schedule = spy
    try:
        with _Peak() as peak:
            t0 = time.perf_counter()
            outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                   BeamSearchParams(beam_width=width, max_tokens=tokens))
            dt = time.perf_counter() - t0
    finally:
        sched.schedule = orig
    best = [list(o.sequences[0].tokens) for o in outs]
    return {"seconds": dt, "best": best, "kv_blocks": total - low[0], "block_size":
            sched.kv_cache_manager.coordinator.single_type_managers[0].block_size, "rss_mib": peak.mib}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--skip-second-plain", action="store_true", help="no phase C (on a slow machine)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # OpenMP spin-waits on a shared machine otherwise (tests/helpers/engine_utils.py)
    model = args.model
    if model == "tiny":
        from vllm_dsbd.testing.models import tiny_llama_pair

        model = str(tiny_llama_pair(vocab_size=2048, seed=0, init_std=0.1, target_layers=3, draft_layers=2,
                                    draft_init="truncate")[0])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    max_w = max(args.widths)
    slots = max(args.max_model_len, args.prompt_len + args.tokens * (max_w + 1) + 2)
    rows = {w: {} for w in args.widths}
    phases = [("plain_a", None), ("dsbd", {"width": max_w, "sources": [], "max_beam_slots": slots})]
    if not args.skip_second_plain:
        phases.append(("plain_c", None))
    for name, dsbd in phases:
        llm = _engine(model, args.max_model_len, dsbd, max_w)
        _run(llm, prompts[:1], min(args.widths), 2)  # warm-up
        for w in args.widths:
            r = _run(llm, prompts, w, args.tokens)
            rows[w][name] = r
            print(f"{name} W={w}: {r['seconds']:.2f} s, {args.prompts / r['seconds']:.3f} req/s, KV blocks "
                  f"{r['kv_blocks']}, RSS +{r['rss_mib']:.0f} MiB", flush=True)
        _shutdown(llm)
    table = []
    for w in args.widths:
        d = rows[w]
        plain = [d[k]["seconds"] for k in ("plain_a", "plain_c") if k in d]
        p = sum(plain) / len(plain)
        same = sum(a == b for a, b in zip(d["plain_a"]["best"], d["dsbd"]["best"]))
        table.append({"width": w, "prompts": args.prompts, "tokens": args.tokens, "plain_s": plain,
                      "dsbd_s": d["dsbd"]["seconds"], "plain_req_s": args.prompts / p,
                      "dsbd_req_s": args.prompts / d["dsbd"]["seconds"], "ratio": p / d["dsbd"]["seconds"],
                      "best_equal": f"{same}/{args.prompts}", "plain_kv_blocks": d["plain_a"]["kv_blocks"],
                      "dsbd_kv_blocks": d["dsbd"]["kv_blocks"], "block_size": d["dsbd"]["block_size"],
                      "plain_rss_mib": d["plain_a"]["rss_mib"], "dsbd_rss_mib": d["dsbd"]["rss_mib"]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wide_beams.json"), "w") as f:
        json.dump({"args": vars(args), "rows": table}, f, indent=1)
    print("| W | best beam equal | vLLM loop req/s | DSBD req/s | ratio | KV blocks loop / DSBD | RSS MiB loop / DSBD |")
    for t in table:
        print(f"| {t['width']} | {t['best_equal']} | {t['plain_req_s']:.3f} | {t['dsbd_req_s']:.3f} | "
              f"{t['ratio']:.1f}x | {t['plain_kv_blocks']} / {t['dsbd_kv_blocks']} | "
              f"{t['plain_rss_mib']:.0f} / {t['dsbd_rss_mib']:.0f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [t["width"] for t in table]
    plt.figure(figsize=(5, 3.5))
    plt.plot(ws, [args.prompts and sum(t["plain_s"]) / len(t["plain_s"]) / args.prompts for t in table], "o-",
             label="vLLM LLM.beam_search loop")
    plt.plot(ws, [t["dsbd_s"] / args.prompts for t in table], "s-", label="DSBD engine (in-engine beams)")
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.xlabel("beam width W")
    plt.ylabel("seconds per request")
    plt.title(f"{args.tokens} tokens, {args.prompts} prompts, CPU (shared)")
    plt.legend()
    plt.tight_layout()
    plt.savefig(os.path.join(args.out, "time_per_request.png"), dpi=120)


if __name__ == "__main__":
    main()
