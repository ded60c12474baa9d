"""Beam search: vLLM's ``LLM.beam_search`` (its front-end loop) against beam search inside the DSBD engine, without
a draft (γ = 0) and with DSBD's draft forests (full width, γ = the engine's depth).

One script, the rows side by side on the same prompts and weights (float32 on CPU), one engine at a time, prefix
caching on for all (vLLM's loop relies on it to avoid re-prefilling every beam every step):

* ``vllm beam_search W``: a plain engine, ``LLM.beam_search`` (per token, one engine request per live beam);
* ``in-engine beam search W (γ = 0)``: a DSBD engine, one engine request per prompt (the beams a trie in the
  request's KV slots), draft depth 0 on the request (``extra_args["dsbd_beam"]["depth"]``): no forest;
* ``DSBD full width W γ = G``: the same engine and requests with the engine's draft depth: the draft beam-searches G
  steps ahead of the live beams and one target pass verifies the forest (``LLM.beam_search`` takes this path);
* ``--sampling``: beam sampling at temperature 1 (seeded): in-engine γ = 0, and DSBD full width with fixed width
  (each layer exact: target beam sampling) and with the paper's dynamic width (``dsbd_beam.dynamic_width``);
* the DSBD rows' engine has the cost model on (the default, ``cost_model`` "auto": each step drafts only the depth
  that pays, down to none); ``--pinned``: the same rows again on an engine with pinned shapes (``cost_model`` and
  ``verify_budget`` null: always the full forest); ``--engine-requests``: the T = 0 DSBD rows as engine requests
  (the engine's depth), as the γ = 0 row runs, rather than through ``LLM.beam_search``'s route, so that a row and
  its no-draft counterpart differ only in drafting;
* ``--self-draft``: DSBD full width with the target as its own draft (the acceptance ceiling);
* ``--no-draft-engine``: ``LLM.beam_search`` on a DSBD engine started without a draft model;
* ``--no-relayout``: the in-engine γ = 0 and DSBD T = 0 rows again with the re-layout off
  (``VLLM_DSBD_BEAM_RELAYOUT=0``: dead trie slots stay, the beams' common prefix stays in the trie);
* ``--nodes 4,8,16,32``: over-drafted forests, one DSBD row per N (draft nodes per depth, ``dsbd_beam.nodes``; the
  engine's ``beam_nodes`` is the largest N, which the plain DSBD row then gets too) at T = 0, and at T = 1 fixed width
  with ``--sampling``; ``--pin-depth`` pins the draft depth on those requests (every step drafts, no pause after
  forests that passed no layer). Writes ``overdraft.png`` (target passes per beam step against N) beside the table;
* ``--beam-nodes 16``: the DSBD engines' ``beam_nodes`` (default: the largest ``--nodes``), without N rows: with the
  cost model on, T = 0 beam requests draft the N it chooses between W and this.

Reported per row: wall seconds, best-beam tokens per second and its ratio to the in-engine γ = 0 row of the same
temperature (side by side in one run), target passes (vLLM's loop: engine requests it made,
from ``vllm:request_success``; in-engine: ``vllm:dsbd_beam_target_passes``), target passes per beam step (in-engine:
``vllm:dsbd_beam_target_passes / vllm:dsbd_beam_steps``, counted by the engine), and KV blocks held per request
(in-engine: measured, ``vllm:dsbd_beam_kv_blocks``, the blocks the request owns when it finishes, its draft
slots included; vLLM's loop: its W live beams each hold their prompt + tokens,
shared prompt blocks counted once: computed from the outputs, stated as such), against one plain request of the same
prompt and length, and the quality of the best beam (its target log-probability per token). Whether the T = 0 rows
return vLLM's beams is checked and printed.

    python benchmarks/engine/beams.py                 # SmolLM2-135M-Instruct, 8 ShareGPT prompts, W = 4, 32 tokens
    python benchmarks/engine/beams.py --tiny          # the tiny random Llama (a smoke run)
    python benchmarks/engine/beams.py --nodes 4,8,16,32 --sampling   # over-drafted forests
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


_COUNTERS = ("vllm:request_success", "vllm:dsbd_beam_target_passes", "vllm:dsbd_beam_steps",
             "vllm:dsbd_beam_draft_nodes", "vllm:dsbd_beam_layers_passed")


def _beam_search(llm, prompts, bp, depth, dynamic=False, nodes=None):
    """``LLM.beam_search``, or (``depth`` given, a DSBD engine) the same engine requests with that draft depth (-1:
    the engine's), seeded 0, 1, .. at temperature > 0, with dynamic width if asked and ``nodes`` draft nodes per depth
    (None: the engine's ``beam_nodes``)."""
    if depth is None:
        return llm.beam_search([{"prompt_token_ids": p} for p in prompts], bp, use_tqdm=False)
    from vllm_dsbd.patches.beam_search_route import beam_outputs, beam_request_params

    cfg = llm.llm_engine.vllm_config
    eos = llm.get_tokenizer().eos_token_id
    params = [beam_request_params(bp, eos, len(p), cfg.model_config.max_model_len,
                                  cfg.additional_config["dsbd"]["width"]) for p in prompts]
    for k, sp in enumerate(params):
        if depth >= 0:
            sp.extra_args["dsbd_beam"]["depth"] = depth
        sp.extra_args["dsbd_beam"]["dynamic_width"] = dynamic
        if nodes is not None:
            sp.extra_args["dsbd_beam"]["nodes"] = nodes
        sp.seed = k
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    return [beam_outputs({"type": "token", "prompt_token_ids": p}, o, tok) for p, o in zip(prompts, outs)]


def _run(llm, prompts, width, max_tokens, depth=None, temperature=0.0, dynamic=False, nodes=None, repeats=1):
    """One row: the counters and outputs of its first timed run, the least wall time of ``repeats`` (on shared cores
    noise only adds time)."""
    from vllm.sampling_params import BeamSearchParams

    bp = BeamSearchParams(beam_width=width, max_tokens=max_tokens, temperature=temperature)
    _beam_search(llm, prompts[:1], BeamSearchParams(beam_width=width, max_tokens=2), depth)  # warm-up
    c0 = {k: _value(llm, k) for k in _COUNTERS}
    chosen0 = _chosen(llm)
    t0 = time.perf_counter()
    outs = _beam_search(llm, prompts, bp, depth, dynamic, nodes)
    secs = time.perf_counter() - t0
    c = {k.split(":")[1]: _value(llm, k) - c0[k] for k in _COUNTERS}
    chosen = {key: {k: v - chosen0[key].get(k, 0) for k, v in sorted(d.items()) if v - chosen0[key].get(k, 0)}
              for key, d in _chosen(llm).items()}
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        _beam_search(llm, prompts, bp, depth, dynamic, nodes)
        secs = min(secs, time.perf_counter() - t0)
    best = [list(o.sequences[0].tokens[len(p):]) for o, p in zip(outs, prompts)]
    beams = [[list(s.tokens) for s in o.sequences] for o in outs]
    # quality: the best beam's log-probability per token under the target (raw, temperature 1)
    lp = sum(o.sequences[0].cum_logprob for o in outs) / max(1, sum(len(b) for b in best))
    return dict(seconds=secs, best=best, beams=beams, requests=c["request_success"], logprob_per_token=lp,
                temperature=temperature, nodes=nodes,
                beam_passes=c["dsbd_beam_target_passes"], beam_steps=c["dsbd_beam_steps"],
                draft_nodes=c["dsbd_beam_draft_nodes"], layers_passed=c["dsbd_beam_layers_passed"], chosen=chosen)


def _chosen(llm) -> dict:
    """A DSBD engine's counts of the draft depths the cost model chose (or the budget allowed) and of the N it chose
    for T = 0 beam requests, per request and step (``dsbd_load``); empty elsewhere."""
    try:
        load = llm.collective_rpc("dsbd_load")[0]
    except Exception:  # noqa: BLE001 - a plain vLLM engine has no such method
        return {"depths": {}, "nodes": {}}
    return {"depths": dict(load["depths"]), "nodes": dict(load.get("nodes", {}))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--draft", default=None, help="SmolLM2: this draft folder instead of the committed draft")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--depth", type=int, default=3, help="the DSBD engine's draft depth γ")
    ap.add_argument("--engine-requests", action="store_true",
                    help="run the T = 0 DSBD rows as engine requests, as the γ = 0 row, not through LLM.beam_search")
    ap.add_argument("--pinned", action="store_true",
                    help="also run the DSBD rows on an engine with pinned shapes (cost model and budget off)")
    ap.add_argument("--self-draft", action="store_true",
                    help="also run DSBD full width with the target as its own draft (the acceptance ceiling: every "
                         "forest layer passes; it costs a second target per draft pass)")
    ap.add_argument("--sampling", action="store_true",
                    help="also run beam sampling at temperature 1: in-engine γ = 0, DSBD full width with fixed and "
                         "with dynamic width (seeded; not compared with vLLM's loop, which ranks beams greedily)")
    ap.add_argument("--no-draft-engine", action="store_true",
                    help="also run LLM.beam_search on a DSBD engine started without a draft model")
    ap.add_argument("--no-relayout", action="store_true",
                    help="also run the in-engine γ = 0 and DSBD T = 0 rows without the re-layout of beam requests")
    ap.add_argument("--loop-without-prefix-caching", action="store_true",
                    help="also run vLLM's loop with prefix caching off (every beam re-prefilled every step)")
    ap.add_argument("--nodes", default="",
                    help="comma-separated N >= W: one DSBD row per N (draft nodes per depth of the beam forests)")
    ap.add_argument("--beam-nodes", type=int, default=None,
                    help="the DSBD engines' beam_nodes (default: the largest --nodes): N the cost model chooses up to")
    ap.add_argument("--pin-depth", action="store_true",
                    help="the --nodes rows pin the draft depth on the request (every step drafts)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row (the least wall time is reported)")
    ap.add_argument("--out", default=str(ROOT / "results" / "beams"))
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    import vllm

    from vllm_dsbd.testing import models
    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.engines import shutdown
    from vllm_dsbd.testing.prompts import load_prompts

    if args.tiny:
        target, draft = models.tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1,
                                               target_layers=3, draft_layers=2)
        name, draft_desc = "tiny random Llama (3 layers)", "its first 2 layers"
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub, as demo_vllm.py runs
        target = models.smollm2_dir()
        draft, draft_desc = (args.draft, args.draft) if args.draft else draft_folder(target, 8, ROOT)
        name = "SmolLM2-135M-Instruct"
    tok = models.load_tokenizer(target)
    prompts, prompt_desc, _ = load_prompts(tok, args.num_prompts, 128, args.tiny)
    prompts = prompts[: args.num_prompts]
    W, N, bs = args.width, args.max_tokens, args.block_size
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0, enable_prefix_caching=True,
              block_size=bs, disable_log_stats=False, max_num_seqs=64)
    rows = []
    G = args.depth
    # (label, engine, draft depth on the request: None = LLM.beam_search as the user calls it, -1 = the engine's;
    #  temperature, dynamic width[, re-layout])
    # --engine-requests: the T = 0 DSBD rows as the γ = 0 row's engine requests (the engine's depth), not through
    # LLM.beam_search's route, so that a row and its no-draft counterpart differ only in drafting
    full = -1 if args.engine_requests else None
    runs = [("vllm beam_search", "plain", None, 0.0, False), ("in-engine beam search (γ = 0)", "dsbd", 0, 0.0, False),
            (f"DSBD full width γ = {G}", "dsbd", full, 0.0, False)]
    if args.sampling:
        runs += [("in-engine beam sampling T = 1 (γ = 0)", "dsbd", 0, 1.0, False),
                 (f"DSBD full width γ = {G} T = 1, fixed width", "dsbd", -1, 1.0, False),
                 (f"DSBD full width γ = {G} T = 1, dynamic width", "dsbd", -1, 1.0, True)]
    if args.self_draft:
        runs.append((f"DSBD full width γ = {G}, the target as its own draft,", "dsbd-self", full, 0.0, False))
        if args.sampling:
            runs.append((f"DSBD full width γ = {G} T = 1, the target as its own draft,", "dsbd-self", -1, 1.0,
                         False))
    nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
    nd = G if args.pin_depth else -1  # the N rows' draft depth on the request (-1: the engine's, not pinned)
    pin = ", depth pinned" if args.pin_depth else ""
    runs += [(f"DSBD γ = {G} N = {n}{pin}", "dsbd", nd, 0.0, False, True, n) for n in nodes]
    if args.sampling:
        runs += [(f"DSBD γ = {G} T = 1, fixed width, N = {n}{pin}", "dsbd", nd, 1.0, False, True, n) for n in nodes]
    if args.pinned:  # the same DSBD rows with pinned shapes: every step drafts the full forest
        runs += [(f"{r[0]} pinned shapes,", r[1] + "-pinned", *r[2:]) for r in runs
                 if r[1] in ("dsbd", "dsbd-self") and r[2] != 0]
    if args.no_relayout:
        runs += [("in-engine beam search (γ = 0), no re-layout,", "dsbd", 0, 0.0, False, False),
                 (f"DSBD full width γ = {G}, no re-layout,", "dsbd", None, 0.0, False, False)]
    if args.no_draft_engine:
        runs.append(("beam search on a DSBD engine without a draft model,", "nodraft", None, 0.0, False))
    if args.loop_without_prefix_caching:
        runs.append(("vllm beam_search, no prefix caching,", "plain-nocache", None, 0.0, False))

    def dsbd(d, pinned=False):
        spec = {"method": "dsbd", "model": str(d), "num_speculative_tokens": G, "width": W}
        beam_nodes = args.beam_nodes or (max(nodes) if nodes else None)
        spec.update({"beam_nodes": beam_nodes} if beam_nodes else {})
        spec.update({"cost_model": None, "verify_budget": None} if pinned else {})
        return dict(speculative_config=spec)

    engines = {"plain": {}, "plain-nocache": {"enable_prefix_caching": False}, "dsbd": dsbd(draft),
               "dsbd-self": dsbd(target), "dsbd-pinned": dsbd(draft, True), "dsbd-self-pinned": dsbd(target, True),
               "nodraft": dict(speculative_config={"method": "dsbd", "width": W, "sources": []})}
    llm, current = None, None
    from vllm_dsbd.engine.state import RELAYOUT_ENV

    for label, engine, depth, temp, dynamic, *rest in tqdm(runs, desc="rows", unit="row"):
        relayout, n_nodes = rest[0] if rest else True, rest[1] if len(rest) > 1 else None
        if engine != current:
            if llm is not None:
                shutdown(llm)
            llm, current = vllm.LLM(model=str(target), **{**kw, **engines[engine]}), engine
        blocks0 = _metric(llm, "vllm:dsbd_beam_kv_blocks")
        b0 = (blocks0.sum, blocks0.count) if blocks0 is not None else (0.0, 0)
        os.environ[RELAYOUT_ENV] = "1" if relayout else "0"  # read as the engine registers a request
        r = _run(llm, prompts, W, N, depth, temp, dynamic, n_nodes, args.repeats)
        os.environ.pop(RELAYOUT_ENV)
        blocks = _metric(llm, "vllm:dsbd_beam_kv_blocks")
        n_b = blocks.count - b0[1] if blocks is not None else 0
        r["measured_blocks"] = (blocks.sum - b0[0]) / n_b if n_b else None
        r["label"] = f"{label} W={W}"
        rows.append(r)
    shutdown(llm)
    plain_blocks = sum(math.ceil((len(p) + N) / bs) for p in prompts) / len(prompts)
    loop = rows[0]
    # vLLM's loop: W live beams of prompt + N tokens; the prompt's full blocks shared through the prefix cache
    loop_blocks = sum(len(p) // bs + W * (math.ceil((len(p) + N) / bs) - len(p) // bs) for p in prompts) / len(prompts)
    loop["blocks"], loop["blocks_how"] = loop_blocks, "computed: W beams x (prompt + tokens), prompt blocks shared"
    for r in rows[1:]:
        if r["measured_blocks"] is not None:
            r["blocks"], r["blocks_how"] = r["measured_blocks"], "measured (vllm:dsbd_beam_kv_blocks)"
        else:  # vLLM's loop without prefix caching: every beam holds its own prompt too
            r["blocks"], r["blocks_how"] = W * plain_blocks, "computed: W beams x (prompt + tokens)"
    same = [sum(a == b for a, b in zip(rows[0]["beams"], r["beams"])) if r["temperature"] == 0 else None
            for r in rows[1:]]
    lines = [f"# Beam search W = {W}: vLLM's front-end loop vs in the DSBD engine", "",
             f"{name}, {prompt_desc} (first {len(prompts)}), {N} tokens, temperature 0 (T = 1 rows: beam sampling, "
             f"seeds 0..{len(prompts) - 1}), float32, "
             f"{os.cpu_count()} CPU threads available, torch threads 1, block size {bs}, prefix caching on. "
             "DSBD rows not marked 'pinned shapes': the cost model on (the default).", "",
             "| row | wall s | best-beam tok/s | vs γ = 0 | target passes | target passes per beam step | forest "
             "layers passed / draft nodes | KV blocks / request | vs one plain request | best beam log-prob / token | "
             "cost model's N / depth (request-steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    # the in-engine γ = 0 row of each temperature: every row's no-draft counterpart
    zero = {r["temperature"]: sum(len(b) for b in r["best"]) / r["seconds"] for r in rows if "(γ = 0)" in r["label"]
            and "no re-layout" not in r["label"]}
    for r in rows:
        toks = sum(len(b) for b in r["best"])
        passes = r["beam_passes"] if r["beam_passes"] else r["requests"]
        per_step = f"{r['beam_passes'] / r['beam_steps']:.3f}" if r["beam_steps"] else "1 engine request per beam"
        forest = f"{r['layers_passed']:.0f} / {r['draft_nodes']:.0f}" if r["beam_steps"] else "-"
        blocks = r["blocks"]
        vs0 = f"{toks / r['seconds'] / zero[r['temperature']]:.2f}x" if r["temperature"] in zero else "-"
        lines.append(f"| {r['label']} | {r['seconds']:.2f} | {toks / r['seconds']:.1f} | {vs0} | {passes:.0f} | "
                     f"{per_step} | "
                     f"{forest} | {blocks:.1f} ({r['blocks_how']}) | {blocks / plain_blocks:.2f}x | "
                     f"{r['logprob_per_token']:.3f} | {_choices(r['chosen'])} |")
    rate = [sum(len(b) for b in r["best"]) / r["seconds"] for r in rows]
    speed = rate[1] / rate[0]
    extra_rows = "; ".join(f"{r['label']} {x / rate[0]:.1f}x" for r, x in zip(rows[2:], rate[2:]))
    lines += ["", f"Best-beam tokens per second, in-engine (γ = 0) / vLLM loop: **{speed:.1f}x**; the other rows / vLLM "
              f"loop: {extra_rows}. Same "
              f"beams (tokens and order) as vLLM's loop, of {len(prompts)} prompts: "
              + ", ".join(f"{r['label']} {n}" for r, n in zip(rows[1:], same) if n is not None)
              + f". One plain request of the same prompt and length holds {plain_blocks:.1f} blocks. Draft: "
              f"{draft_desc}.", "",
              f"Command: `python benchmarks/engine/beams.py {' '.join(argv if argv is not None else sys.argv[1:])}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k not in ("beams",)} for r in rows] + [{"speedup": speed, "same": same}],
        indent=1))
    if nodes:
        _plot(rows, out / "overdraft.png", f"{name}, W = {W}, γ = {G}, {len(prompts)} prompts, {N} tokens")
    print("\n".join(lines))
    return 0


def _choices(chosen: dict) -> str:
    """The row's chosen N and depths, e.g. ``N {4: 10, 16: 2}; depth {0: 200, 1: 12}``."""
    parts = [f"{name} {chosen[key]}" for name, key in (("N", "nodes"), ("depth", "depths")) if chosen.get(key)]
    return "; ".join(parts) or "-"


def _plot(rows, path: Path, title: str) -> None:
    """Target passes per beam step against N (the ``--nodes`` rows), one line per temperature, with the γ = 0 rows
    (one pass per step) as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for temp, marker in ((0.0, "o"), (1.0, "s")):
        pts = sorted((r["nodes"], r["beam_passes"] / r["beam_steps"]) for r in rows
                     if r.get("nodes") and r["temperature"] == temp and r["beam_steps"])
        if pts:
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker=marker, label=f"DSBD, T = {temp:g}")
    ax.axhline(1.0, color="grey", linestyle="--", label="γ = 0 (one target pass per beam step)")
    ax.set_xscale("log", base=2)
    ns = sorted({r["nodes"] for r in rows if r.get("nodes")})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N, draft nodes per depth")
    ax.set_ylabel("target passes per beam step")
    ax.set_ylim(0, 1.1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
