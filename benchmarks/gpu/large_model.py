"""Speed at a realistic model size without real weights (GPU; ``--tiny`` runs the same flow on CPU as a smoke test).

Target: a Llama-3.1-8B-shaped model, draft: a Llama-3.2-1B-shaped model, both with vLLM's random (``dummy``) weights,
made on the machine from config files only, with a word-level tokenizer of one word per token id (vLLM's beam
search needs a tokenizer; prompts are random token ids). Random weights make real acceptance near zero, so the
speculative rows run at a **set per-layer acceptance rate** (benchmark only): vLLM ``draft_model`` with vLLM's own
``rejection_sample_method="synthetic"`` (unconditional rates r, r^2, r^3, ...), DSBD with
``vllm_dsbd.testing.set_acceptance`` (DSBD's verification still runs, so its cost counts; the accepted path's length
follows the rate). The numbers are system speed at a given acceptance, not quality, and not DSBD's output law.

Rows, on the same prompts, one process, engines one after the other (``--engines`` picks), at each ``--batches``
size B (B = 1: ``--b1-prompts`` prompts one after the other; B > 1: B prompts in one call):
  plain        plain sampling (temperature 1); vLLM's ``LLM.beam_search`` W = ``--beam-width`` (T = 0) at
               ``--beam-batches``
  draft_model  vLLM's draft_model speculation, depth ``--depth``, at each rate
  dsbd         one engine as a user starts it (cost model on): DSBD plain requests at each width of ``--widths``
               and each rate, with the cost model choosing each request's depth (the depths it chose are recorded
               in the row), then the same with the cost model set aside (depth ``--depth`` pinned; ``--no-pinned``
               skips these); DSBD beam requests (beam search W = ``--beam-width``, T = 0, and beam sampling, T = 1,
               verified at the set rate) with the cost model's depth and with the request pinning depth
               ``--depth``; in-engine beam search and beam sampling without drafts (depth 0) at
               ``--beam-batches``
  dsbd_free    the ``dsbd`` rows on an engine without a draft model (forests from the draft-free sources, recycle
               + lookup; what ``vllm serve TARGET --speculative-method dsbd`` runs), labelled "draft-free"
  dsbd_head    the ``dsbd`` rows with an EAGLE-3 head as the draft (Llama-3.1-8B-shaped, one layer, a 32,000-token
               draft vocabulary, dummy weights: ``head_folder``), labelled "EAGLE-3 head"
  dsbd_head_mixed  the same head mixed with the draft-free sources (``"sources": ["model", "recycle", "lookup"]``,
               ``engine/mixing.py``: the general depth loops and the sources' host work), "EAGLE-3 head + sources"
  dsbd_chain   a width-1 DSBD engine with ``full_cuda_graphs`` (every forest a chain: its decode passes have no
               forest attention and replay vLLM's full graphs): plain requests at each rate
CUDA graphs are on (vLLM's defaults; the plugin lowers a DSBD engine to piecewise graphs or eager, logged) unless
``--eager``. Rows are printed (``row: {...}``) and appended to ``rows.jsonl`` as they finish, so a run cut by a time
limit keeps what it measured. Printed last: tokens/s, target passes per token, each row's speed relative to plain
sampling at the same batch, and plain decoding's time per token at batch 1 against the HBM floor (weight and KV
bytes / ``--hbm-tbps``).

    python benchmarks/gpu/large_model.py --out results/gpu/large_model        (GPU)
    python benchmarks/gpu/large_model.py --tiny --out /tmp/lm                  (CPU smoke)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # set_acceptance must act in the engine's process

from vllm_dsbd.testing import set_acceptance  # noqa: E402
from vllm_dsbd.testing.models import dummy_llama_folder  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)
TINY_T = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False)
TINY_D = dict(TINY_T, num_hidden_layers=1, tie_word_embeddings=True)


def model_folders(work: Path, tiny: bool) -> tuple[Path, Path, dict]:
    """(target folder, draft folder, target shape): config files and a tokenizer, the tiny shapes or the 8B / 1B."""
    dtype = "float32" if tiny else "bfloat16"
    tshape, dshape = (TINY_T, TINY_D) if tiny else (LLAMA_8B, LLAMA_1B)
    target = dummy_llama_folder(work / "target", tshape, dtype)
    return target, dummy_llama_folder(work / "draft", dshape, dtype), tshape


def head_folder(work: Path, tiny: bool) -> Path:
    """An EAGLE-3 head for the target, config only (vLLM's dummy weights: ``d2t`` stays 0, the draft vocabulary is the
    first ``draft_vocab_size`` ids): Llama-3.1-8B-shaped, one layer, a 32,000-token draft vocabulary as the public
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B has (tiny: the tiny target's shape, half its vocabulary, aux layers 0-2 of its
    two)."""
    shape = TINY_T if tiny else LLAMA_8B
    folder = work / "head"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               torch_dtype="float32" if tiny else "bfloat16", **dict(shape, num_hidden_layers=1),
               draft_vocab_size=shape["vocab_size"] // 2 if tiny else 32000)
    if tiny:
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def draft_model_spec(draft: Path, depth: int, rate: float | None) -> dict:
    """vLLM's draft_model speculation; at a set per-position ``rate`` (None: real rejection sampling) through vLLM's
    synthetic rejection sampler (unconditional rates r, r^2, ...: conditional rate r at every position)."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": depth}
    if rate is not None:
        spec.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=[rate ** (k + 1)
                                                                                      for k in range(depth)])
    return spec


def metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", 0) or 0
    return 0


def shutdown(llm):
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def param_bytes(shape: dict, bytes_per: int = 2) -> int:
    """Weight bytes of a Llama of this shape (embedding, LM head unless tied, attention, MLP, norms)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    vocab = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return bytes_per * (n * layer + vocab + h)


def kv_bytes(shape: dict, tokens: int, bytes_per: int = 2) -> int:
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return bytes_per * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head * tokens


def engine_kwargs(args) -> dict:
    dtype = "float32" if args.tiny else "bfloat16"
    gpu_mem = {} if args.tiny else {"gpu_memory_utilization": 0.45}  # engines in turn in one process
    need = args.prompt_len + max(args.max_tokens, args.beam_tokens * (args.beam_width + 1) + 2) + 64
    return dict(dtype=dtype, **gpu_mem, enforce_eager=args.eager or args.tiny, load_format="dummy", seed=0,
                max_model_len=need, disable_log_stats=False, enable_prefix_caching=False,
                max_num_seqs=max(max(args.batches) * args.beam_width, 8))


class Bench:
    """The prompts, the batch sizes, and the rows measured so far (printed and appended to rows.jsonl)."""

    def __init__(self, args, prompts):
        self.args, self.prompts, self.rows = args, prompts, []
        self.out = Path(args.out) if args.out else None
        if self.out:  # rows of earlier runs into the same folder (one engine per call) are kept
            self.out.mkdir(parents=True, exist_ok=True)
            if args.fresh or not (self.out / "rows.jsonl").exists():
                (self.out / "rows.jsonl").write_text("")

    def all_rows(self) -> list[dict]:
        """This run's rows, after those of earlier runs into the same folder."""
        if not self.out:
            return self.rows
        return [json.loads(line) for line in (self.out / "rows.jsonl").read_text().splitlines() if line.strip()]

    def groups(self, batch: int) -> list[list]:
        """The prompt groups of one row: batch 1 = ``--b1-prompts`` calls of one prompt, else one call of B."""
        if batch == 1:
            return [[p] for p in self.prompts[: self.args.b1_prompts]]
        return [self.prompts[:batch]]

    def run(self, llm, method: str, batch: int, call, counter: str | None = None, accepted: str | None = None,
            **extra) -> dict:
        """Times ``call(prompts) -> new tokens`` over the batch's groups (a warm-up call of the first whole group first:
        the batch's own shapes; with one prompt only, the first batch-32 row ran 5x slower on an H100) and records a row.
        Target passes, counted by the engine: the increase of ``counter``, or tokens minus the increase of the
        ``accepted`` draft tokens counter (each pass emits one token plus the drafts it accepted), else one per
        token."""
        groups = self.groups(batch)
        call(groups[0])  # warm-up (graphs, allocator, the forests' shapes) at this batch
        before = {k: metric(llm, k) for k in (counter, accepted) if k}
        chosen0 = chosen_depths(llm)
        t0 = time.perf_counter()
        tokens = sum(call(g) for g in groups)
        secs = time.perf_counter() - t0
        delta = {k: metric(llm, k) - v for k, v in before.items()}
        passes = delta[counter] if counter else tokens - delta[accepted] if accepted else tokens
        if chosen0 is not None:  # a DSBD engine: the depths its decoding requests drafted (cost model or pinned)
            since = chosen_since(chosen0, chosen_depths(llm))
            extra["depths"], extra["beam_nodes"] = since["depths"], since["nodes"]
        row = dict(method=method, batch=batch, tokens=tokens, seconds=secs, passes=passes, **extra)
        self.rows.append(row)
        print("row:", row, flush=True)
        if self.out:
            with open(self.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def params(args, n, **kw):
    import vllm

    return [vllm.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=i,
                                detokenize=False, **kw) for i in range(n)]


