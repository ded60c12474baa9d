"""Where the time of one engine step goes, and how many times a step waits for the GPU (GPU; ``--tiny``: the same
flow on CPU as a smoke test, without the synchronisation count).

The models of ``large_model.py`` (random-weight Llama-3.1-8B-shaped target, Llama-3.2-1B-shaped draft, bf16, CUDA
graphs as vLLM and the plugin set them unless ``--eager``), B requests decoding together (``--batches``), DSBD at a
set acceptance rate (``vllm_dsbd.testing.set_acceptance``; its rows pin depth ``--depth`` with the cost model set
aside, and one row runs the engine as a user does, cost model on; every row records the depths drafted) and vLLM's draft_model at the same rate (its synthetic
rejection sampler) for comparison, plus plain vLLM. Engine ``dsbd`` has width ``max(--widths)`` (its width-1 rows
are width-1 requests in that engine: the general verification path); engine ``dsbd_chain`` is a width-1 engine with
``full_cuda_graphs`` (chain drafting with one host copy, the static chain verification, full graphs over its decode
passes). An engine that fails is reported and the others still run. For each engine and batch size, after the
prefill and two warm-up steps, three runs of ``--steps`` engine steps each:

1. **step time**: ``LLMEngine.step`` wall time, nothing added (median);
2. **breakdown**: the runner's phases timed with ``torch.cuda.synchronize()`` around each (median per step):
   target forward (``_model_forward``), sampling (``_sample``: vLLM's sampler or rejection sampler; DSBD's
   verification), drafting (``propose_draft_token_ids``) split into draft forward (the draft model's forward) and
   the drafting's own work, and the rest of the step (scheduler, input preparation, output processing);
3. **host synchronisations**: ``torch.cuda.set_sync_debug_mode("warn")`` warns at every operation that waits for the
   GPU; counted per step, with the source lines that cause most of them.

Results: a table on stdout and in ``--out``/README.md, the rows in ``--out``/step_profile.json.

    python benchmarks/gpu/step_profile.py --out results/gpu/step_profile        (GPU)
    python benchmarks/gpu/step_profile.py --tiny --out /tmp/sp                  (CPU smoke)
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import large_model as lm  # beside this script (run by path: its folder is importable)
from vllm_dsbd.testing import set_acceptance

PHASES = ("target forward", "sampling / verification", "draft forward", "drafting work", "rest")


class Phases:
    """Wraps the runner's methods (instance attributes) to time them, synchronising the GPU around each when on."""

    def __init__(self, runner, cuda: bool):
        import torch

        self.on, self.acc = False, collections.Counter()
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self._wrap(runner, "_model_forward", "target forward")
        self._wrap(runner, "_sample", "sampling / verification")
        self._wrap(runner, "propose_draft_token_ids", "drafting")
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            start: list[float] = []

            def pre(*_):  # hooks return None: a value would replace the module's inputs / output
                if self.on:
                    self._sync()
                    start.append(time.perf_counter())

            def post(*_):
                if self.on and start:
                    self._sync()
                    self.acc["draft forward"] += time.perf_counter() - start.pop()
            model.register_forward_pre_hook(pre)
            model.register_forward_hook(post)

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._sync()
                self.acc[label] += time.perf_counter() - t0
        setattr(obj, name, timed)

    def step(self, engine) -> dict:
        self.acc.clear()
        self.on = True
        self._sync()
        t0 = time.perf_counter()
        try:
            engine.step()
            self._sync()
        finally:
            self.on = False
        total = time.perf_counter() - t0
        a = self.acc
        out = {"target forward": a["target forward"], "sampling / verification": a["sampling / verification"],
               "draft forward": a["draft forward"], "drafting work": a["drafting"] - a["draft forward"]}
        out["rest"] = total - sum(out.values())
        out["total"] = total
        return out


def count_syncs(engine, steps: int) -> tuple[list[int], collections.Counter]:
    """Host synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``) and their source lines."""
    import torch

    per_step, sites = [], collections.Counter()
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        mine = [w for w in caught if "synchroniz" in str(w.message)]
        per_step.append(len(mine))
        sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in mine)
    return per_step, sites


