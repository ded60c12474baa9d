"""Fused exact verification of one DSBD layer: the ``@triton.jit`` kernel (launch it through the wrapper).

Grid: (R,), one program per request. A program streams its request's joint (S beam slots x V tokens, J = S * V)
beam by beam in BLOCK_V chunks, skipping dead beams, and never stores it: every pass recomputes what it needs from
the logits, the draft's log Q and a few per-beam / per-draft scalars held in registers. Passes (README.md has the
math and the exactness argument):
  1. per beam: max, min and count of the finite y = logit / T;  2. per beam: sum exp(y - max) (log-softmax);
  3. top-k threshold: multi-pivot bisection over the order-preserving int32 keys of the joint's fp32 bit patterns
     (count strictly above);  4. Z = sum exp(joint - jmax) over the kept pairs;  5. top-p threshold: the same search
     on the mass strictly above, then Z again;  log P = joint - (log Z + jmax) on the kept pairs;
  6. the rejection chain: one pass per decision (the residual's sum after a reject, the sum of P minus the emitted
     pairs after an accept). T is never stored: T(x) is replayed from p(x), q(x) and the scalars of the rejects
     since the last accept, op for op as vllm_dsbd/core/verify.py computes it;
  7. drafts exhausted: one pass for the Gumbel-max draw from T (and its fallback), then one pass per Gumbel-top draw
     from P minus the emitted pairs.
Random numbers are the core's counter-based hash (vllm_dsbd/core/rng.py) in uint64, so they are bit-identical:
53-bit float64 uniforms, Gumbel noise computed in float64 and rounded once to float32, as the core does.
Naming (FLA): ``i_`` program indices, ``o_`` aranges, ``m_`` masks, ``p_`` pointers, ``b_`` register tiles.
Small helpers are inlined by hand where they sit in per-chunk code: Triton's interpreter re-patches the language
on every nested @jit call (~0.15 ms each), which would dominate the CPU tests.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

TINY: tl.constexpr = tl.constexpr(1e-30)  # the core's _TINY
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
POS_INF: tl.constexpr = tl.constexpr(float("inf"))
NO_INDEX: tl.constexpr = tl.constexpr(2**62)  # larger than any joint index

# Elementwise math. Division is tl.math.div_rn (IEEE) and exp/log are the CUDA math library's (libdevice) when
# ACCURATE: what torch computes with on the GPU. Triton's `/`, tl.exp and tl.log compile to approximate PTX
# (div.full, ex2.approx, lg2.approx). The interpreter has no libdevice; there ACCURATE is False and exp/log are
# numpy's. Written inline as `libdevice.exp(x) if ACCURATE else tl.exp(x)` (a compile-time choice).


# ----------------------------------------------------------------------------------------------------------------
# randomness: vllm_dsbd.core.rng in uint64 arithmetic, its constants written out (bit identity: the kernel tests)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fmix64(h):
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    return h ^ (h >> 33)


@triton.jit
def _key_base(seed, position):
    """rng.key_base: seed, position int64 scalars -> uint64."""
    h = _fmix64(seed.to(tl.uint64, bitcast=True) ^ 0x9E3779B97F4A7C15)
    return _fmix64(h ^ position.to(tl.uint64, bitcast=True))


@triton.jit
def _stream_key(base, STREAM: tl.constexpr):
    """rng.stream_key: the uint64 key of stream STREAM (an int) at a key base."""
    return _fmix64(base ^ (tl.full([], STREAM, tl.uint64) * 0xD6E8FEB86659FD93))


@triton.jit
def _uniform(key, index):
    """rng.uniform: key uint64 scalar, index int64 (any shape) -> fp64 in (0, 1), 53 bits: (2n + 1) * 2**-53 with
    n = bits >> 12, bits = fmix64(fmix64(key ^ KEY_SALT) ^ fmix64(index * INDEX_MUL + INDEX_ADD)). (fmix64 inlined.)"""
    k = key ^ 0x3C6EF372FE94F82B
    k = k ^ (k >> 33)
    k = k * 0xFF51AFD7ED558CCD
    k = k ^ (k >> 33)
    k = k * 0xC4CEB9FE1A85EC53
    k = k ^ (k >> 33)
    h = index.to(tl.uint64, bitcast=True) * 0x9FB21C651E98DF25 + 0x6A09E667F3BCC909
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    h = h ^ (h >> 33)
    h = h ^ k
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    h = h ^ (h >> 33)
    return ((h >> 12).to(tl.float64) * 2.0 + 1.0) * 1.1102230246251565e-16


# ----------------------------------------------------------------------------------------------------------------
# the joint at a chunk of one beam row, and the residual target T at any pairs
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b):
    """Scalars of beam slot b: (live, max y, log sum exp(y - max), s_b - shift)."""
    sel = o_s == b
    return (tl.sum(tl.where(sel, live_s, 0), axis=0) != 0, tl.sum(tl.where(sel, m_vec, 0.0), axis=0),
            tl.sum(tl.where(sel, ls_vec, 0.0), axis=0), tl.sum(tl.where(sel, sh_vec, 0.0), axis=0))


@triton.jit
def _joint(p_row, o, m_o, temperature, m_b, ls_b, sh_b):
    """joint.py's score at tokens o of one beam row, -inf where not m_o:
    (s_b - shift) + log_softmax(l_b / T), the log-softmax as (y - max) - log(sum exp(y - max)) like torch."""
    x = tl.load(p_row + o, mask=m_o, other=float("-inf")).to(tl.float32)
    y = tl.math.div_rn(x, temperature)
    return sh_b + ((y - m_b) - ls_b)


@triton.jit
def _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M: tl.constexpr):
    """For flat indices idx [N]: rank = the first valid draft position holding idx (BLOCK_M if none), so idx was
    drawn before step i iff rank < i; emitted = idx is an accepted draft."""
    eq = (idx[:, None] == z_vec[None, :]) & zval_vec[None, :]  # [N, BLOCK_M]
    rank = tl.min(tl.where(eq, o_m[None, :], BLOCK_M), axis=1)  # [N]
    emitted = tl.max(tl.where(eq & acc_vec[None, :], 1, 0), axis=1) > 0  # [N]
    return rank, emitted


@triton.jit
def _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, i_hi, o_m):
    """The residual target T at some pairs, replayed as verify.py builds it: T = P at the start, or
    where(emitted, 0, P) / dpm after the last accept; then for each reject i in [i_lo, i_hi) whose residual had
    mass: T = max(T - where(drawn before i, 0, Q) / denom_i, 0) / tot_i."""
    t = tl.where(after_accept, tl.math.div_rn(tl.where(emitted, 0.0, p), dpm), p)
    for i in range(i_lo, i_hi):
        sel = o_m == i
        if tl.sum(tl.where(sel, rej_vec, 0), axis=0) != 0:
            den = tl.sum(tl.where(sel, den_vec, 0.0), axis=0)
            tot = tl.sum(tl.where(sel, tot_vec, 0.0), axis=0)
            qj = tl.math.div_rn(tl.where(rank < i, 0.0, q), den)
            t = tl.math.div_rn(tl.maximum(t - qj, 0.0), tot)
    return t


# ----------------------------------------------------------------------------------------------------------------
# passes over the joint
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _above(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, pivots, jmax,
           MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, ACCURATE: tl.constexpr):
    """Per pivot key: the count (MASS=False) or the mass exp(joint - jmax) (MASS=True) of the pairs strictly
    above it. Pairs under the current threshold lie below every pivot, so they need no mask. [NUM_PIVOTS] fp64."""
    acc = tl.zeros([NUM_PIVOTS], tl.float64)
    for b in range(0, S):
        live_b, m_b, ls_b, sh_b = _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b)
        if live_b:
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                j = _joint(p_row, o, o < V, temperature, m_b, ls_b, sh_b)  # [BLOCK_V]
                jb = j.to(tl.int32, bitcast=True)
                above = tl.where(jb < 0, jb ^ 0x7FFFFFFF, jb)[:, None] > pivots[None, :]  # [BLOCK_V, NUM_PIVOTS]
                if MASS:
                    w = libdevice.exp(j - jmax) if ACCURATE else tl.exp(j - jmax)
                    part = tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
                else:
                    part = tl.sum(tl.where(above, 1.0, 0.0), axis=0)  # exact: chunk counts < 2**24
                acc += part.to(tl.float64)
    return acc


@triton.jit
def _search(lo, hi, limit, Z, p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax,
            MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, ACCURATE: tl.constexpr):
    """The smallest key t in [lo, hi] whose amount strictly above (count, or mass / Z) is < limit, given that hi
    qualifies (the amount above only falls as t grows). Each pass tries NUM_PIVOTS evenly spaced keys and keeps the
    bracket where the predicate flips: a 2**32 range takes ceil(32 / log2(NUM_PIVOTS)) passes. The answer is the key
    of a pair's value, because the amount above only changes at those. int64 keys."""
    o_piv = tl.arange(0, NUM_PIVOTS)
    while lo < hi:
        step = (hi - lo + NUM_PIVOTS - 1) // NUM_PIVOTS
        piv = lo + o_piv.to(tl.int64) * step  # [NUM_PIVOTS]
        m_piv = piv < hi
        amount = _above(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v,
                        tl.where(m_piv, piv, hi).to(tl.int32), jmax, MASS, BLOCK_V, NUM_PIVOTS, ACCURATE)
        if MASS:
            ok = (amount / Z) < limit
        else:
            ok = amount < limit
        ok = ok | (piv >= hi)
        a = tl.min(tl.where(ok, o_piv, NUM_PIVOTS), axis=0)  # the first pivot that qualifies
        new_hi = tl.minimum(tl.sum(tl.where(o_piv == a, piv, 0), axis=0), hi)
        new_hi = tl.where(a < NUM_PIVOTS, new_hi, hi)
        lo = tl.where(a > 0, tl.sum(tl.where(o_piv == a - 1, piv, 0), axis=0) + 1, lo)
        hi = new_hi
    return lo


