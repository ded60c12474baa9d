"""Kernel benchmark: forest attention vs vLLM's Triton unified attention, and the KV commit; gated on correctness.

    python benchmarks/kernels/attention_kv.py [--dtype bf16] [--quick] [--csv results/bench_kernels.csv]  # CUDA GPU
    python benchmarks/kernels/attention_kv.py --smoke  # CPU: Triton interpreter, tiny shapes, correctness gates only

Attention rows (default shapes: one Llama-3.1-8B layer, 32 heads, 8 kv heads, head_dim 128, block 16):
  verify  target verification: the queries are all W * depth forest nodes of each request (ancestor masks)
  draft   one draft beam step: the queries are the newest W nodes, masks over the forest so far
  decode  plain decode: one node per request
Baseline: vLLM 0.26 ``unified_attention`` given the same query tokens per request and the same KV (seq_len = ctx + n,
causal, the queries being the last positions), as vLLM's Triton backend calls it; for decode also its split-KV (3D)
path, which the backend picks for small batches. It reads the same KV bytes as our kernel.
Bandwidth (GB/s = bytes / median time), explicit:
  attention  bytes = elem * (2 * num_kv_heads * head_dim * sum_r (ctx_r + n_r)  [K and V]
                             + 2 * num_q_tokens * num_heads * head_dim)          [q read, out written]
  kv commit  bytes = 2 * M * planes * slot_bytes  (read + write), slot_bytes = kv_heads * 2 * head_dim * elem
Gates (a red gate prints FAIL, no speedup, and a non-zero exit): forest_attention against forest_attention_ref on
every row; on a chain forest (where forest attention is causal attention) against vLLM's kernel; copy_kv_slots
bitwise against copy_kv_slots_ref. Timing: triton.testing.do_bench, median and 20/80% quantiles.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, gates only (no timing)")
    ap.add_argument("--quick", action="store_true", help="fewer GPU rows")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--csv", type=Path, default=None,
                    help="CSV path (default results/bench_kernels.csv; smoke: results/tmp/bench_kernels_smoke.csv)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before dsbd_kernels is imported
import torch  # noqa: E402

if not ARGS.smoke and not torch.cuda.is_available():
    print("kernels/attention_kv.py: needs a CUDA GPU (no GPU here); run with --smoke for the CPU correctness gates",
          file=sys.stderr)
    sys.exit(2)

import triton  # noqa: E402

from dsbd_kernels.forest_attention import (  # noqa: E402
    ForestAttentionInputs,
    beam_forest_parents,
    forest_attention,
    forest_attention_ref,
)
from dsbd_kernels.kv_commit import KVCacheTable, copy_kv_slots, copy_kv_slots_ref  # noqa: E402

warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0")  # Triton's interpreter, numpy
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # as tests/helpers/kernel_utils.TOLERANCES


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class AttnRow:
    mode: str  # verify | draft | decode
    batch: int
    ctx: int
    width: int
    depth: int


def attn_rows(smoke: bool, quick: bool) -> list[AttnRow]:
    if smoke:
        return [AttnRow("verify", 2, 33, 2, 2), AttnRow("draft", 2, 7, 2, 3), AttnRow("decode", 3, 20, 1, 1)]
    batches = [1, 32] if quick else [1, 8, 32, 64]
    ctxs = [2048] if quick else [512, 2048, 8192]
    rows = []
    for b in batches:
        for c in ctxs:
            rows += [AttnRow("verify", b, c, 4, 4), AttnRow("draft", b, c, 4, 4), AttnRow("decode", b, c, 1, 1)]
    return rows


def build(row: AttnRow, shape: Shape, chain: bool = False, seed: int = 0) -> ForestAttentionInputs:
    """The row's forests (DSBD layout, or one chain of the same size), queries as the mode says."""
    n = row.width * row.depth
    parents = [list(range(-1, n - 1)) if chain else beam_forest_parents(row.width, row.depth)] * row.batch
    if row.mode == "draft":
        queries = [list(range(n - row.width, n))] * row.batch
    elif row.mode == "decode":
        queries = [[0]] * row.batch
    else:
        queries = None
    return ForestAttentionInputs.make_dummy(
        [row.ctx] * row.batch, parents, num_kv_heads=shape.num_kv_heads,
        queries_per_kv=shape.num_heads // shape.num_kv_heads, head_dim=shape.head_dim, dtype=shape.dtype,
        device=DEVICE, block_size=shape.block_size, query_nodes=queries, seed=seed)