def new_tokens(outs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def chosen_depths(llm) -> dict | None:
    """A DSBD engine's counts so far: ``depths`` (draft depth -> decoding requests x steps, as the cost model chose
    it or, pinned, the configured depth; beam requests whose depth the request pins are not counted) and ``nodes``
    (N -> T = 0 beam forests the cost model sized); None for an engine without DSBD."""
    stats = getattr(runner_of(llm), "dsbd_stats", None)
    if stats is None:
        return None
    return {"depths": {str(k): v for k, v in stats.draft_depths.items()},
            "nodes": {str(k): v for k, v in stats.beam_nodes_chosen.items()}}


def chosen_since(before: dict, after: dict) -> dict:
    """``chosen_depths`` counts made between two readings (zero counts left out)."""
    return {key: {k: v - before[key].get(k, 0) for k, v in after[key].items() if v - before[key].get(k, 0)}
            for key in ("depths", "nodes")}


@contextlib.contextmanager
def cost_model_off(llm):
    """Benchmark only: the engine's cost model and load-aware budget set aside, so every plain request drafts the
    configured depth (rows that say "depth d" then mean it); restored on exit."""
    runner = runner_of(llm)
    keys = ("dsbd_cost", "_dsbd_cost_base", "_dsbd_clock", "dsbd_budget")
    saved = {k: getattr(runner, k) for k in keys}
    for k in keys:
        setattr(runner, k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(runner, k, v)


def plain_rows(bench: Bench, target: Path, kw: dict) -> None:
    import vllm
    from vllm.sampling_params import BeamSearchParams

    args = bench.args
    llm = vllm.LLM(model=str(target), **kw)
    try:
        for b in args.batches:
            bench.run(llm, "plain sampling", b, lambda g: new_tokens(
                llm.generate(g, params(args, len(g)), use_tqdm=False)), width=1, rate=None)
        bp = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.beam_tokens, ignore_eos=True,
                              temperature=0.0)
        for b in args.beam_batches:
            bench.run(llm, "vLLM beam_search", b, lambda g: sum(
                len(o.sequences[0].tokens) - args.prompt_len for o in llm.beam_search(
                    [{"prompt_token_ids": p["prompt_token_ids"]} for p in g], bp)),
                width=args.beam_width, rate=None)
    finally:
        shutdown(llm)


def draft_model_rows(bench: Bench, target: Path, draft: Path, kw: dict) -> None:
    """vLLM's draft_model at each set rate: its synthetic rejection sampler accepts position k of a draft with the
    conditional rate r (unconditional r^k); one engine, the rates tensor refilled between rows. vLLM's CPU sampler
    has no synthetic mode: with ``--tiny`` the rows run vLLM's real rejection sampling (rate None)."""
    import vllm

    args = bench.args
    spec = draft_model_spec(draft, args.depth, None if args.tiny else args.rates[0])
    llm = vllm.LLM(model=str(target), speculative_config=spec, **kw)
    try:
        sampler = runner_of(llm).rejection_sampler
        for rate in (args.rates if not args.tiny else [None]):
            if rate is not None:
                sampler.synthetic_conditional_rates.fill_(rate)
            for b in args.batches:
                bench.run(llm, "vLLM draft_model (set rate)", b, lambda g: new_tokens(
                    llm.generate(g, params(args, len(g)), use_tqdm=False)),
                    accepted="vllm:spec_decode_num_accepted_tokens", width=1, rate=rate, depth=args.depth)
    finally:
        shutdown(llm)


def dsbd_rows(bench: Bench, target: Path, draft: Path | None, kw: dict, tag: str | None = None,
              sources: list[str] | None = None) -> None:
    """The DSBD engine's rows; ``draft`` None: an engine without a draft model, its forests from the draft-free sources
    (recycle + lookup: no draft pass, the forest's own host and device work counted), rows labelled "draft-free";
    ``tag``: the rows' label (an EAGLE-3 head's: "EAGLE-3 head "); ``sources``: the speculative config's."""
    import vllm
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.patches.beam_search_route import beam_request_params

    args = bench.args
    spec = {"method": "dsbd", "num_speculative_tokens": args.depth,
            "width": max(args.widths + [args.beam_width]), "dynamic_width": False,
            **({"model": str(draft)} if draft is not None else {}), **({"sources": sources} if sources else {})}
    tag = tag if tag is not None else "" if draft is not None else "draft-free "
    llm = vllm.LLM(model=str(target), speculative_config=spec, **kw)
    cfg = llm.llm_engine.vllm_config

    def beams(g, depth, temperature=0.0):
        bp = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.beam_tokens, ignore_eos=True,
                              temperature=temperature)
        sps = [beam_request_params(bp, None, args.prompt_len, cfg.model_config.max_model_len,
                                   cfg.additional_config["dsbd"]["width"]) for _ in g]
        for sp in sps:
            if depth is not None:
                sp.extra_args["dsbd_beam"]["depth"] = depth
        llm.generate(g, sps, use_tqdm=False)
        return args.beam_tokens * len(g)  # every beam search here runs max_tokens steps (EOS ignored)

    def plain_requests(w):
        return lambda g: new_tokens(llm.generate(g, params(args, len(g), extra_args={"dsbd_width": w}),
                                                 use_tqdm=False))

    set_acceptance.install(args.rates[0])
    try:
        for rate in args.rates:
            set_acceptance.set_rate(rate)
            for w in args.widths:
                for b in args.batches:  # the user's engine: the cost model picks each request's depth (recorded)
                    set_acceptance.reseed()  # each row's draws its own (earlier rows' forests depend on timings)
                    bench.run(llm, f"DSBD {tag}plain requests, cost model (set rate)", b, plain_requests(w),
                              counter="vllm:dsbd_target_passes", width=w, rate=rate, depth="cost model")
                if args.pinned:
                    with cost_model_off(llm):
                        for b in args.batches:
                            set_acceptance.reseed()
                            bench.run(llm, f"DSBD {tag}plain requests, depth {args.depth} pinned (set rate)", b,
                                      plain_requests(w), counter="vllm:dsbd_target_passes", width=w, rate=rate,
                                      depth=args.depth)
            for b in args.beam_batches:
                for temperature, kind in ((0.0, "beam search"), (1.0, "beam sampling T=1")):
                    set_acceptance.reseed()
                    bench.run(llm, f"DSBD {tag}{kind}, cost model (set rate)", b,
                              lambda g, t=temperature: beams(g, None, t), counter="vllm:dsbd_beam_target_passes",
                              width=args.beam_width, rate=rate, depth="cost model")
                    if args.pinned:  # the request pins its depth: the cost model leaves it alone
                        set_acceptance.reseed()
                        bench.run(llm, f"DSBD {tag}{kind}, depth {args.depth} pinned (set rate)", b,
                                  lambda g, t=temperature: beams(g, args.depth, t),
                                  counter="vllm:dsbd_beam_target_passes", width=args.beam_width, rate=rate,
                                  depth=args.depth)
        for b in args.beam_batches:
            bench.run(llm, f"{tag}in-engine beam search (depth 0)", b, lambda g: beams(g, 0),
                      counter="vllm:dsbd_beam_target_passes", width=args.beam_width, rate=None, depth=0)
            bench.run(llm, f"{tag}in-engine beam sampling T=1 (depth 0)", b, lambda g: beams(g, 0, 1.0),
                      counter="vllm:dsbd_beam_target_passes", width=args.beam_width, rate=None, depth=0)
    finally:
        set_acceptance.uninstall()
        shutdown(llm)


