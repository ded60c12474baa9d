"""vLLM's throughput benchmark with beam search, on a plain engine and on a DSBD engine side by side, in one run.

vLLM 0.26's ``vllm bench throughput`` has a beam-search path (``LLM.beam_search`` with ``BeamSearchParams(beam_width=n,
max_tokens=output_len, ignore_eos=True)``, timed around that one call) but hard-codes it off
(``use_beam_search = False`` in ``vllm/benchmarks/throughput.py``, ``_run_vllm_requests``), so the standard benchmark
cannot show beam search on a DSBD engine. This script takes ``vllm bench throughput``'s own arguments and dataset
sampling (``vllm.benchmarks.throughput.add_cli_args``, ``validate_args``, ``get_requests``: ``--dataset-name random
/ sharegpt / ...``, ``--num-prompts``, ``--n`` as the beam width, every engine argument) and runs that beam-search path,
with vLLM's counting (requests/s; total and output tokens/s with ``prompt_len + expected_output_len`` per request, as
vLLM's ``main`` counts when the beam path returns no outputs), on two engines, one after the other:

* ``plain vLLM``: the engine arguments without the speculative method (vLLM's front-end beam loop);
* ``DSBD``: the engine arguments as given (``--speculative-method dsbd ...``: the beams inside the engine).

It prints vLLM's throughput line for each, the DSBD / plain ratios, whether each prompt's best beam is the same on
both (the correctness gate: with float32 weights DSBD's T = 0 beams are vLLM's), and the DSBD engine's target passes
per beam step (``vllm:dsbd_beam_target_passes / vllm:dsbd_beam_steps``); ``--output-json`` writes the rows.

    python benchmarks/engine/throughput_beams.py --model TARGET --speculative-method dsbd --spec-model DRAFT \\
        --spec-tokens 3 --speculative-config '{"width": 4}' --n 4 --dataset-name random --random-input-len 32 \\
        --random-output-len 32 --num-prompts 8 --dtype float32 --max-model-len 1024 [--gpu-memory-utilization 0.3]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time


def _beam_run(llm, requests, n: int):
    """vLLM's disabled beam path of ``_run_vllm_requests``, verbatim in what it sends and times; returns (seconds,
    each prompt's best beam: (prompt and generated tokens, cumulative log-probability))."""
    from vllm.inputs import TextPrompt, TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    prompts = []
    for r in requests:
        if isinstance(r.prompt, str):
            prompts.append(TextPrompt(prompt=r.prompt))
        elif isinstance(r.prompt, dict) and "prompt_token_ids" in r.prompt:
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt["prompt_token_ids"])))
        else:
            prompts.append(TextPrompt(prompt=str(r.prompt)))
    output_len = requests[0].expected_output_len
    if any(r.expected_output_len != output_len for r in requests):
        raise ValueError("beam search (vLLM's beam path): every request needs the same output length "
                         "(e.g. --random-range-ratio 0)")
    start = time.perf_counter()
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=n, max_tokens=output_len, ignore_eos=True))
    elapsed = time.perf_counter() - start
    return elapsed, [(list(o.sequences[0].tokens), o.sequences[0].cum_logprob) for o in outs]


def _counter(llm, name: str) -> float:
    return sum(float(getattr(m, "value", 0.0) or 0.0) for m in llm.get_metrics() if m.name == name)


def _engine_run(name: str, engine_args, requests, warmups, n: int) -> dict:
    from vllm import LLM

    from vllm_dsbd.testing.engines import shutdown

    llm = LLM.from_engine_args(engine_args)
    try:
        if warmups:
            _beam_run(llm, warmups, n)
        c0 = {c: _counter(llm, c) for c in ("vllm:dsbd_beam_target_passes", "vllm:dsbd_beam_steps")}
        elapsed, best = _beam_run(llm, requests, n)
        passes, steps = (_counter(llm, c) - c0[c] for c in c0)
    finally:
        shutdown(llm)
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.expected_output_len for r in requests)
    row = {"engine": name, "elapsed_s": elapsed, "num_requests": len(requests),
           "requests_per_s": len(requests) / elapsed, "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
           "output_tokens_per_s": output_tokens / elapsed, "best_beams": best}
    if steps:
        row["target_passes_per_beam_step"] = passes / steps
    print(f"{name}: Throughput: {row['requests_per_s']:.2f} requests/s, {row['total_tokens_per_s']:.2f} total "
          f"tokens/s, {row['output_tokens_per_s']:.2f} output tokens/s ({elapsed:.1f} s)", flush=True)
    return row


def main(argv=None) -> int:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # DSBD's `--speculative-method` spelling and its config handling
    from vllm.benchmarks.throughput import add_cli_args, get_requests, validate_args
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dsbd.config import ADDITIONAL_CONFIG_KEY, METHOD
    from vllm_dsbd.patches.dsbd_knobs import requested_method

    parser = FlexibleArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    validate_args(args)
    if args.backend != "vllm" or args.async_engine or args.enable_lora:
        parser.error("beam search runs on --backend vllm, without --async-engine and LoRA (as vLLM's beam path)")
    dsbd_args = EngineArgs.from_cli_args(args)
    if requested_method(dsbd_args) != METHOD:
        parser.error("give the DSBD engine's arguments: --speculative-method dsbd [--spec-model DRAFT --spec-tokens G] "
                     "--speculative-config '{\"width\": W}' with W >= --n")
    additional = {k: v for k, v in (dsbd_args.additional_config or {}).items() if k != ADDITIONAL_CONFIG_KEY}
    plain_args = dataclasses.replace(dsbd_args, speculative_config=None, spec_method=None, spec_model=None,
                                     spec_tokens=None, additional_config=additional)

    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    requests = get_requests(args, tokenizer)
    warmups = None
    if args.num_warmups > 0:
        warm = argparse.Namespace(**vars(args))
        warm.num_prompts, warm.seed = args.num_warmups, args.seed + 1
        warmups = get_requests(warm, tokenizer)

    rows = [_engine_run("plain vLLM (front-end beam loop)", plain_args, requests, warmups, args.n),
            _engine_run("DSBD (beams in the engine)", dsbd_args, requests, warmups, args.n)]
    plain, dsbd = rows
    pairs = list(zip(plain["best_beams"], dsbd["best_beams"]))
    same = sum(a[0] == b[0] for a, b in pairs)
    for k, (a, b) in enumerate(pairs):
        if a[0] != b[0]:  # a near tie between two beams computed in differently shaped batches, or a bug: look
            print(f"prompt {k}: best beams differ; cumulative log-probability plain {a[1]:.6f}, DSBD {b[1]:.6f}")
    print(f"beam width {args.n}, {len(requests)} requests, {requests[0].expected_output_len} output tokens each; "
          f"DSBD / plain: {dsbd['requests_per_s'] / plain['requests_per_s']:.2f}x requests/s, "
          f"{dsbd['output_tokens_per_s'] / plain['output_tokens_per_s']:.2f}x output tokens/s; same best beam for "
          f"{same} of {len(requests)} prompts"
          + (f"; DSBD target passes per beam step {dsbd['target_passes_per_beam_step']:.3f}"
             if "target_passes_per_beam_step" in dsbd else ""), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))},
                       "rows": rows, "same_best_beam": same}, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core on CPU: the guard is needed
    raise SystemExit(main())