def attn_bytes(inp: ForestAttentionInputs) -> int:
    t, h, d = inp.q.shape
    kvh, elem = inp.key_cache.shape[2], inp.q.element_size()
    kv_positions = int((inp.context_lens.long() + inp.forest_lens.long()).sum())
    return elem * (2 * kvh * d * kv_positions + 2 * t * h * d)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[bool, float]:
    err = (a.float() - b.float()).abs()
    ok = bool(torch.isfinite(a).all()) and bool((err <= tol + tol * b.float().abs()).all())
    return ok, float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0


def vllm_unified_attention():
    """vLLM's kernel, or the reason it is not available (never imported by the kernels themselves)."""
    if DEVICE.type != "cuda":
        return None, "vLLM's Triton kernels need CUDA"
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:  # noqa: BLE001  (an absent or broken vLLM is a reported fact, not a crash)
        return None, f"vllm import failed: {type(e).__name__}: {e}"
    return unified_attention, ""


def vllm_call(fn, inp: ForestAttentionInputs, use_3d: bool):
    """A closure running vLLM's unified attention on the same queries and KV as ``inp`` (causal layout)."""
    q_lens = inp.cu_seqlens_q[1:] - inp.cu_seqlens_q[:-1]
    seq_lens = (inp.context_lens + inp.forest_lens).to(torch.int32)
    num_reqs, (_, h, d) = seq_lens.numel(), inp.q.shape
    kvh = inp.key_cache.shape[2]
    out = torch.empty_like(inp.q)
    kw = {}
    if use_3d:
        segs, dpad = 16, triton.next_power_of_2(d)
        kw = dict(seq_threshold_3D=num_reqs, num_par_softmax_segments=segs,
                  softmax_segm_output=torch.empty(num_reqs, h, segs, dpad, dtype=torch.float32, device=DEVICE),
                  softmax_segm_max=torch.empty(num_reqs, h, segs, dtype=torch.float32, device=DEVICE),
                  softmax_segm_expsum=torch.empty(num_reqs, h, segs, dtype=torch.float32, device=DEVICE))
    ones = torch.ones(num_reqs, kvh, dtype=torch.float32, device=DEVICE)
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())

    def run():
        fn(q=inp.q, k=inp.key_cache, v=inp.value_cache, out=out, cu_seqlens_q=inp.cu_seqlens_q,
           max_seqlen_q=max_q, seqused_k=seq_lens, max_seqlen_k=max_k, softmax_scale=inp.softmax_scale,
           causal=True, window_size=(-1, -1), block_table=inp.block_table, softcap=0, q_descale=None,
           k_descale=ones, v_descale=ones, **kw)
        return out

    return run


def bench(fn) -> tuple[float, float, float] | None:
    if DEVICE.type != "cuda":
        return None
    med, lo, hi = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    return med, lo, hi


def attention_rows(shape: Shape, smoke: bool, quick: bool) -> tuple[list[dict], bool]:
    vfn, why = vllm_unified_attention()
    results, all_ok = [], True
    tol = TOL[shape.dtype]
    for row in attn_rows(smoke, quick):
        inp = build(row, shape)
        out = torch.full_like(inp.q, float("nan"))
        ours = functools.partial(forest_attention, *inp.args(), out)
        ok, err = close(ours(), forest_attention_ref(*inp.args()), tol)
        note = "" if vfn else why
        if vfn is not None and row.mode != "decode":  # chain forest = causal attention: vLLM must agree
            chain = build(row, shape, chain=True, seed=1)
            chain_out = forest_attention(*chain.args(), torch.empty_like(chain.q))
            ok_v, err_v = close(chain_out, vllm_call(vfn, chain, use_3d=False)(), tol)
            ok, err = ok and ok_v, max(err, err_v)
        all_ok &= ok
        nbytes = attn_bytes(inp)
        t_ours = bench(ours) if ok else None
        base = {}
        if vfn is not None and ok:
            base["vllm 2D"] = bench(vllm_call(vfn, inp, use_3d=False))
            if row.mode == "decode":
                base["vllm 3D"] = bench(vllm_call(vfn, inp, use_3d=True))
        best_name, best = min(((k, v) for k, v in base.items() if v), key=lambda kv: kv[1][0], default=(None, None))
        results.append(dict(
            kernel="forest_attention", mode=row.mode, batch=row.batch, ctx=row.ctx, width=row.width,
            depth=row.depth, q_tokens=inp.q.shape[0], gate="ok" if ok else "FAIL", max_err=f"{err:.2e}",
            ours_us=_us(t_ours), ours_us_p20=_us(t_ours, 1), ours_us_p80=_us(t_ours, 2),
            ours_GBps=_gbps(nbytes, t_ours),
            baseline=best_name or "", baseline_us=_us(best), baseline_GBps=_gbps(nbytes, best),
            speedup=f"{best[0] / t_ours[0]:.2f}" if (ok and best and t_ours) else "",
            note=note if ok else "gate failed: no timing"))
    return results, all_ok