def dsbd_chain_rows(bench: Bench, target: Path, draft: Path, kw: dict) -> None:
    import vllm

    args = bench.args
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": args.depth, "width": 1,
            "full_cuda_graphs": True}
    llm = vllm.LLM(model=str(target), speculative_config=spec, **kw)
    set_acceptance.install(args.rates[0])
    try:
        for rate in args.rates:
            set_acceptance.set_rate(rate)
            for b in args.batches:
                bench.run(llm, "DSBD W=1 engine, full graphs (set rate)", b, lambda g: new_tokens(llm.generate(
                    g, params(args, len(g)), use_tqdm=False)), counter="vllm:dsbd_target_passes", width=1, rate=rate,
                    depth="cost model")
    finally:
        set_acceptance.uninstall()
        shutdown(llm)


def report(rows: list[dict], args, target_shape: dict) -> str:
    import torch

    plain = {r["batch"]: r["tokens"] / r["seconds"] for r in rows if r["method"] == "plain sampling"}
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["passes_per_token"] = r["passes"] / max(r["tokens"], 1)
        r["speed_vs_plain"] = r["tokens_per_s"] / plain[r["batch"]] if r["batch"] in plain else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shapes = "tiny" if args.tiny else "target Llama-3.1-8B shape, draft Llama-3.2-1B shape"
    lines = [f"{device}; {shapes}; random weights; prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens "
             f"(beam rows {args.beam_tokens}), plain and speculative rows T = 1, beam rows T = 0 unless marked; "
             f"{'eager' if args.eager or args.tiny else 'CUDA graphs on (vLLM defaults, DSBD lowered by the plugin)'}"
             f"; DSBD draft depth up to {args.depth}, fixed width; \"depths drafted\": depth -> decoding requests x "
             "steps as the engine counted them (cost-model rows: its choices; beam rows whose request pins the depth "
             "are not counted there)", "",
             "| method | batch | W | rate | tokens | tok/s | target passes / token | vs plain (same batch) | depths drafted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = f"{r['rate']:.2f}" if r.get("rate") is not None else "-"
        vs = f"{r['speed_vs_plain']:.2f}" if r["speed_vs_plain"] is not None else "-"
        depths = " ".join(f"{k}:{v}" for k, v in sorted(r["depths"].items())) if r.get("depths") else "-"
        lines.append(f"| {r['method']} | {r['batch']} | {r['width']} | {rate} | {r['tokens']} | "
                     f"{r['tokens_per_s']:.1f} | {r['passes_per_token']:.3f} | {vs} | {depths} |")
    if 1 in plain:
        ctx = args.prompt_len + args.max_tokens // 2
        floor = (param_bytes(target_shape) + kv_bytes(target_shape, ctx)) / (args.hbm_tbps * 1e12)
        lines += ["", f"plain decoding at batch 1: {1e3 / plain[1]:.2f} ms per token; HBM floor (weights + KV at "
                      f"{ctx} tokens) / {args.hbm_tbps} TB/s = {1e3 * floor:.2f} ms: "
                      f"{1 / plain[1] / floor:.2f}x the floor"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test of the flow)")
    ap.add_argument("--engines", default="plain,draft_model,dsbd")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--b1-prompts", type=int, default=4, help="prompts run one after the other at batch 1")
    ap.add_argument("--beam-batches", default="1")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--beam-tokens", type=int, default=32)
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rates", default="0.6,0.8")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--no-pinned", dest="pinned", action="store_false",
                    help="DSBD rows with the cost model only (no rows at the pinned depth)")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager) in every engine")
    ap.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth for the floor (H100 SXM: 3.35)")
    ap.add_argument("--work", default="/tmp/dsbd-large-model")
    ap.add_argument("--out", default=None, help="folder: rows.jsonl (appended), README.md, large_model.json")
    ap.add_argument("--fresh", action="store_true", help="forget the rows of earlier runs in --out")
    ap.add_argument("--report", action="store_true", help="no engine: the table of the rows in --out")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.batches, args.beam_batches, args.widths = ints(args.batches), ints(args.beam_batches), ints(args.widths)
    args.rates = [float(r) for r in args.rates.split(",")]
    engines = [] if args.report else [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - {"plain", "draft_model", "dsbd", "dsbd_free", "dsbd_chain", "dsbd_head",
                                     "dsbd_head_mixed"}:
        ap.error(f"unknown engines {sorted(unknown)}")

    import torch
    from vllm.inputs import TokensPrompt

    if args.tiny:
        torch.set_num_threads(1)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    target, draft, tshape = model_folders(Path(args.work), args.tiny)
    rnd = random.Random(0)
    n = max(args.batches + args.beam_batches + [args.b1_prompts])
    prompts = [TokensPrompt(prompt_token_ids=[rnd.randrange(3, tshape["vocab_size"]) for _ in range(args.prompt_len)])
               for _ in range(n)]
    bench = Bench(args, prompts)
    kw = engine_kwargs(args)
    steps = {"plain": lambda: plain_rows(bench, target, kw),
             "draft_model": lambda: draft_model_rows(bench, target, draft, kw),
             "dsbd": lambda: dsbd_rows(bench, target, draft, kw),
             "dsbd_free": lambda: dsbd_rows(bench, target, None, kw),
             "dsbd_head": lambda: dsbd_rows(bench, target, head_folder(Path(args.work), args.tiny), kw,
                                            tag="EAGLE-3 head "),
             "dsbd_head_mixed": lambda: dsbd_rows(bench, target, head_folder(Path(args.work), args.tiny), kw,
                                                  tag="EAGLE-3 head + sources ",
                                                  sources=["model", "recycle", "lookup"]),
             "dsbd_chain": lambda: dsbd_chain_rows(bench, target, draft, kw)}
    for e in engines:
        t0 = time.perf_counter()
        steps[e]()
        print(f"engine {e}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = bench.all_rows()
    text = report(rows, args, tshape)
    print("\n" + text)
    if bench.out:
        (bench.out / "README.md").write_text(f"# large_model.py\n\n`{' '.join(sys.argv)}`\n\n{text}\n")
        (bench.out / "large_model.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
