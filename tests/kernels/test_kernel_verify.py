"""Fused verification kernel vs the torch core (joint_logprobs + verify_layer): the decisions must be EQUAL.

Equality, not closeness: out_idx (the emitted joint indices, in emission order) and out_valid must be identical to
the core's on every row. Runs compiled on a GPU and under Triton's interpreter on CPU (tiny shapes). Output buffers
are poisoned before every run, so a missed write fails. The statistical law of verification is the core's to test
(tests/method/test_verify_layer.py); here equality with the core is the whole claim. README.md beside the kernel says
what that equality rests on (every decision compares against a fresh random threshold, so ulp-level differences in
exp/log/sums flip one only with probability ~1e-7).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before dsbd_kernels is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

import dsbd_kernels.verify as kv  # noqa: E402
from dsbd_kernels.verify import fused_verify_layer, verify_layer_ref  # noqa: E402
from dsbd_kernels.verify.kernel import _key_base, _stream_key, _uniform  # noqa: E402
from vllm_dsbd.core import rng  # noqa: E402
from vllm_dsbd.core.joint import joint_logprobs  # noqa: E402
from vllm_dsbd.core.params import BatchParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.gpu,  # also run compiled on a GPU by benchmarks/gpu/check.sh
    # Triton's interpreter (numpy < 2.4) warns on scalar conversions, and on log(0) = -inf, which the math wants.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

POISON_IDX = -424242


@dataclass(frozen=True)
class Case:
    R: int
    S: int
    V: int
    M: int  # drafts per request (a random valid prefix of them per row)
    seed: int = 0
    dtype: torch.dtype = torch.float32
    top_k: bool = False  # top-k on a random half of the rows
    top_p: bool = False  # top-p on a random half of the rows
    logits: str = "normal"  # normal | ties (values on a 0.5 grid) | masked (some -inf tokens) | twins (slot 1 = slot 0)
    draft: str = "near"  # near: Q from perturbed target logits | target: Q = the core's P | far: unrelated Q
    k: str = "random"  # random: 1..min(support, 6) | support: k = support (small supports via top-k)
    det_rows: bool = False  # some rows deterministic (temperature 0): skipped, -1 / False

    @property
    def id(self) -> str:
        flags = [f for f, on in (("topk", self.top_k), ("topp", self.top_p), ("det", self.det_rows)) if on]
        return "-".join([f"R{self.R}-S{self.S}-V{self.V}-M{self.M}", str(self.dtype).removeprefix("torch."),
                         self.logits, self.draft, f"k{self.k}", *flags, f"s{self.seed}"])


def make_inputs(case: Case, device=DEVICE):
    """Random, awkward inputs for one case; drafts are real draws without replacement from the draft joint Q,
    which puts mass on dead slots too (so some drafts hang off parents the target does not have)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    R, S, V, M = case.R, case.S, case.V, case.M

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    scale = 1.0 + 2.0 * rand(R, 1, 1)
    logits = torch.randn(R, S, V, generator=g) * scale
    if case.logits == "ties":
        logits = torch.round(logits * 2) / 2
    if case.logits == "masked":
        logits = torch.where(rand(R, S, V) < 0.3, float("-inf"), logits)
        logits[:, :, 0] = torch.randn(R, S, generator=g)  # every beam keeps a finite token
    scores = -1.0 - 7.0 * rand(R, S)
    live = rand(R, S) < 0.7
    live[:, 0] |= ~live.any(1)
    if case.logits == "twins" and S > 1:
        logits[:, 1] = logits[:, 0]
        scores[:, 1] = scores[:, 0]
        live[:, :2] = True
    if R > 3:
        live[3] = False  # a request with no live beam: support 0, k = 0
    logits = logits.to(case.dtype)
    temperature = 0.5 + rand(R)
    if case.det_rows:
        temperature[::3] = 0.0
    top_k = torch.zeros(R, dtype=torch.int64)
    if case.top_k:
        pick = rand(R) < 0.5
        top_k = torch.where(pick, torch.randint(1, S * V + 2, (R,), generator=g), 0)
        if case.k == "support":
            top_k = torch.where(pick, torch.randint(1, 5, (R,), generator=g), 0)
    top_p = torch.ones(R)
    if case.top_p:
        top_p = torch.where(rand(R) < 0.5, 0.3 + 0.65 * rand(R), 1.0).float()
    seed = torch.randint(0, 2**63 - 1, (R,), generator=g)
    position = torch.randint(0, 2**40, (R,), generator=g)

    params = BatchParams.make(R, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    logp, _ = joint_logprobs(logits, scores, live, params)  # the core's P: only to pick k and the "target" draft
    if case.draft == "target":
        logq = logp.clone()  # Q = the core's P, bit for bit: acceptance is (nearly) certain
    else:
        noise = 0.7 if case.draft == "near" else 3.0
        dl = logits.float().masked_fill(torch.isinf(logits.float()), -30.0) + noise * torch.randn(R, S, V, generator=g)
        ds = scores + torch.randn(R, S, generator=g)
        logq = (ds[:, :, None] + torch.log_softmax(dl, -1)).reshape(R, S * V)
        logq = torch.log_softmax(logq, -1)  # draft joint over ALL slots (dead ones too)
    if M:
        gum = -torch.log(-torch.log(rand(R, S * V).clamp(1e-12, 1 - 1e-7)))
        draft_idx = torch.topk(logq + gum, min(M, S * V), dim=-1).indices
        nval = torch.randint(0, M + 1, (R,), generator=g)
        nval[0] = M
        draft_valid = (torch.arange(M)[None, :] < nval[:, None]) & torch.isfinite(logq.gather(1, draft_idx))
        draft_valid = torch.cumprod(draft_valid.long(), 1).bool()  # a prefix
        draft_idx = torch.where(draft_valid, draft_idx, torch.randint(0, S * V, (R, M), generator=g))
    else:
        draft_idx = torch.zeros(R, 0, dtype=torch.int64)
        draft_valid = torch.zeros(R, 0, dtype=torch.bool)

    support = torch.isfinite(logp).sum(1)
    if case.k == "support":
        k = support.clamp(max=6)
    else:
        k = torch.minimum(torch.randint(1, 7, (R,), generator=g), support)
    args = (logits, scores, live, temperature, top_k, top_p, seed, position, draft_idx, draft_valid, logq, k)
    return tuple(a.to(device) for a in args)


def run_both(args, max_outputs):
    """The core (reference) and the kernel on poisoned output buffers."""
    R = args[0].shape[0]
    ref_idx, ref_valid = verify_layer_ref(*args, max_outputs=max_outputs)
    out_idx = torch.full((R, max_outputs), POISON_IDX, dtype=torch.int64, device=DEVICE)
    out_valid = torch.ones(R, max_outputs, dtype=torch.bool, device=DEVICE)
    got_idx, got_valid = fused_verify_layer(*args, max_outputs=max_outputs, out_idx=out_idx, out_valid=out_valid,
                                            use_kernel=True)
    assert got_idx.data_ptr() == out_idx.data_ptr() and got_valid.data_ptr() == out_valid.data_ptr()
    return (ref_idx, ref_valid), (got_idx, got_valid)


def assert_same_decisions(args, ref, got, case_id: str) -> None:
    """out_idx and out_valid identical, with a report of every differing row (the row's settings included)."""
    (ri, rv), (gi, gv) = ref, got
    bad = ((ri != gi) | (rv != gv)).any(1).nonzero().flatten().tolist()
    if not bad:
        return
    names = ("logits", "scores", "live", "temperature", "top_k", "top_p", "seed", "position", "draft_idx",
             "draft_valid", "logq", "k")
    a = dict(zip(names, args))
    lines = [f"{case_id}: {len(bad)} of {ri.shape[0]} rows differ"]
    for r in bad[:5]:
        lines.append(f"  row {r}: T={float(a['temperature'][r]):.3f} top_k={int(a['top_k'][r])} "
                     f"top_p={float(a['top_p'][r]):.3f} k={int(a['k'][r])} live={a['live'][r].tolist()} "
                     f"drafts={a['draft_idx'][r].tolist()} valid={a['draft_valid'][r].tolist()}")
        lines.append(f"    core   idx={ri[r].tolist()} valid={rv[r].tolist()}")
        lines.append(f"    kernel idx={gi[r].tolist()} valid={gv[r].tolist()}")
    raise AssertionError("\n".join(lines))


# The matrix: every (S, V, M) of S in {1, 3}, V in {7, 50, 129}, M in {0, 1, 3}, with per-row top-k / top-p /
# temperature / k / draft count varied inside each case, then the rare shapes: ties at the thresholds, masked
# vocab, twin beams (exact cross-beam ties), drafts from the target itself (near-certain accepts), unrelated drafts
# (rejects and residual draws), k = support, deterministic rows mixed in, low-precision logits.
BASE = [Case(R=8 + (i % 5), S=S, V=V, M=M, seed=i, top_k=i % 2 == 0, top_p=i % 3 != 1)
        for i, (S, V, M) in enumerate((S, V, M) for S in (1, 3) for V in (7, 50, 129) for M in (0, 1, 3))]
SPECIAL = [
    Case(R=12, S=3, V=50, M=3, seed=101, logits="ties", top_k=True, top_p=True),
    Case(R=10, S=3, V=7, M=3, seed=102, logits="ties", top_k=True, k="support"),
    Case(R=10, S=3, V=129, M=3, seed=103, logits="masked", top_p=True),
    Case(R=10, S=3, V=50, M=3, seed=104, logits="twins", top_k=True, top_p=True),
    Case(R=12, S=3, V=50, M=3, seed=105, draft="target", top_p=True),
    Case(R=12, S=1, V=129, M=3, seed=106, draft="target"),
    Case(R=12, S=3, V=50, M=3, seed=107, draft="far"),
    Case(R=12, S=3, V=7, M=3, seed=108, draft="far", k="support"),
    Case(R=12, S=3, V=50, M=1, seed=109, det_rows=True, top_k=True),
    Case(R=10, S=3, V=129, M=3, seed=110, dtype=torch.float16, top_k=True, top_p=True),
    Case(R=10, S=3, V=129, M=3, seed=111, dtype=torch.bfloat16, top_p=True),
]
CASES = BASE + SPECIAL


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_kernel_equals_core(case: Case):
    args = make_inputs(case)
    max_outputs = max(int(args[-1].max()), 1)
    ref, got = run_both(args, max_outputs)
    assert_same_decisions(args, ref, got, case.id)


SMALL_TILES = [
    Case(R=4, S=3, V=129, M=3, seed=201, top_k=True, top_p=True),
    Case(R=6, S=1, V=50, M=3, seed=202, logits="ties", top_k=True, top_p=True, draft="far"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SMALL_TILES])
def test_kernel_equals_core_small_tiles(case: Case, monkeypatch):
    """Several vocab chunks per beam (BLOCK_V = 16) and a 2-way search (one bit per pass): chunk boundaries, the
    cross-chunk argmax / tie order and a long threshold search."""
    monkeypatch.setattr(kv, "_MAX_BLOCK_V", 16)
    monkeypatch.setattr(kv, "_NUM_PIVOTS", 2)
    args = make_inputs(case)
    ref, got = run_both(args, max(int(args[-1].max()), 1) + 2)  # spare columns: -1 / False after the k-th
    assert_same_decisions(args, ref, got, case.id)


def test_deterministic_rows_are_skipped():
    case = Case(R=6, S=3, V=7, M=1, seed=7, det_rows=True)
    args = make_inputs(case)
    temperature = args[3]
    _, (gi, gv) = run_both(args, 4)
    det = temperature == 0
    assert bool(det.any())
    assert bool((gi[det] == -1).all()) and not bool(gv[det].any())


def test_empty_residual_keeps_the_target():
    """A reject whose residual max(T - Q_j, 0) has no mass leaves T as it is (verify.py's `tot > _TINY` guard).
    P = Q = uniform on tokens {0, 1} (token 2 has logit -inf), bit for bit; draft 0 is token 2, which both give
    probability 0: rejected, residual exactly 0, T must stay P (normalising would give 0 / 0). Draft 1 (token 0) is
    then accepted for sure, and the residual draw after it must be token 1: every row emits [0, 1]."""
    R, S, V = 8, 1, 3
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]] * R, device=DEVICE)
    half = float(torch.log(torch.tensor(0.5)))
    logq = torch.tensor([[half, half, float("-inf")]] * R, device=DEVICE)
    args = (logits, torch.zeros(R, S, device=DEVICE), torch.ones(R, S, dtype=torch.bool, device=DEVICE),
            torch.ones(R, device=DEVICE), torch.zeros(R, dtype=torch.int64, device=DEVICE),
            torch.ones(R, device=DEVICE),
            torch.arange(R, device=DEVICE) * 7919, torch.arange(R, device=DEVICE) + 3,
            torch.tensor([[2, 0]] * R, device=DEVICE), torch.ones(R, 2, dtype=torch.bool, device=DEVICE), logq,
            torch.full((R,), 2, dtype=torch.int64, device=DEVICE))
    ref, got = run_both(args, 2)
    assert_same_decisions(args, ref, got, "empty-residual")
    assert got[0].tolist() == [[0, 1]] * R


