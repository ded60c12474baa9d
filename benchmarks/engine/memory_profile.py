"""DSBD's profiled step against a measured one: the peak of vLLM's profiling run with DSBD's dummy step
(``memory.profile_step``, what a device reserves before sizing the KV cache) against the peak of a real run of a full
batch at full forests, for the default engine (draft-free sources) and a draft mixed with the sources (CPU, scaled).

    .venv/bin/python benchmarks/engine/memory_profile.py [--batches 64 256] [--engines sources mixed] [--vocab V]

Real vLLM 0.26.0 on CPU, torch's CPU allocator records (``vllm_dsbd.testing.mem_peak``). The model is a tiny random
Llama with the full 128,000-token vocabulary but hidden size 128 and one layer (its draft: the same layer, truncated),
so every ``[rows, V]`` block (logits, the forests' draft joints ``[R, G, W * V]``, the sources' rows ``[R, W, V]``,
verification's chunks, the harvest) is full size and the model's own activations are small: the peaks are DSBD's
per-step working memory at full vocabulary, not a large model's. W = 2, G = 3 (the default engine's), pinned
speculation, ``max_num_seqs`` = R and batched tokens for a full step. Requests: R at once, T = 1 with top-k and top-p,
all three penalties, min_p and a logit bias (the widest paths), prompts of 16 tokens, 8 output tokens. Full forests:
a random model's text rarely repeats, so the sources' proposals are padded to 8 candidates after every context (a
benchmark hook on ``SourceIndex.propose``; Q is still what the drafts are drawn from, acceptance is not measured
here). Columns: vLLM's profiling run alone (what was reserved for the draft-free engine before 2026-12-06: its dummy
step returned early without a draft model), with DSBD's dummy step, the measured run, and the profile's margin.
``--vocab`` scales the vocabulary down where 128k does not fit the machine's memory (DSBD's blocks grow with R * V:
the last column multiplies the measured run back, an estimate).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in process: its allocations counted
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

torch.set_num_threads(1)

W, G, FULL_V, PROMPT, OUT = 2, 3, 128_000, 16, 8


def _pad_proposals():
    """Every context proposes at least 8 candidates (tokens 10..17 where the sources have fewer)."""
    from vllm_dsbd.core import sources

    real = sources.SourceIndex.propose

    def propose(self, context):
        out = real(self, context)
        for t in range(10, 18):
            out.setdefault(t, -2.0 - 0.1 * (t - 10))
        return out

    sources.SourceIndex.propose = propose


def measure(kind: str, R: int, target, draft, V: int) -> dict:
    import vllm

    from vllm_dsbd.engine import memory
    from vllm_dsbd.testing.mem_peak import peak_bytes

    spec = {"method": "dsbd", "num_speculative_tokens": G, "width": W, "verify_budget": None, "cost_model": None}
    if kind == "mixed":
        spec.update(model=str(draft), sources=["model", "recycle", "lookup"])
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
                   enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=R,
                   max_num_batched_tokens=max(R * (1 + W * G), 512), speculative_config=spec)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        _, vllm_only = peak_bytes(runner.profile_run)
        memory.PROFILE_CPU = True
        try:
            _, profiled = peak_bytes(runner.profile_run)
        finally:
            memory.PROFILE_CPU = False
        params = [vllm.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=k, max_tokens=OUT, ignore_eos=True,
                                      repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                                      min_p=0.01, logit_bias={7: 0.5}) for k in range(R)]
        prompts = [{"prompt_token_ids": random.Random(k).sample(range(20, V), PROMPT)} for k in range(R)]
        before = {n: _metric(llm, f"vllm:spec_decode_num_{n}") for n in ("drafts", "draft_tokens")}
        _, step = peak_bytes(llm.generate, prompts, params, use_tqdm=False)
        after = {n: _metric(llm, f"vllm:spec_decode_num_{n}") for n in ("drafts", "draft_tokens")}
    finally:
        _shutdown(llm)
    drafts = after["drafts"] - before["drafts"]
    return dict(vllm_only=vllm_only, profiled=profiled, step=step,
                nodes=(after["draft_tokens"] - before["draft_tokens"]) / max(drafts, 1))


def _metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", 0)
    return 0


def _shutdown(llm) -> None:
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--engines", nargs="+", default=["sources", "mixed"])
    ap.add_argument("--vocab", type=int, default=FULL_V)
    a = ap.parse_args()
    from vllm_dsbd.testing.models import tiny_llama_pair

    V = a.vocab
    target, draft = tiny_llama_pair(vocab_size=V, target_layers=1, draft_layers=1, draft_init="truncate")
    _pad_proposals()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, {platform.machine()}; V = {V}, W = {W}, "
          f"G = {G}\n")
    print("| engine | R | V | vLLM's profile alone MiB | with DSBD's dummy step MiB | measured run MiB "
          "| profile / measured | forest nodes per draft | measured at V = 128k, est. MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2.0**20
    for R in a.batches:
        for kind in a.engines:
            m = measure(kind, R, target, draft, V)
            name = "draft-free (recycle + lookup)" if kind == "sources" else "draft mixed with the sources"
            full = m["step"] * FULL_V / V  # its large blocks all grow with V (logits, joints, rows, sampler)
            print(f"| {name} | {R} | {V} | {m['vllm_only'] / mib:.0f} | {m['profiled'] / mib:.0f} | "
                  f"{m['step'] / mib:.0f} | {m['profiled'] / m['step']:.2f} | {m['nodes']:.1f} | {full / mib:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