@triton.jit
def _sum_kept(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, jmax,
              BLOCK_V: tl.constexpr, ACCURATE: tl.constexpr):
    """logsumexp's sum: Z = sum exp(joint - jmax) over the kept pairs (joint >= thr). fp32."""
    acc = tl.zeros([], tl.float64)
    for b in range(0, S):
        live_b, m_b, ls_b, sh_b = _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b)
        if live_b:
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                j = _joint(p_row, o, o < V, temperature, m_b, ls_b, sh_b)
                w = libdevice.exp(j - jmax) if ACCURATE else tl.exp(j - jmax)
                acc += tl.sum(tl.where(j >= thr, w, 0.0), axis=0).to(tl.float64)
    return acc.to(tl.float32)


@triton.jit
def _chain_sum(p_row0, p_qrow, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, norm,
               z_vec, zval_vec, acc_vec, o_m, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, jd, den,
               RESIDUAL: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """RESIDUAL: sum of max(T - Q_jd, 0) with T before step jd (the mass of the residual after rejecting draft jd);
    else: sum of where(emitted, 0, P) (the normaliser of T after an accept). fp32."""
    acc = tl.zeros([], tl.float64)
    for b in range(0, S):
        live_b, m_b, ls_b, sh_b = _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b)
        if live_b:
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                m_o = o < V
                idx = b * V + o
                lp = tl.where(m_o, _joint(p_row, o, m_o, temperature, m_b, ls_b, sh_b), NEG_INF)
                lp = tl.where(lp >= thr, lp - norm, NEG_INF)  # log P
                p = libdevice.exp(lp) if ACCURATE else tl.exp(lp)
                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                if RESIDUAL:
                    lq = tl.load(p_qrow + idx, mask=m_o, other=float("-inf"))
                    q = libdevice.exp(lq) if ACCURATE else tl.exp(lq)
                    t = _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, jd, o_m)
                    val = tl.maximum(t - tl.math.div_rn(tl.where(rank < jd, 0.0, q), den), 0.0)
                else:
                    val = tl.where(emitted, 0.0, p)
                acc += tl.sum(tl.where(m_o, val, 0.0), axis=0).to(tl.float64)
    return acc.to(tl.float32)