def test_matrix_reaches_every_branch():
    """No vacuous pass: over the matrix (the core's outputs, no kernel) drafts are accepted, drafts on dead parents
    are rejected, residual and direct draws happen, top-k keeps ties at its threshold, top-p cuts, k = support."""
    seen = dict(accepted=0, dead_parent_draft=0, non_draft_output=0, after_last_draft=0, topk_tie=0, topp_cut=0,
                k_support=0)
    for case in CASES:
        args = make_inputs(case, device="cpu")
        logits, scores, live, temperature, top_k, top_p, seed, _, didx, dval, _, k = args
        ref_idx, ref_valid = verify_layer_ref(*args, max_outputs=max(int(k.max()), 1))
        S, V = logits.shape[1], logits.shape[2]
        params = BatchParams.make(logits.shape[0], temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        logp, _ = joint_logprobs(logits, scores, live, params)
        for r in range(logits.shape[0]):
            if float(temperature[r]) == 0:
                continue
            drafts = set(didx[r][dval[r]].tolist())
            outs = ref_idx[r][ref_valid[r]].tolist()
            seen["accepted"] += sum(o in drafts for o in outs)
            seen["non_draft_output"] += sum(o not in drafts for o in outs)
            seen["dead_parent_draft"] += sum(not bool(live[r, d // V]) for d in drafts)
            seen["after_last_draft"] += max(0, len(outs) - len(drafts))
            fin = logp[r][torch.isfinite(logp[r])]
            if int(top_k[r]) > 0 and fin.numel() > int(top_k[r]):
                seen["topk_tie"] += 1  # more pairs kept than top_k: tied at the threshold
            n_live = int(torch.isfinite(logits[r][live[r]].float()).sum())  # pairs before top-k / top-p
            if float(top_p[r]) < 1 and int(top_k[r]) == 0 and 1 < fin.numel() < n_live:
                seen["topp_cut"] += 1
            seen["k_support"] += int(len(outs) == fin.numel() and fin.numel() > 1)
    assert all(v > 0 for v in seen.values()), seen


# ---- the in-kernel randomness is the core's, bit for bit ------------------------------------------------------------

@triton.jit
def _rng_probe_kernel(seed_ptr, position_ptr, index_ptr, key_ptr, u_ptr, g_ptr, N, STREAM: tl.constexpr,
                      BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < N
    seed = tl.load(seed_ptr + o, mask=m, other=0)
    position = tl.load(position_ptr + o, mask=m, other=0)
    key = _stream_key(_key_base(seed, position), STREAM)
    u = _uniform(key, tl.load(index_ptr + o, mask=m, other=0))
    g = (-(libdevice.log(-libdevice.log(u)) if ACCURATE else tl.log(-tl.log(u)))).to(tl.float32)  # the kernel's
    tl.store(key_ptr + o, key.to(tl.int64, bitcast=True), mask=m)
    tl.store(u_ptr + o, u, mask=m)
    tl.store(g_ptr + o, g, mask=m)


@pytest.mark.parametrize("n", [1, 37, 1000], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("stream", [rng.Stream.ACCEPT, rng.Stream.RESIDUAL, rng.Stream.DIRECT], ids=lambda s: s.name)
def test_kernel_rng_is_the_core_rng(stream, n):
    """Keys (64 bits) and 53-bit uniforms bit for bit, Gumbel noise (float32) equal, over seeds, positions and indices
    at the edges of 64 bits and random ones (awkward sizes: one lane, a ragged block)."""
    g = torch.Generator().manual_seed(int(stream) * 100 + n)
    edge_seed = torch.tensor([0, 1, 2**63 - 1, -(2**62), -1])
    edge_pos = torch.tensor([0, 2**32 - 1, 2**32, 2**63 - 1, 5])
    edge_idx = torch.tensor([0, 2**31, 2**32 + 5, 2**62 + 3, -7])
    seed = torch.cat([edge_seed, torch.randint(-(2**63), 2**63 - 1, (max(n - 5, 0),), generator=g)])[:n].to(DEVICE)
    position = torch.cat([edge_pos, torch.randint(0, 2**40, (max(n - 5, 0),), generator=g)])[:n].to(DEVICE)
    index = torch.cat([edge_idx, torch.randint(0, 2**35, (max(n - 5, 0),), generator=g)])[:n].to(DEVICE)
    key = torch.empty(n, dtype=torch.int64, device=DEVICE)
    u = torch.empty(n, dtype=torch.float64, device=DEVICE)
    noise = torch.empty(n, dtype=torch.float32, device=DEVICE)
    block = max(2, triton.next_power_of_2(n))
    _rng_probe_kernel[(1,)](seed, position, index, key, u, noise, n, STREAM=int(stream), BLOCK=block,
                            ACCURATE=ON_GPU)
    want_key = rng.request_key(seed, position, stream)
    assert torch.equal(key, want_key)
    want_u = rng.uniform(want_key, index)
    assert torch.equal(u.view(torch.int64), want_u.view(torch.int64))
    assert torch.equal(noise, rng.gumbel_of_(want_u.clone()))


# ---- the wrapper's contract --------------------------------------------------------------------------------------

def _small_args():
    return list(make_inputs(Case(R=3, S=2, V=5, M=2, seed=3)))


@pytest.mark.parametrize("pos, bad, match", [
    (0, lambda t: t.double(), "logits dtype"),
    (0, lambda t: t[..., ::2], "shape|stride"),
    (1, lambda t: t.double(), "scores must be"),
    (2, lambda t: t.int(), "live must be"),
    (3, lambda t: t.double(), "temperature must be"),
    (4, lambda t: t.int(), "top_k must be"),
    (6, lambda t: t[:2], "seed must have shape"),
    (8, lambda t: t.int(), "draft_idx must be"),
    (9, lambda t: t[:, :1], "draft_valid must have shape"),
    (10, lambda t: t[:, :-1], "logq must have shape"),
    (11, lambda t: t.float(), "k must be"),
], ids=["logits-dtype", "logits-stride", "scores", "live", "temperature", "top_k", "seed", "draft_idx",
        "draft_valid", "logq", "k"])
def test_contract_errors(pos, bad, match):
    args = _small_args()
    args[pos] = bad(args[pos])
    with pytest.raises(ValueError, match=match):
        fused_verify_layer(*args, max_outputs=4)


def test_contract_errors_outputs():
    args = _small_args()
    with pytest.raises(ValueError, match="max_outputs"):
        fused_verify_layer(*args, max_outputs=0)
    with pytest.raises(ValueError, match="out_idx"):
        fused_verify_layer(*args, max_outputs=4, out_idx=torch.empty(3, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out_valid"):
        fused_verify_layer(*args, max_outputs=4, out_valid=torch.empty(3, 4, dtype=torch.int8, device=DEVICE))


def test_reference_path_and_default_width():
    """use_kernel=False is the core; the default max_outputs is max(k) as verify_layer's own width."""
    args = _small_args()
    ri, rv = verify_layer_ref(*args, max_outputs=max(int(args[-1].max()), 1))
    gi, gv = fused_verify_layer(*args, use_kernel=False)
    assert torch.equal(ri, gi) and torch.equal(rv, gv)
    ki, kvld = fused_verify_layer(*args)
    assert torch.equal(ri, ki) and torch.equal(rv, kvld)


# ---- the kernel compiles for the GPU (checked on CPU-only machines too) ----------------------------------------------

_COMPILE_PROBE = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsbd_kernels.verify.kernel import verify_layer_kernel
from vllm_dsbd.core.rng import Stream
sig = dict(out_idx_ptr="*i64", out_valid_ptr="*i1", logits_ptr="*bf16", scores_ptr="*fp32", live_ptr="*i1",
           temperature_ptr="*fp32", top_k_ptr="*i64", top_p_ptr="*fp32", seed_ptr="*i64", position_ptr="*i64",
           k_ptr="*i64", draft_idx_ptr="*i64", draft_valid_ptr="*i1", logq_ptr="*fp32", S="i32", V="i32", M="i32",
           KOUT="i32", stride_lr="i32", stride_ls="i32", stride_sr="i32", stride_lvr="i32", stride_dr="i32",
           stride_dvr="i32", stride_qr="i32", stride_or="i32", stride_ovr="i32")
const = dict(STREAM_ACCEPT=int(Stream.ACCEPT), STREAM_RESIDUAL=int(Stream.RESIDUAL), STREAM_DIRECT=int(Stream.DIRECT),
             BLOCK_V=1024, BLOCK_S=8, BLOCK_M=8, BLOCK_K=8, NUM_PIVOTS=16, ACCURATE=True)
sig.update({name: "constexpr" for name in const})
c = triton.compile(ASTSource(fn=verify_layer_kernel, signature=sig, constexprs=const),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
assert len(c.asm["cubin"]) > 0
print("compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU every kernel test above compiles the kernel")
def test_kernel_compiles_for_sm90():
    """The interpreter accepts programs the compiler rejects (e.g. loop-carried values that change type): compile
    the kernel for an H100 (sm_90, bf16 logits, ACCURATE math) with Triton's bundled ptxas, no GPU needed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's CUDA toolchain (ptxas) is not available")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
