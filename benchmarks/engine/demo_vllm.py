"""The main job: DSBD through vLLM 0.26 on a real model (SmolLM2-135M-Instruct, offline), side by side with plain
sampling on the same prompts, printing the outputs and a table of speed and acceptance.

    scripts/demo.sh            (sets up the environment, then runs this)
    .venv/bin/python benchmarks/engine/demo_vllm.py [--width 2] [--depth 3] [--max-tokens 48] [--temperature 1.0]
    scripts/demo.sh --paths    (builds the model folders, prints them and a `vllm serve` command, and exits)

vLLM's own log lines are hidden unless --verbose is given.

Draft: the distilled SmolLM2 draft when its artifact is in the repository (drafts/), otherwise the target's first
layers, untrained (low acceptance; say so in the table). Both engines run in this process, one after the other.
The DSBD engine drafts its configured shape every step (cost model off), so that the table shows what speculation
does; ``--cost-model`` runs it with the cost model on (the engine's default), which drafts only where it pays.
Tokens per target pass = generated tokens / target forward passes (one per engine step for a request; DSBD's are
counted by the engine, ``vllm:dsbd_target_passes``).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_dsbd.testing.drafts import draft_folder  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "List three primary colors:",
    "Once upon a time, in a small village,",
    "The best way to learn a new language is",
    "Translate to French: Good morning, how are you?",
]


def metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", None)
    return None


def machine() -> str:
    """The device the engines ran on, in words (the GPU's name, or the CPU model and the threads used)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def serve_command(target: Path, draft: Path, width: int, depth: int) -> str:
    """A `vllm serve` command for this pair that works as written on this machine (on CPU vLLM's default memory
    fraction 0.92 is refused, so a smaller one is given)."""
    import torch

    mem = "" if torch.cuda.is_available() else " --gpu-memory-utilization 0.3"
    return (f".venv/bin/vllm serve {target} --speculative-method dsbd --spec-model {draft} --spec-tokens {depth} "
            f"--speculative-config '{{\"width\": {width}}}' --dtype float32 --max-model-len 2048 "
            f"--served-model-name smollm2-dsbd{mem}")


def run(target: Path, prompts, params, speculative_config=None, verbose: bool = False, beam=None):
    """Sampling on one engine; then, with ``beam`` = (token prompts, BeamSearchParams), ``LLM.beam_search`` on it
    (a plain engine: vLLM's front-end loop; a DSBD engine: one engine request per prompt, beams in the engine)."""
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                   disable_log_stats=False, speculative_config=speculative_config, use_tqdm_on_load=verbose)
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = {k: metric(llm, k) or 0 for k in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                                               "vllm:spec_decode_num_draft_tokens", "vllm:dsbd_iterations",
                                               "vllm:dsbd_target_passes")}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    after = {k: (metric(llm, k) or 0) - before[k] for k in before}
    if beam is not None:
        ids, bp = beam
        llm.beam_search([{"prompt_token_ids": ids[0]}], type(bp)(beam_width=bp.beam_width, max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        beams = llm.beam_search([{"prompt_token_ids": p} for p in ids], bp)
        after["beams"] = ([[list(s.tokens[len(p):]) for s in o.sequences] for o, p in zip(beams, ids)],
                          time.perf_counter() - t0, llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    texts = [o.outputs[0].text for o in outs]
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return texts, n_tok, secs, after


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the untrained fallback draft")
    ap.add_argument("--beam-width", type=int, default=4,
                    help="LLM.beam_search width of the beam search part (0: skip it)")
    ap.add_argument("--cost-model", action="store_true",
                    help="run the DSBD engine with the cost model on (its default), not with the configured shape")
    ap.add_argument("--paths", action="store_true", help="print the model folders and a serve command, then exit")
    ap.add_argument("--verbose", action="store_true", help="show vLLM's log lines")
    args = ap.parse_args()
    if not args.verbose:  # before vLLM and torch are imported: their loggers read these once
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

    import torch
    import vllm
    from vllm_dsbd.testing import models

    torch.manual_seed(0)
    target = models.smollm2_dir()
    draft, draft_kind = draft_folder(target, args.draft_layers, Path(__file__).resolve().parents[2])
    if args.paths:
        # the engine's width serves the README's examples: use_beam_search up to n = the beam width (plain requests
        # may narrow it with dsbd_width)
        width = max(args.width, args.beam_width)
        print(f"target folder: {target}\ndraft folder:  {draft} ({draft_kind})\nserve it (width {width}):\n"
              f"  {serve_command(target, draft, width, args.depth)}")
        return
    tok = models.load_tokenizer(target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    params = [vllm.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
              for i in range(len(prompts))]
    print(f"target: SmolLM2-135M-Instruct ({target}); draft: {draft_kind}")
    beam = None
    W = args.beam_width
    if W:
        from vllm.sampling_params import BeamSearchParams

        beam = ([tok.encode(p, add_special_tokens=False) for p in prompts],
                BeamSearchParams(beam_width=W, max_tokens=args.max_tokens))
    plain = run(target, prompts, params, verbose=args.verbose, beam=beam)
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": args.depth,
            "width": max(args.width, W), **({} if args.cost_model else {"cost_model": None})}
    if W > args.width:  # the engine's width holds the beams; the sampling requests keep --width
        params = [p.clone() for p in params]
        for p in params:
            p.extra_args = {"dsbd_width": args.width}
    dsbd = run(target, prompts, params, spec, verbose=args.verbose, beam=beam)

    for p, a, b in zip(PROMPTS, plain[0], dsbd[0]):
        print(f"\n### {p}\n  plain: {a.strip()[:200]!r}\n  dsbd:  {b.strip()[:200]!r}")
    rows = []
    for name, (texts, n_tok, secs, m) in (("plain sampling", plain), (f"DSBD W={args.width} depth={args.depth}", dsbd)):
        drafts = m["vllm:spec_decode_num_drafts"]
        acc = m["vllm:spec_decode_num_accepted_tokens"]
        # target passes, counted by the DSBD engine (vllm:dsbd_target_passes: one per request per engine step that
        # emitted tokens for it); plain sampling makes one per token
        passes = m["vllm:dsbd_target_passes"] if drafts else n_tok
        nodes = f"{m['vllm:spec_decode_num_draft_tokens'] / drafts:.1f}" if drafts else "-"
        rows.append((name, n_tok, n_tok / secs, n_tok / passes, nodes, f"{acc / drafts:.2f}" if drafts else "-", secs))
    print(f"\n{'method':24s} {'tokens':>7s} {'tok/s':>7s} {'tok/target pass':>16s} {'draft nodes/forest':>19s} "
          f"{'accepted/forest':>16s} {'wall s':>7s}")
    for r in rows:
        print(f"{r[0]:24s} {r[1]:7d} {r[2]:7.1f} {r[3]:16.2f} {r[4]:>19s} {r[5]:>16s} {r[6]:7.1f}")
    print(f"\nmachine: {machine()}; temperature {args.temperature}; draft: {draft_kind}; DSBD mode 'sample' (each "
          f"verified depth checks up to {args.width} draft nodes and keeps one token: plain sampling's law)")
    speed, per_pass = rows[1][2] / rows[0][2], rows[1][3]
    print(f"DSBD made {per_pass:.2f} tokens per target pass against 1.00, and ran at {speed:.2f}x plain's tokens/s "
          "here: " + ("fewer target passes pay on this machine." if speed > 1 else
                      "fewer target passes do not pay yet, because drafting and verification run as many small "
                      "operations per step and the draft model is a large fraction of this small target "
                      "(docs/results.md has the numbers)."))
    if W:
        print_beams(tok, PROMPTS, plain[3]["beams"], dsbd[3]["beams"], W)


def print_beams(tok, texts, loop, engine, width: int) -> None:
    """The beam search part: the best beam of the first prompts from both engines, then whether all beams agree and
    the best-beam tokens per second of vLLM's loop and of the beams inside the DSBD engine."""
    (a, ta, cached), (b, tb, _) = loop, engine
    print(f"\n## Beam search, width {width}, temperature 0: `LLM.beam_search` on the plain engine (vLLM's front-end "
          "loop: one engine request per beam per token) and on the DSBD engine (one request per prompt, the beams in "
          "the engine, the draft's forest off them)")
    for p, x, y in list(zip(texts, a, b))[:3]:
        print(f"\n### {p}\n  vLLM loop best beam: {tok.decode(x[0]).strip()[:200]!r}\n"
              f"  DSBD best beam:      {tok.decode(y[0]).strip()[:200]!r}")
    same = sum(x == y for x, y in zip(a, b))
    na, nb = sum(len(x[0]) for x in a), sum(len(y[0]) for y in b)
    print(f"\nsame {width} beams (tokens, order) for {same} of {len(a)} prompts; best-beam tokens/s: vLLM loop "
          f"{na / ta:.1f}, DSBD engine {nb / tb:.1f} ({(nb / tb) / (na / ta):.1f}x; prefix caching "
          f"{'on' if cached else 'off'}, vLLM's default here; benchmarks/engine/beams.py has the longer runs)")


if __name__ == "__main__":
    main()
