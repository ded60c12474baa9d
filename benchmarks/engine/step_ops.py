"""Aten operations and host reads per engine step outside the target's forward, plain vLLM against DSBD engines (CPU):
the CPU proxy of a step's device overhead (each operation a kernel launch on a GPU, each read a wait for it).

    python benchmarks/engine/step_ops.py [--batches 1 8] [--max-tokens 24] [--out DIR] [--names] [--sites]
        [--temperature T]

The tiny random Llama target of the engine tests (vocabulary 400), greedy (``--temperature``: seeded sampling), B
requests in one ``generate``, engines one after another in this process: ``plain`` (no speculation), ``dsbd none``
(``"sources": []``: nothing drafted, ever), ``dsbd`` (the user's engine, ``{"method": "dsbd"}``: draft-free sources,
cost model measured at start-up), ``dsbd draft`` (the tiny draft model, cost model measured); ``--engines "dsbd
forests"``: the user's sources with the cost model off (every step drafts: the drafting steps' counts). Per engine and
batch: the median operations and reads of the bare steps (decode steps with nothing scheduled to verify;
:mod:`vllm_dsbd.testing.step_ops`), and of the drafting steps, and how many of each. ``--names``: the operations that
differ from plain vLLM's bare step; ``--sites``: where the median drafting step reads (file:line; on the CPU every
tensor is a host one, so a site that reads a copy already fetched counts as a read too).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ENGINES = {"plain": None, "dsbd none": {"method": "dsbd", "sources": []}, "dsbd": {"method": "dsbd"},
           "dsbd draft": {"method": "dsbd", "model": "DRAFT"},
           "dsbd forests": {"method": "dsbd", "cost_model": None}}


def measure(target, draft, engine: str, batches, max_tokens: int, sites: bool = False,
            temperature: float = 0.0) -> list[dict]:
    import gc

    import torch
    import vllm

    from vllm_dsbd.testing.step_ops import count_steps

    torch.set_num_threads(1)
    spec = ENGINES[engine]
    if spec is not None and spec.get("model") == "DRAFT":
        spec = {**spec, "model": str(draft)}
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=256, seed=0, enable_prefix_caching=False)
    llm = vllm.LLM(model=str(target), **kw, **({"speculative_config": spec} if spec else {}))
    rows = []
    try:
        sp = vllm.SamplingParams(temperature=temperature, seed=0 if temperature > 0 else None, max_tokens=max_tokens,
                                 ignore_eos=True)
        for b in batches:
            prompts = [{"prompt_token_ids": [(7 * i + j) % 390 + 5 for j in range(8)]} for i in range(b)]
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up
            with count_steps(llm, sites=sites) as steps:
                llm.generate(prompts, sp, use_tqdm=False)
            bare = [s for s in steps if s.bare and s.reqs == b]
            drafting = [s for s in steps if not s.prefill and (s.drafts > 0 or s.proposed > 0)]
            row = dict(engine=engine, batch=b, steps=len(steps), bare_steps=len(bare), drafting_steps=len(drafting))
            for name, group in (("bare", bare), ("drafting", drafting)):
                row[f"{name}_ops"] = statistics.median(s.ops for s in group) if group else None
                row[f"{name}_reads"] = statistics.median(s.reads for s in group) if group else None
            if bare:
                mid = sorted(bare, key=lambda s: s.ops)[len(bare) // 2]
                row["bare_op_names"], row["bare_read_names"] = dict(mid.op_names), dict(mid.read_names)
            if drafting and sites:
                mid = sorted(drafting, key=lambda s: s.reads)[len(drafting) // 2]
                row["drafting_read_sites"] = dict(mid.read_sites.most_common())
            rows.append(row)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| engine | batch | bare steps | ops / bare step | reads / bare step | drafting steps | ops / drafting step "
           "| reads / drafting step |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['engine']} | {r['batch']} | {r['bare_steps']} | {r['bare_ops']} | {r['bare_reads']} | "
                   f"{r['drafting_steps']} | {r['drafting_ops']} | {r['drafting_reads']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--engines", nargs="+", default=[e for e in ENGINES if e != "dsbd forests"])
    ap.add_argument("--names", action="store_true")
    ap.add_argument("--sites", action="store_true", help="where the median drafting step's host reads are made")
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' (seeded at T > 0)")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    from vllm_dsbd.testing.models import tiny_llama_pair

    target, draft = tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                                    draft_layers=2)
    rows = []
    for e in args.engines:
        rows += measure(target, draft, e, args.batches, args.max_tokens, args.sites, args.temperature)
    print(table(rows))
    if args.names:
        plain = {r["batch"]: r for r in rows if r["engine"] == "plain"}
        for r in rows:
            p = plain.get(r["batch"])
            if r["engine"] == "plain" or p is None or "bare_op_names" not in r:
                continue
            diff = collections.Counter(r["bare_op_names"])
            diff.subtract(p["bare_op_names"])
            print(r["engine"], r["batch"], {k: v for k, v in diff.items() if v}, "reads", r["bare_read_names"],
                  "plain reads", p["bare_read_names"])
    for r in rows:
        if r.get("drafting_read_sites"):
            print(r["engine"], r["batch"], "drafting step reads by site:")
            for site, n in r["drafting_read_sites"].items():
                print(f"    {n:3d}  {site}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"rows": rows}, indent=1))
        (args.out / "README.md").write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