def measure(args, name: str, llm, batch: int, extra_args: dict | None) -> dict:
    import torch
    import vllm

    cuda = torch.cuda.is_available()
    engine = llm.llm_engine
    runner = lm.runner_of(llm)
    phases = getattr(runner, "_dsbd_step_phases", None) or Phases(runner, cuda)
    runner._dsbd_step_phases = phases
    need = 3 + 3 * args.steps + 8
    per_token = 1 if name == "plain vLLM" else 1 + args.depth  # speculative rows emit up to 1 + depth a step
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=need * per_token, ignore_eos=True, detokenize=False,
                             extra_args=extra_args)
    for i in range(batch):
        engine.add_request(f"{name}-{batch}-{i}", {"prompt_token_ids": [(7 * i + j) % 500 + 3
                                                                        for j in range(args.prompt_len)]}, sp)
    for _ in range(3):  # prefill, two warm-up decode steps
        engine.step()
    chosen0 = lm.chosen_depths(llm)
    plain = []
    for _ in range(args.steps):
        torch.cuda.synchronize() if cuda else None
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize() if cuda else None
        plain.append(time.perf_counter() - t0)
    split = [phases.step(engine) for _ in range(args.steps)]
    syncs, sites = count_syncs(engine, args.steps) if cuda else ([], collections.Counter())
    depths = {} if chosen0 is None else lm.chosen_since(chosen0, lm.chosen_depths(llm))["depths"]
    engine.abort_request([f"{name}-{batch}-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    row = {"engine": name, "batch": batch, "step_ms": 1e3 * statistics.median(plain),
           **{p: 1e3 * statistics.median(s[p] for s in split) for p in PHASES},
           "synced_step_ms": 1e3 * statistics.median(s["total"] for s in split),
           "syncs_per_step": statistics.median(syncs) if syncs else None,
           "sync_sites": sites.most_common(8), "depths": depths}
    print("row:", row, flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--engines", default="plain,draft_model,dsbd,dsbd_chain")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--widths", default="1,4", help="DSBD widths (per request)")
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--work", default="/tmp/dsbd-large-model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    widths = [int(w) for w in args.widths.split(",") if w]

    import torch
    import vllm

    if args.tiny:
        torch.set_num_threads(1)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else each CPU engine asks for most of the memory
    dtype = "float32" if args.tiny else "bfloat16"
    target, draft, _ = lm.model_folders(Path(args.work), args.tiny)
    kw = dict(dtype=dtype, enforce_eager=args.eager or args.tiny, load_format="dummy", seed=0,
              max_model_len=args.prompt_len + 3 * (3 + 3 * args.steps + 8) * (args.depth + 1) + 64,
              enable_prefix_caching=False, max_num_seqs=max(batches),
              **({} if args.tiny else {"gpu_memory_utilization": 0.45}))
    rows = []
    for name in [e for e in args.engines.split(",") if e]:
        spec, runs = None, [("plain vLLM", None)]
        if name == "draft_model":
            # vLLM's CPU sampler has no synthetic mode: real rejection sampling with --tiny
            spec = lm.draft_model_spec(draft, args.depth, None if args.tiny else args.rate)
            runs = [(f"vLLM draft_model d={args.depth}", None)]
        elif name == "dsbd":
            spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": args.depth,
                    "width": max(widths), "dynamic_width": False}
            # depth pinned (the cost model set aside: large_model.cost_model_off), then the engine as a user runs it
            runs = [(f"DSBD W={w} d={args.depth} pinned", {"dsbd_width": w}) for w in widths]
            runs.append((f"DSBD W={max(widths)}, cost model", {"dsbd_width": max(widths)}))
        elif name == "dsbd_chain":
            spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": args.depth, "width": 1,
                    "full_cuda_graphs": True}
            runs = [(f"DSBD W=1 engine d={args.depth}, full graphs", None)]
        try:
            llm = vllm.LLM(model=str(target), speculative_config=spec, **kw)
        except Exception as e:  # noqa: BLE001  (one engine's failure is a finding; the others still run)
            print(f"engine {name} failed to start: {type(e).__name__}: {e}", flush=True)
            continue
        if name.startswith("dsbd"):
            set_acceptance.install(args.rate)
        try:
            for label, extra in runs:
                pin = name == "dsbd" and "pinned" in label
                with lm.cost_model_off(llm) if pin else contextlib.nullcontext():
                    for b in batches:
                        rows.append(measure(args, label, llm, b, extra))
        except Exception as e:  # noqa: BLE001
            print(f"engine {name} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            set_acceptance.uninstall()
            lm.shutdown(llm)
            del llm  # the engine's memory is freed before the next engine starts
            gc.collect()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"{device}; {'tiny' if args.tiny else 'Llama-3.1-8B / 3.2-1B shapes'}, random weights, {dtype}, "
             f"{'eager' if kw['enforce_eager'] else 'CUDA graphs on'}; speculation at a set acceptance rate "
             f"{args.rate}; medians over {args.steps} steps; phase times with the GPU synchronised around each", "",
             "| engine | batch | step ms | " + " | ".join(PHASES) + " | syncs / step | depths drafted |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
    for r in rows:
        s = "-" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:g}"
        lines.append(f"| {r['engine']} | {r['batch']} | {r['step_ms']:.2f} | "
                     + " | ".join(f"{r[p]:.2f}" for p in PHASES) + f" | {s} | "
                     + (" ".join(f"{k}:{v}" for k, v in sorted(r["depths"].items())) or "-") + " |")
    lines += ["", "Most frequent synchronising lines per row:"]
    lines += [f"- {r['engine']}, batch {r['batch']}: " + ", ".join(f"{k} x{v}" for k, v in r["sync_sites"])
              for r in rows if r["sync_sites"]]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_profile.json").write_text(json.dumps(dict(device=device, args=vars(args), rows=rows), indent=1))
        (out / "README.md").write_text(f"# step_profile.py\n\n`{' '.join(sys.argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