@triton.jit
def _residual_draw(p_row0, p_qrow, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr,
                   norm, z_vec, zval_vec, acc_vec, o_m, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, M, key,
                   BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """The draw when the drafts run out: argmax(log T + g) if sum(T) > TINY, else argmax(log(P minus emitted) + g),
    g the Gumbel noise of `key` at each joint index; first index on ties (torch.argmax). One pass for both."""
    s = tl.zeros([], tl.float64)
    best_t = tl.full([], NEG_INF, tl.float32)
    arg_t = tl.full([], -1, tl.int64)
    best_p = tl.full([], NEG_INF, tl.float32)
    arg_p = tl.full([], -1, tl.int64)
    for b in range(0, S):
        live_b, m_b, ls_b, sh_b = _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b)
        if live_b:
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                m_o = o < V
                idx = b * V + o
                lp = tl.where(m_o, _joint(p_row, o, m_o, temperature, m_b, ls_b, sh_b), NEG_INF)
                lp = tl.where(lp >= thr, lp - norm, NEG_INF)
                p = libdevice.exp(lp) if ACCURATE else tl.exp(lp)
                lq = tl.load(p_qrow + idx, mask=m_o, other=float("-inf"))
                q = libdevice.exp(lq) if ACCURATE else tl.exp(lq)
                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                t = _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, M, o_m)
                t = tl.where(m_o, t, 0.0)
                pm = tl.where(emitted, 0.0, p)
                s += tl.sum(t, axis=0).to(tl.float64)
                u = _uniform(key, idx)
                g = (-(libdevice.log(-libdevice.log(u)) if ACCURATE else tl.log(-tl.log(u)))).to(tl.float32)
                kt = tl.where(m_o, (libdevice.log(t) if ACCURATE else tl.log(t)) + g, NEG_INF)
                kp = tl.where(m_o, (libdevice.log(pm) if ACCURATE else tl.log(pm)) + g, NEG_INF)
                bt = tl.max(kt, axis=0)
                at = tl.min(tl.where(m_o & (kt == bt), idx, NO_INDEX), axis=0)
                if (bt > best_t) | (arg_t < 0):
                    best_t = bt
                    arg_t = at
                bp = tl.max(kp, axis=0)
                ap = tl.min(tl.where(m_o & (kp == bp), idx, NO_INDEX), axis=0)
                if (bp > best_p) | (arg_p < 0):
                    best_p = bp
                    arg_p = ap
    return tl.where(s.to(tl.float32) > TINY, arg_t, arg_p)