def commit_rows(shape: Shape, smoke: bool, quick: bool) -> tuple[list[dict], bool]:
    """Compaction of accepted paths across every layer: vLLM 0.26 planes [blocks, block_size, kv_heads, 2 * d]."""
    layers = 2 if smoke else 32
    batches = [3] if smoke else ([1, 64] if quick else [1, 16, 64, 256])
    path, ctx = 5, 40  # accepted path of 5 nodes, n_k = 2k + 1: request r owns its own blocks for ctx .. ctx + 10
    per_req = -(-(ctx + 2 * path) // shape.block_size)
    num_blocks = max(batches) * per_req + 1
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    plane_shape = (num_blocks, shape.block_size, shape.num_kv_heads, 2 * shape.head_dim)
    planes = [torch.randn(plane_shape, generator=gen, device=DEVICE).to(shape.dtype) for _ in range(layers)]
    table = KVCacheTable.from_caches(planes)
    results, all_ok = [], True
    for batch in batches:
        src, dst = [], []
        for r in range(batch):
            base = num_blocks - (r + 1) * per_req  # distinct blocks per request
            first = base * shape.block_size  # the request's blocks are base, base + 1, ...: slot = first + position
            src += [first + ctx + 2 * k + 1 for k in range(path)]
            dst += [first + ctx + k for k in range(path)]
        src_t = torch.tensor(src, dtype=torch.int64, device=DEVICE)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=DEVICE)
        expected = [p.clone() for p in planes]
        copy_kv_slots_ref(expected, src_t, dst_t)
        copy_kv_slots(table, src_t, dst_t)
        ok = all(torch.equal(p.view(torch.int16), e.view(torch.int16)) for p, e in zip(planes, expected))
        del expected
        all_ok &= ok
        m = len(src)
        nbytes = 2 * m * layers * shape.num_kv_heads * 2 * shape.head_dim * planes[0].element_size()
        t_ours = bench(functools.partial(copy_kv_slots, table, src_t, dst_t)) if ok else None
        t_ref = bench(functools.partial(copy_kv_slots_ref, planes, src_t, dst_t)) if ok else None
        results.append(dict(
            kernel="copy_kv_slots", mode=f"commit {layers} layers", batch=batch, ctx=ctx, width=1, depth=path,
            q_tokens=m, gate="ok" if ok else "FAIL", max_err="0" if ok else "bits differ",
            ours_us=_us(t_ours), ours_us_p20=_us(t_ours, 1), ours_us_p80=_us(t_ours, 2),
            ours_GBps=_gbps(nbytes, t_ours), baseline="torch per-layer index copy" if t_ref else "",
            baseline_us=_us(t_ref), baseline_GBps=_gbps(nbytes, t_ref),
            speedup=f"{t_ref[0] / t_ours[0]:.2f}" if (t_ref and t_ours) else "", note=""))
    return results, all_ok


def _us(t, i: int = 0) -> str:
    return f"{t[i] * 1e3:.1f}" if t else ""


def _gbps(nbytes: int, t) -> str:
    return f"{nbytes / (t[0] * 1e-3) / 1e9:.0f}" if t else ""


COLUMNS = ["kernel", "mode", "batch", "ctx", "width", "depth", "q_tokens", "gate", "max_err", "ours_us", "ours_GBps",
           "baseline", "baseline_us", "baseline_GBps", "speedup"]


def main() -> int:
    smoke = ARGS.smoke
    if smoke:
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.float32 if DEVICE.type == "cpu" else torch.float16)
    else:
        shape = Shape(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16 if ARGS.dtype == "bf16" else torch.float16)
    print(f"device: {torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'CPU (Triton interpreter)'}; "
          f"torch {torch.__version__}, triton {triton.__version__}; {shape}")
    rows_a, ok_a = attention_rows(shape, smoke, ARGS.quick)
    rows_c, ok_c = commit_rows(shape, smoke, ARGS.quick)
    rows = rows_a + rows_c
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in COLUMNS))
    for note in sorted({r["note"] for r in rows if r["note"]}):
        print(f"note: {note}")
    path = ARGS.csv or Path("results/tmp/bench_kernels_smoke.csv" if smoke else "results/bench_kernels.csv")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    if not (ok_a and ok_c):
        print("correctness gate FAILED: no speedup reported for the failing rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
