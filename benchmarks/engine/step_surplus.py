"""What an engine step that drafts nothing costs beyond a plain vLLM decode step, and where it goes (CPU).

    python benchmarks/engine/step_surplus.py [--batches 1 8] [--max-tokens 48] [--profile] [--out DIR]

Why: on an H100 (batch 1, 8B-shaped target) a DSBD step that drafts nothing took 19.3 ms against plain vLLM's 6.8 ms
for the same forward; the engine's host work and host-device waits are the suspects, and they show on CPU too. Here
a random-weight Llama (``load_format="dummy"``, config and a word-level tokenizer only: vocab 32k, hidden 256,
2 layers; draft: 1 layer) decodes greedily, B requests at once, in four engines one after the other in this process:

* ``plain``: vLLM without speculation;
* ``dsbd``: ``{"method": "dsbd", "model": DRAFT}``, DSBD's defaults (cost model on: with random weights nothing is
  accepted, and it mostly drafts depth 0; the depths it chose are printed);
* ``dsbd free``: ``{"method": "dsbd"}``, the draft-free sources (recycle, lookup);
* ``dsbd none``: ``{"method": "dsbd", "sources": []}``, nothing drafted, ever.

Each row: the median ``LLMEngine.step`` wall time over the decode steps (the prefill and the last step left out;
``--repeats`` rounds of requests, the first a warm-up) and its ratio to plain vLLM's at the same batch, the same for
the step's CPU time (``time.thread_time``: the engine runs in this thread, torch on one thread; on a shared machine
it moves less than the wall time), the median target forward time (a forward hook), and the median time of the
runner's ``_sample`` (DSBD: verification) and ``propose_draft_token_ids`` calls (the last three quarters of them). ``--profile``: one more round per DSBD row under cProfile,
printing the functions of vllm_dsbd with the most cumulative and self time, in ms per step.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False)
ENGINES = {"plain": None, "dsbd": {"method": "dsbd", "model": "DRAFT"}, "dsbd free": {"method": "dsbd"},
           "dsbd none": {"method": "dsbd", "sources": []}}


def _rounds(llm, batch: int, max_tokens: int, repeats: int, fwd: list[float], profile: cProfile.Profile | None):
    import vllm

    engine = llm.llm_engine
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps = []
    for r in range(repeats):
        for i in range(batch):
            engine.add_request(f"r{r}-{i}", {"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(8)]}, sp)
        body = []
        while engine.has_unfinished_requests():
            if profile is not None:
                profile.enable()
            t0, c0, f0 = time.perf_counter(), time.thread_time(), fwd[0]
            engine.step()
            body.append((time.perf_counter() - t0, fwd[0] - f0, time.thread_time() - c0))
            if profile is not None:
                profile.disable()
        if r > 0 or repeats == 1:
            steps += body[1:-1]
    return steps


def measure(target, draft, name: str, batch: int, args) -> dict:
    import vllm

    spec = ENGINES[name] and {k: (str(draft) if v == "DRAFT" else v) for k, v in ENGINES[name].items()}
    llm = vllm.LLM(model=str(target), load_format="dummy", dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=256, max_num_seqs=max(batch, 8), enable_prefix_caching=False,
                   speculative_config=spec)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        fwd, start = [0.0], []
        runner.model.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))
        runner.model.register_forward_hook(lambda *_: fwd.__setitem__(0, fwd[0] + time.perf_counter() - start.pop()))
        # the runner's sampling (DSBD: verification) and drafting, timed per call (wrapped on the instance)
        phases = {name: _timed(runner, name) for name in ("_sample", "propose_draft_token_ids")}
        steps = _rounds(llm, batch, args.max_tokens, args.repeats, fwd, None)
        row = {"engine": name, "batch": batch, "steps": len(steps),
               "step_ms": 1e3 * statistics.median(s for s, _, _ in steps),
               "cpu_ms": 1e3 * statistics.median(c for _, _, c in steps),
               "target_fwd_ms": 1e3 * statistics.median(f for _, f, _ in steps),
               **{f"{k.strip('_')}_ms": 1e3 * statistics.median(v[len(v) // 4:] or [0.0]) for k, v in phases.items()}}
        stats = getattr(runner, "dsbd_stats", None)
        if stats is not None:
            row["depths"] = dict(stats.draft_depths)
        if args.profile and spec is not None:
            prof = cProfile.Profile()
            n = len(_rounds(llm, batch, args.max_tokens, 1, fwd, prof))
            row["profile"] = _top(prof, n + 2, args.top)
        return row
    finally:
        from vllm_dsbd.testing.engines import shutdown

        shutdown(llm)


def _timed(obj, name: str) -> list[float]:
    """Wraps ``obj.name`` (an instance attribute over the method) to append each call's seconds to the list."""
    acc, fn = [], getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return acc


def _top(prof: cProfile.Profile, steps: int, top: int) -> dict:
    """The vllm_dsbd functions with the most cumulative / self time, ms per step (every step of the round)."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, calls, tt, ct, _) in st.stats.items():
        if "vllm_dsbd" in file:
            rel = file[file.rindex("vllm_dsbd"):]
            rows.append((f"{rel}:{line}({func})", calls / steps, 1e3 * tt / steps, 1e3 * ct / steps))
    total = sum(v[2] for v in st.stats.values()) * 1e3 / steps
    return {"total_ms_per_step": total,
            "cumulative": sorted(rows, key=lambda r: -r[3])[:top], "self": sorted(rows, key=lambda r: -r[2])[:top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of requests per row, the first a warm-up")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="folder for results.json (default: none written)")
    args = ap.parse_args(argv)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_LOGGING_LEVEL", "ERROR")):
        os.environ.setdefault(key, value)
    import torch

    from vllm_dsbd.testing.models import dummy_llama_folder

    torch.set_num_threads(1)
    work = pathlib.Path(tempfile.mkdtemp(prefix="step_surplus-"))
    target = dummy_llama_folder(work / "target", SHAPE, "float32")
    draft = dummy_llama_folder(work / "draft", dict(SHAPE, num_hidden_layers=1), "float32")
    rows = [measure(target, draft, name, b, args) for b in args.batches for name in args.engines]
    plain = {r["batch"]: r["step_ms"] for r in rows if r["engine"] == "plain"}
    cpu = {r["batch"]: r["cpu_ms"] for r in rows if r["engine"] == "plain"}
    print("| engine | batch | steps | step ms | / plain | step CPU ms | / plain | target fwd ms | _sample ms | "
          "propose ms | depths chosen (depth: req x steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["batch"]
        ratio = f"{r['step_ms'] / plain[b]:.2f}" if b in plain else "-"
        cratio = f"{r['cpu_ms'] / cpu[b]:.2f}" if b in cpu else "-"
        print(f"| {r['engine']} | {b} | {r['steps']} | {r['step_ms']:.2f} | {ratio} | {r['cpu_ms']:.2f} | {cratio} | "
              f"{r['target_fwd_ms']:.2f} | {r['sample_ms']:.2f} | {r['propose_draft_token_ids_ms']:.2f} | "
              f"{r.get('depths', '-')} |")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"\n{r['engine']}, batch {r['batch']}: cProfile, all functions {p['total_ms_per_step']:.2f} ms "
                  "self time per step; vllm_dsbd functions, ms per step (calls per step)")
            for kind, col in (("cumulative", 3), ("self", 2)):
                print(f"  by {kind} time:")
                for f in p[kind]:
                    print(f"    {f[col]:7.3f} ms  ({f[1]:6.1f})  {f[0]}")
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
