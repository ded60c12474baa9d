"""Non-model time of an engine step: step wall time minus the target's and the draft's forward time, per batch size.

    python benchmarks/engine/step_overhead.py [--batches 1 8 32] [--max-tokens 24] [--out results/step_overhead]

A tiny random Llama pair (the target's first layers as the draft), so that the forward passes are cheap and the
engine's own work (scheduling, input preparation, drafting and verification bookkeeping, KV commit) shows. For each
batch size B, B requests with the same 4-token prompt length are added at once; the first step (the prefill) and the
last are left out, so every measured step decodes all B requests. Forward time is measured with forward hooks on
the target and the draft model (CPU: no asynchronous execution to account for); each column is the median over the
measured steps, and the non-model time is the median of each step's (step - target forward - draft forward).
Rows: plain vLLM (no speculation, the floor of vLLM's own per-step work), DSBD at width 1 and 2, depth 3, default
mode, DSBD beam search (W = 4, T = 0, depth 3 pinned by the request, so a forest is drafted every step; one engine
request per beam search) and beam sampling (the same at T = 1); ``--configs`` picks rows by a regular expression.
The CPU goal of the step-overhead work reads this table: DSBD's non-model time at batch 32 <= 3x that at batch 1,
and 5x below its batch-32 value before that work.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _timer(module, acc: list[float]):
    start: list[float] = []
    module.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))
    module.register_forward_hook(lambda *_: acc.__setitem__(0, acc[0] + time.perf_counter() - start.pop()))


def measure(target, draft, config: dict, batch: int, max_tokens: int, prompt_len: int = 4) -> dict:
    import vllm

    from vllm_dsbd.engine.metrics import DSBDStats  # noqa: F401  (the plugin is registered by importing vllm)

    spec = None
    if config["width"]:
        # pinned: the host work of full forests at every batch size (load-aware speculation would draft none at
        # batch 32 on CPU, and the rows would stop measuring the forest path)
        spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": config["depth"],
                "width": config["width"], "verify_budget": None}
    beam = config.get("beam", 0)
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512 if beam else 256,
                   seed=0,
                   max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch * 64),
                   enable_prefix_caching=False, speculative_config=spec)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        target_t, draft_t = [0.0], [0.0]
        _timer(runner.model, target_t)
        if spec is not None:
            _timer(runner.drafter.model, draft_t)
        engine = llm.llm_engine
        sp = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        if beam:  # one engine request per beam search (the plugin's route for LLM.beam_search), T = 0 or 1
            from vllm.sampling_params import BeamSearchParams

            from vllm_dsbd.patches.beam_search_route import beam_request_params

            bp = BeamSearchParams(beam_width=beam, max_tokens=max_tokens, ignore_eos=True,
                                  temperature=config.get("temperature", 0.0))
            sp = beam_request_params(bp, None, prompt_len, 512, config["width"])
            # the depth pinned by the request: a forest every step at every batch size (unpinned, drafting backs off
            # after forests that pass no layer, and on this random pair the median step at batch 1 drafts nothing)
            from vllm_dsbd.requests import BEAM_KEY

            sp.extra_args[BEAM_KEY]["depth"] = config["depth"]
        for i in range(batch):
            prompt = [(7 * i + j) % 300 + 5 for j in range(prompt_len)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
        steps = []
        while engine.has_unfinished_requests():
            t0, f0, d0 = time.perf_counter(), target_t[0], draft_t[0]
            engine.step()
            steps.append((time.perf_counter() - t0, target_t[0] - f0, draft_t[0] - d0))
        body = steps[1:-1] or steps
        # medians over the steps (2 shared cores: a mean picks up whatever else the machine ran)
        step, tfwd, dfwd = (statistics.median(col) for col in zip(*body))
        non_model = statistics.median(s - t - d for s, t, d in body)
        return {"config": config["name"], "batch": batch, "steps": len(body), "step_ms": 1e3 * step,
                "target_fwd_ms": 1e3 * tfwd, "draft_fwd_ms": 1e3 * dfwd, "non_model_ms": 1e3 * non_model,
                "non_model_ms_per_request": 1e3 * non_model / batch}
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "results" / "step_overhead"))
    ap.add_argument("--configs", default=None, help="regular expression over the row names (default: all)")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batches) or args.max_tokens < 4:
        ap.error("--batches must be >= 1 and --max-tokens >= 4")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    from tqdm import tqdm

    from vllm_dsbd.testing.models import tiny_llama_pair

    target, draft = tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                                    draft_layers=2)
    configs = [{"name": "plain vLLM", "width": 0, "depth": 0},
               {"name": "DSBD W=1 d=3", "width": 1, "depth": 3},
               {"name": "DSBD W=2 d=3", "width": 2, "depth": 3},
               {"name": "DSBD beam search W=4 d=3", "width": 4, "depth": 3, "beam": 4},
               {"name": "DSBD beam sampling W=4 d=3 T=1", "width": 4, "depth": 3, "beam": 4, "temperature": 1.0}]
    if args.configs:
        configs = [c for c in configs if re.search(args.configs, c["name"])]
    rows = []
    jobs = [(c, b) for c in configs for b in args.batches]
    for c, b in tqdm(jobs, desc="engines", file=sys.stderr):
        rows.append(measure(target, draft, c, b, args.max_tokens))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} threads, torch threads 1"
    (out / "results.json").write_text(json.dumps({"machine": machine, "max_tokens": args.max_tokens,
                                                  "rows": rows}, indent=1))
    head = "| config | batch | step ms | target fwd ms | draft fwd ms | non-model ms | non-model ms / request |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch']} | {r['step_ms']:.1f} | {r['target_fwd_ms']:.1f} | "
                     f"{r['draft_fwd_ms']:.1f} | {r['non_model_ms']:.1f} | {r['non_model_ms_per_request']:.2f} |")
    ratio = {}
    for c in configs:
        by_b = {r["batch"]: r["non_model_ms"] for r in rows if r["config"] == c["name"]}
        if 1 in by_b and max(by_b) > 1:
            ratio[c["name"]] = by_b[max(by_b)] / by_b[1]
    text = "\n".join(lines)
    summary = "; ".join(f"{k}: non-model time at batch {max(args.batches)} = {v:.1f}x batch 1"
                        for k, v in ratio.items())
    (out / "README.md").write_text(
        "# Non-model time of an engine step (CPU)\n\n`.venv/bin/python benchmarks/engine/step_overhead.py`"
        f" on {machine}; tiny random Llama pair (3-layer target, its first 2 layers as the draft), "
        f"{args.max_tokens} tokens per request, T = 1.\n\n{text}\n\n{summary}\n")
    print(text)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
