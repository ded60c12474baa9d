"""Fused layer verification (Triton) vs the torch core (joint_logprobs + verify_layer), per DSBD iteration.

One DSBD iteration of depth G verifies G drafted layers; this times those G layers (one call per layer, each with
its own logits, drafts and draft joint) for batch R, width W (S = W parent slots, W drafts per layer, k = W outputs),
vocab V, with bf16 target logits. Every configuration first passes a correctness gate (kernel decisions == core
decisions on that very input); a red gate is reported and no speed-up is printed for it.

Metric: ms per iteration (triton.testing.do_bench, median and 20/80 quantiles) and the kernel's effective bandwidth,
    GB/s = G * R * W * V * (2 + 4) bytes / time,
i.e. one read of the bf16 logits and of the fp32 draft joint log Q per layer: a lower bound on the traffic (the kernel
makes several passes; see triton_kernels/verify/README.md).

    python benchmarks/kernels/verify.py                # GPU: full sweep, table + CSV under results/verify/
    python benchmarks/kernels/verify.py --quick        # GPU: a few configurations
    python benchmarks/kernels/verify.py --smoke        # CPU (Triton interpreter): the gate on tiny shapes
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch


def build_layer(R: int, W: int, V: int, *, top_k: int, top_p: float, seed: int, device, logits_dtype):
    """Inputs of one verification layer: target logits at W live beams, a draft joint correlated with the target,
    W drafts drawn from it without replacement (Gumbel-top-W), k = min(W, support of P) as verify_forest sets it."""
    from vllm_dsbd.core.joint import joint_logprobs
    from vllm_dsbd.core.params import BatchParams

    g = torch.Generator(device=device).manual_seed(seed)
    S = W
    logits = (torch.randn(R, S, V, generator=g, device=device) * 2.0).to(logits_dtype)
    scores = -torch.rand(R, S, generator=g, device=device) * 4.0 - 1.0
    live = torch.ones(R, S, dtype=torch.bool, device=device)
    temperature = torch.ones(R, device=device)
    top_k_t = torch.full((R,), top_k, dtype=torch.int64, device=device)
    top_p_t = torch.full((R,), top_p, dtype=torch.float32, device=device)
    seeds = torch.randint(0, 2**62, (R,), generator=g, device=device)
    position = torch.randint(0, 2**20, (R,), generator=g, device=device)
    draft_logits = logits.float() + 0.5 * torch.randn(R, S, V, generator=g, device=device)
    dparams = BatchParams.make(R, temperature=temperature, seed=seeds, device=device)
    logq, _ = joint_logprobs(draft_logits, scores, live, dparams)  # [R, S * V]
    u = torch.rand(R, S * V, generator=g, device=device).clamp(1e-12, 1 - 1e-7)
    draft_idx = torch.topk(logq - torch.log(-torch.log(u)), W, dim=-1).indices
    draft_valid = torch.ones(R, W, dtype=torch.bool, device=device)
    params = BatchParams.make(R, temperature=temperature, top_k=top_k_t, top_p=top_p_t, seed=seeds, device=device)
    logp, _ = joint_logprobs(logits, scores, live, params)
    k = torch.isfinite(logp).sum(1).clamp(max=W)
    return (logits, scores, live, temperature, top_k_t, top_p_t, seeds, position, draft_idx, draft_valid, logq, k)


def run_config(R, W, G, V, top_k, top_p, device, logits_dtype, timer, timed=True):
    from dsbd_kernels.verify import fused_verify_layer, verify_layer_ref

    layers = [build_layer(R, W, V, top_k=top_k, top_p=top_p, seed=1000 * G + d, device=device,
                          logits_dtype=logits_dtype) for d in range(G)]
    out_idx = torch.empty(R, W, dtype=torch.int64, device=device)
    out_valid = torch.empty(R, W, dtype=torch.bool, device=device)
    # correctness gate: the decisions of every layer equal the core's
    gate = True
    for args in layers:
        ri, rv = verify_layer_ref(*args, max_outputs=W)
        out_idx.fill_(-7)
        out_valid.fill_(True)
        fused_verify_layer(*args, max_outputs=W, out_idx=out_idx, out_valid=out_valid, use_kernel=True)
        gate &= bool(torch.equal(ri, out_idx) and torch.equal(rv, out_valid))

    def core():
        for args in layers:
            verify_layer_ref(*args, max_outputs=W)

    def kernel():
        for args in layers:
            fused_verify_layer(*args, max_outputs=W, out_idx=out_idx, out_valid=out_valid, use_kernel=True)

    t_core = timer(core)
    t_kernel = timer(kernel)
    nbytes = G * R * W * V * (layers[0][0].element_size() + 4)
    return dict(vocab=V, batch=R, width=W, depth=G, top_k=top_k, top_p=top_p, gate="ok" if gate else "RED",
                core_ms=t_core[0], core_ms_p20=t_core[1], core_ms_p80=t_core[2],
                kernel_ms=t_kernel[0], kernel_ms_p20=t_kernel[1], kernel_ms_p80=t_kernel[2],
                speedup=(t_core[0] / t_kernel[0]) if gate and timed else float("nan"),
                kernel_gbps=nbytes / (t_kernel[0] * 1e-3) / 1e9)


def print_table(rows):
    head = ("vocab", "batch", "W", "depth", "top_k", "top_p", "gate", "core ms", "kernel ms", "speedup", "GB/s")
    print(" ".join(f"{h:>9}" for h in head))
    for r in rows:
        sp = "(red)" if r["gate"] != "ok" else "n/a" if r["speedup"] != r["speedup"] else f"{r['speedup']:.2f}x"
        print(" ".join(f"{v:>9}" for v in (r["vocab"], r["batch"], r["width"], r["depth"], r["top_k"], r["top_p"],
                                           r["gate"], f"{r['core_ms']:.3f}", f"{r['kernel_ms']:.3f}", sp,
                                           f"{r['kernel_gbps']:.1f}")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: the gate only")
    ap.add_argument("--quick", action="store_true", help="a few GPU configurations")
    ap.add_argument("--out", default="results/verify", help="folder for the CSV")
    args = ap.parse_args()

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before dsbd_kernels is imported
        device = torch.device("cpu")
        logits_dtype = torch.float16  # the interpreter has bf16 loads, but keep the smoke quick and portable
        vocabs, batches, widths, depths = (50, 129), (1, 3), (2, 4), (2,)
        samplings = ((0, 1.0), (3, 0.9))

        def timer(fn):  # wall clock: interpreter timings mean nothing, the gate is the point
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            return ms, ms, ms
    else:
        if not torch.cuda.is_available():
            print("kernels/verify.py: no CUDA device; this benchmark times GPU kernels. "
                  "Run `--smoke` for the interpreter correctness gate on CPU.", file=sys.stderr)
            return 2
        import triton.testing

        device = torch.device("cuda")
        logits_dtype = torch.bfloat16
        vocabs, batches, widths, depths = (32000, 128256), (1, 4, 16, 64), (2, 4, 8), (2, 3, 4)
        samplings = ((0, 1.0), (50, 0.9))  # plain sampling; top-k 50 then top-p 0.9 (both over the joint)
        if args.quick:
            vocabs, batches, widths, depths, samplings = (32000,), (1, 64), (4,), (3,), ((0, 1.0),)

        def timer(fn):
            return tuple(triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8]))

    rows = []
    for V in vocabs:
        for R in batches:
            for W in widths:
                for G in depths:
                    for top_k, top_p in samplings:
                        rows.append(run_config(R, W, G, V, top_k, top_p, device, logits_dtype, timer,
                                               timed=not args.smoke))
                        r = rows[-1]
                        print(f"V={V} R={R} W={W} G={G} top_p={top_p}: gate {r['gate']}, core {r['core_ms']:.3f} ms, "
                              f"kernel {r['kernel_ms']:.3f} ms", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_verify_smoke.csv" if args.smoke else "bench_verify.csv"
    with open(out / name, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    note = ", interpreter: gate only, timings meaningless" if args.smoke else ""
    print(f"\nfused verification vs core ({device.type}{note}); CSV: {out / name}")
    print_table(rows)
    red = sum(r["gate"] != "ok" for r in rows)
    if red:
        print(f"{red} configuration(s) failed the correctness gate: no speed-up is claimed for them")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