@triton.jit
def _direct_draw(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, norm,
                 z_vec, zval_vec, acc_vec, o_m, y_res, key, prev_val, prev_idx,
                 BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """The next Gumbel-top draw from P minus the emitted pairs (accepted drafts and y_res): the largest key
    log P + g after (prev_val, prev_idx) in the order (key descending, index ascending). Returns (key, index)."""
    best = tl.full([], NEG_INF, tl.float32)
    arg = tl.full([], -1, tl.int64)
    for b in range(0, S):
        live_b, m_b, ls_b, sh_b = _beam(live_s, m_vec, ls_vec, sh_vec, o_s, b)
        if live_b:
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                m_o = o < V
                idx = b * V + o
                lp = tl.where(m_o, _joint(p_row, o, m_o, temperature, m_b, ls_b, sh_b), NEG_INF)
                lp = tl.where(lp >= thr, lp - norm, NEG_INF)
                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                u = _uniform(key, idx)
                g = (-(libdevice.log(-libdevice.log(u)) if ACCURATE else tl.log(-tl.log(u)))).to(tl.float32)
                kd = tl.where(emitted | (idx == y_res), NEG_INF, lp) + g
                ok = m_o & ((kd < prev_val) | ((kd == prev_val) & (idx > prev_idx)))
                kd = tl.where(ok, kd, NEG_INF)
                bk = tl.max(kd, axis=0)
                ak = tl.min(tl.where(ok & (kd == bk), idx, NO_INDEX), axis=0)
                if (ak < NO_INDEX) & ((bk > best) | (arg < 0)):
                    best = bk
                    arg = ak
    return best, arg


@triton.jit(do_not_specialize=["S", "M", "KOUT"])
def verify_layer_kernel(
    out_idx_ptr,  # int64 [R, KOUT] joint indices of the outputs, emission order, -1 after the k-th
    out_valid_ptr,  # bool [R, KOUT]
    logits_ptr,  # fp32/fp16/bf16 [R, S, V], unit stride in V
    scores_ptr,  # fp32 [R, S] beam scores
    live_ptr,  # bool [R, S]
    temperature_ptr,  # fp32 [R]; 0 = deterministic row: skipped (outputs -1 / False)
    top_k_ptr,  # int64 [R], 0 = off
    top_p_ptr,  # fp32 [R], 1 = off
    seed_ptr,  # int64 [R]
    position_ptr,  # int64 [R]
    k_ptr,  # int64 [R] outputs wanted
    draft_idx_ptr,  # int64 [R, M] joint indices of the drafts in draw order
    draft_valid_ptr,  # bool [R, M]
    logq_ptr,  # fp32 [R, S * V] draft joint log Q
    S,
    V,
    M,
    KOUT,
    stride_lr,
    stride_ls,
    stride_sr,
    stride_lvr,
    stride_dr,
    stride_dvr,
    stride_qr,
    stride_or,
    stride_ovr,
    STREAM_ACCEPT: tl.constexpr,  # rng.Stream values
    STREAM_RESIDUAL: tl.constexpr,
    STREAM_DIRECT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # vocab chunk
    BLOCK_S: tl.constexpr,  # >= S
    BLOCK_M: tl.constexpr,  # >= M
    BLOCK_K: tl.constexpr,  # >= KOUT
    NUM_PIVOTS: tl.constexpr,  # keys tried per search pass
    ACCURATE: tl.constexpr,  # libdevice exp/log (GPU); tl.exp/tl.log under the interpreter
):
    i_r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    o_m = tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_v = tl.arange(0, BLOCK_V).to(tl.int64)
    temperature = tl.load(temperature_ptr + i_r)
    k = tl.load(k_ptr + i_r)
    b_out = tl.full([BLOCK_K], -1, tl.int64)  # the outputs in emission order

    if temperature > 0:
        p_row0 = logits_ptr + i_r * stride_lr
        p_qrow = logq_ptr + i_r * stride_qr
        # ---- passes 1, 2: shift, live beams, log-softmax scalars ----------------------------------------------------
        m_s = o_s < S
        b_live = tl.load(live_ptr + i_r * stride_lvr + o_s, mask=m_s, other=0) != 0  # [BLOCK_S]
        b_sc = tl.load(scores_ptr + i_r * stride_sr + o_s, mask=m_s, other=0.0)
        top = tl.max(tl.where(b_live, b_sc, NEG_INF), axis=0)
        shift = tl.where((top > NEG_INF) & (top < POS_INF), top, 0.0)
        sh_vec = b_sc - shift  # [BLOCK_S] s_b - shift
        live_s = (b_live & (sh_vec > NEG_INF)).to(tl.int32)  # a beam with score -inf has joint -inf
        m_vec = tl.full([BLOCK_S], NEG_INF, tl.float32)  # max y per beam
        mn_vec = tl.full([BLOCK_S], NEG_INF, tl.float32)  # min finite y per beam
        ls_vec = tl.zeros([BLOCK_S], tl.float32)  # log sum exp(y - max) per beam
        n_finite = tl.zeros([], tl.int64)
        for b in range(0, S):
            if tl.sum(tl.where(o_s == b, live_s, 0), axis=0) != 0:
                p_row = p_row0 + b * stride_ls
                b_mx = tl.full([BLOCK_V], NEG_INF, tl.float32)
                b_mn = tl.full([BLOCK_V], POS_INF, tl.float32)
                b_cnt = tl.zeros([BLOCK_V], tl.int32)
                for v0 in range(0, V, BLOCK_V):
                    o = v0 + o_v
                    x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
                    y = tl.math.div_rn(x, temperature)
                    fin = y > NEG_INF
                    b_mx = tl.maximum(b_mx, y)
                    b_mn = tl.minimum(b_mn, tl.where(fin, y, POS_INF))
                    b_cnt += fin.to(tl.int32)
                m_b = tl.max(b_mx, axis=0)
                m_vec = tl.where(o_s == b, m_b, m_vec)
                mn_vec = tl.where(o_s == b, tl.min(b_mn, axis=0), mn_vec)
                n_finite += tl.sum(b_cnt, axis=0).to(tl.int64)
                acc = tl.zeros([], tl.float64)
                for v0 in range(0, V, BLOCK_V):
                    o = v0 + o_v
                    x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
                    e = tl.math.div_rn(x, temperature) - m_b
                    acc += tl.sum(libdevice.exp(e) if ACCURATE else tl.exp(e), axis=0).to(tl.float64)
                sm = acc.to(tl.float32)
                ls_vec = tl.where(o_s == b, libdevice.log(sm) if ACCURATE else tl.log(sm), ls_vec)
        live_s = live_s * (m_vec > NEG_INF).to(tl.int32)  # all logits -inf on a live beam: contract breach
        # the joint's extremes, exactly as a pair computes them: max at y = max (0 - ls), min at the least finite y
        m_live = live_s != 0
        jmax = tl.max(tl.where(m_live, sh_vec + (0.0 - ls_vec), NEG_INF), axis=0)
        jmin = tl.min(tl.where(m_live, sh_vec + ((mn_vec - m_vec) - ls_vec), POS_INF), axis=0)

        if n_finite > 0:
            # ---- passes 3-5: top-k then top-p over the flattened joint; ties at a threshold are kept ---------------
            top_k = tl.load(top_k_ptr + i_r)
            top_p = tl.load(top_p_ptr + i_r)
            thr = NEG_INF
            jb = jmin.to(tl.int32, bitcast=True)
            lo_key = tl.where(jb < 0, jb ^ 0x7FFFFFFF, jb).to(tl.int64)
            jb = jmax.to(tl.int32, bitcast=True)
            hi_key = tl.where(jb < 0, jb ^ 0x7FFFFFFF, jb).to(tl.int64)
            if (top_k > 0) & (top_k < n_finite):
                # the k-th largest value: the smallest t with count(key > t) < k
                lo_key = _search(lo_key, hi_key, top_k.to(tl.float64), 1.0, p_row0, stride_ls, V, S, temperature,
                                 live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax, False, BLOCK_V, NUM_PIVOTS, ACCURATE)
                kb = tl.where(lo_key < 0, lo_key ^ 0x7FFFFFFF, lo_key).to(tl.int32)
                thr = kb.to(tl.float32, bitcast=True)
            Z = _sum_kept(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, jmax,
                          BLOCK_V, ACCURATE)
            if top_p < 1.0:
                # keep x iff the mass strictly above x is < top_p: the smallest t with mass(key > t) / Z < top_p
                lo_key = _search(lo_key, hi_key, top_p.to(tl.float64), Z.to(tl.float64), p_row0, stride_ls, V, S,
                                 temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax, True, BLOCK_V,
                                 NUM_PIVOTS, ACCURATE)
                kb = tl.where(lo_key < 0, lo_key ^ 0x7FFFFFFF, lo_key).to(tl.int32)
                thr = kb.to(tl.float32, bitcast=True)
                Z = _sum_kept(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr,
                              jmax, BLOCK_V, ACCURATE)
            norm = (libdevice.log(Z) if ACCURATE else tl.log(Z)) + jmax  # torch.logsumexp: log(sum) + max

            # ---- the drafts: p, q at each, gathered once ----------------------------------------------------------
            m_m = o_m < M
            z_vec = tl.load(draft_idx_ptr + i_r * stride_dr + o_m, mask=m_m, other=0)  # [BLOCK_M] int64
            zval_vec = tl.load(draft_valid_ptr + i_r * stride_dvr + o_m, mask=m_m, other=0) != 0
            z_safe = tl.where(zval_vec, z_vec, 0)
            zb = z_safe // V  # beam slot of each draft
            zx = z_safe - zb * V
            onehot = zb[:, None] == o_s[None, :]  # [BLOCK_M, BLOCK_S]
            z_live = (tl.sum(tl.where(onehot, live_s[None, :], 0), axis=1) != 0) & zval_vec
            z_m = tl.sum(tl.where(onehot, m_vec[None, :], 0.0), axis=1)
            z_ls = tl.sum(tl.where(onehot, ls_vec[None, :], 0.0), axis=1)
            z_sh = tl.sum(tl.where(onehot, sh_vec[None, :], 0.0), axis=1)
            z_lp = tl.where(z_live, _joint(p_row0 + zb * stride_ls, zx, z_live, temperature, z_m, z_ls, z_sh),
                            NEG_INF)
            z_lp = tl.where(z_lp >= thr, z_lp - norm, NEG_INF)
            pz_vec = libdevice.exp(z_lp) if ACCURATE else tl.exp(z_lp)  # [BLOCK_M] P at the drafts
            z_lq = tl.load(p_qrow + z_safe, mask=zval_vec, other=float("-inf"))
            qz_vec = libdevice.exp(z_lq) if ACCURATE else tl.exp(z_lq)  # [BLOCK_M] Q at the drafts

            # ---- pass 6: the recursive rejection chain ---------------------------------------------------------------
            key_base = _key_base(tl.load(seed_ptr + i_r), tl.load(position_ptr + i_r))
            key_acc = _stream_key(key_base, STREAM_ACCEPT)
            acc_vec = o_m < 0  # [BLOCK_M] accepted drafts
            n_out = tl.zeros([], tl.int64)
            q_cum = tl.zeros([], tl.float64)  # mass of Q drawn so far (verify.py keeps it in float64)
            after_accept = n_out < 0  # False: T = P
            dpm = tl.full([], 1.0, tl.float32)  # normaliser of T after the last accept
            epoch = tl.zeros([], tl.int32)  # first step after the last accept
            rej_vec = tl.zeros([BLOCK_M], tl.int32)  # reject i applied (its residual had mass)
            den_vec = tl.zeros([BLOCK_M], tl.float32)  # denom_i
            tot_vec = tl.zeros([BLOCK_M], tl.float32)  # tot_i
            for jd in range(0, M):
                sel = o_m == jd
                valid_j = tl.sum(tl.where(sel, zval_vec.to(tl.int32), 0), axis=0) != 0
                z = tl.sum(tl.where(sel, z_vec, 0), axis=0)
                qz = tl.sum(tl.where(sel, qz_vec, 0.0), axis=0)
                live_j = valid_j & (n_out < k)
                den = tl.maximum(1.0 - q_cum, 1e-30).to(tl.float32)
                rank_z, em_z = _marks(z_vec, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                t_z = _target(pz_vec, qz_vec, rank_z, em_z, after_accept, dpm, rej_vec, den_vec, tot_vec, epoch,
                              jd, o_m)
                tz = tl.sum(tl.where(sel, t_z, 0.0), axis=0)
                u = _uniform(key_acc, tl.zeros([], tl.int64) + jd)
                accept = live_j & (u * tl.math.div_rn(qz, den) < tz)
                reject = live_j & ~accept
                if accept:
                    b_out = tl.where(o_k == n_out, z, b_out)
                    n_out += 1
                    acc_vec = acc_vec | sel
                    spm = _chain_sum(p_row0, p_qrow, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s,
                                     o_v, thr, norm, z_vec, zval_vec, acc_vec, o_m, after_accept, dpm, rej_vec,
                                     den_vec, tot_vec, epoch, jd, den, False, BLOCK_V, BLOCK_M, ACCURATE)
                    dpm = tl.maximum(spm, TINY)
                    after_accept = n_out > 0
                    epoch = jd + 1
                    rej_vec = tl.zeros([BLOCK_M], tl.int32)
                if reject:
                    tot = _chain_sum(p_row0, p_qrow, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec, o_s,
                                     o_v, thr, norm, z_vec, zval_vec, acc_vec, o_m, after_accept, dpm, rej_vec,
                                     den_vec, tot_vec, epoch, jd, den, True, BLOCK_V, BLOCK_M, ACCURATE)
                    if tot > TINY:  # else verify.py leaves T as it is
                        rej_vec = tl.where(sel, 1, rej_vec)
                        den_vec = tl.where(sel, den, den_vec)
                        tot_vec = tl.where(sel, tot, tot_vec)
                if valid_j:
                    q_cum += qz.to(tl.float64)

            # ---- pass 7: drafts exhausted: one draw from T, then Gumbel-top draws from P minus the emitted ----------
            y_res = tl.full([], -1, tl.int64)
            if n_out < k:
                key_res = _stream_key(key_base, STREAM_RESIDUAL)
                y_res = _residual_draw(p_row0, p_qrow, stride_ls, V, S, temperature, live_s, m_vec, ls_vec, sh_vec,
                                       o_s, o_v, thr, norm, z_vec, zval_vec, acc_vec, o_m, after_accept, dpm, rej_vec,
                                       den_vec, tot_vec, epoch, M, key_res, BLOCK_V, BLOCK_M, ACCURATE)
                b_out = tl.where(o_k == n_out, y_res, b_out)
                n_out += 1
            key_dir = _stream_key(key_base, STREAM_DIRECT)
            prev_val = tl.full([], POS_INF, tl.float32)
            prev_idx = tl.full([], -1, tl.int64)
            for _i in range(0, KOUT):
                if n_out < k:
                    prev_val, prev_idx = _direct_draw(p_row0, stride_ls, V, S, temperature, live_s, m_vec, ls_vec,
                                                      sh_vec, o_s, o_v, thr, norm, z_vec, zval_vec, acc_vec, o_m,
                                                      y_res, key_dir, prev_val, prev_idx, BLOCK_V, BLOCK_M, ACCURATE)
                    b_out = tl.where(o_k == n_out, prev_idx, b_out)
                    n_out += 1

    m_k = o_k < KOUT
    tl.store(out_idx_ptr + i_r * stride_or + o_k, b_out, mask=m_k)
    b_valid = (o_k < k).to(tl.int32) * (temperature > 0).to(tl.int32)  # [BLOCK_K]
    tl.store(out_valid_ptr + i_r * stride_ovr + o_k, b_valid != 0, mask=m_k)
