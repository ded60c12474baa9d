"""Fused exact verification of one DSBD layer: the ``@triton.jit`` kernel (launch it through the wrapper).

Grid: (R,), one program per request. A program streams the request's joint (S beam slots x V tokens, J = S * V) in
BLOCK_V chunks, beam by beam, skipping dead beams, and never materialises it: every pass recomputes what it needs
from the logits and a handful of per-beam / per-draft scalars kept in registers. Passes (README.md has the math):
  1. per beam: max, min and count of the finite y = logit / T;   2. per beam: sum exp(y - max)  -> log-softmax;
  3. top-k threshold: multi-pivot bisection over the int32 keys of the joint's fp32 bit patterns (count above);
  4. Z = sum exp(joint - jmax) over the kept pairs;   5. top-p threshold: the same search on the mass above, and Z
     again;   -> log P = joint - (log Z + jmax) on kept pairs;
  6. the rejection chain, one pass per draft decision: sum of the residual max(T - Q_j, 0) after a reject, sum of
     P minus the emitted pairs after an accept. T itself is never stored: T(x) is replayed from p(x), q(x) and the
     scalars of the rejects since the last accept, op for op as the torch core computes it;
  7. drafts exhausted: one pass for the Gumbel-max draw from T (and its fallback), one pass per further Gumbel-top
     draw from P minus the emitted pairs.
Random numbers are the core's counter-based hash (vllm_dsbd/core/rng.py) in uint32, so they are bit-identical.
Naming (FLA): ``i_`` program indices, ``o_`` aranges, ``m_`` masks, ``p_`` pointers, ``b_`` register tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

TINY: tl.constexpr = tl.constexpr(1e-30)  # the core's _TINY
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


# ----------------------------------------------------------------------------------------------------------------
# elementwise math: IEEE division and the CUDA math library's exp/log (what torch uses on the GPU). Triton's own
# `/`, tl.exp and tl.log compile to approximate PTX (div.full, ex2.approx, lg2.approx); the interpreter has no
# libdevice, and its tl.exp / tl.log are numpy's.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _div(a, b):
    return tl.math.div_rn(a, b)


# ----------------------------------------------------------------------------------------------------------------
# randomness: vllm_dsbd.core.rng in uint32 arithmetic
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _request_key(seed, position, SALT: tl.constexpr):
    """rng.request_key: seed, position int64 scalars; SALT = (stream * 0x27D4EB2F) mod 2**32. Returns uint32."""
    h = _fmix32(seed.to(tl.uint32) ^ 0x9E3779B9)
    h = _fmix32(h ^ (seed >> 32).to(tl.uint32))
    h = _fmix32(h ^ position.to(tl.uint32))
    return _fmix32(h ^ tl.full([], SALT, tl.uint32))


@triton.jit
def _uniform(key, index):
    """rng.uniform: key uint32 scalar, index int64 (any shape) -> float32 in (0, 1), 23 bits."""
    h = _fmix32((key ^ index.to(tl.uint32)) * 0x01000193)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _gumbel(key, index, ACCURATE: tl.constexpr):
    return -_log(-_log(_uniform(key, index), ACCURATE), ACCURATE)


# ----------------------------------------------------------------------------------------------------------------
# float <-> order-preserving int32 key (for threshold searches on the bit patterns)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _key(x):
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _from_key(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _pick(vec, o, i):
    """vec[i] of a register vector (exact: one term plus zeros)."""
    return tl.sum(tl.where(o == i, vec, 0), axis=0)


# ----------------------------------------------------------------------------------------------------------------
# the joint and the target's law at any flat index
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _y(p_row, o_v, m_v, temperature):
    """y = logit / T for a chunk of one beam row, -inf outside the row. [BLOCK_V] fp32."""
    x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
    return _div(x, temperature)


@triton.jit
def _joint_of_y(y, m_b, ls_b, sh_b):
    """joint.py: (s_b - shift) + log_softmax(l_b / T), as (s - shift) + ((y - max) - log(sum))."""
    return sh_b + ((y - m_b) - ls_b)


@triton.jit
def _logp_of_joint(j, thr, norm):
    """log P = joint - norm on the kept pairs (joint >= thr, the top-k/top-p threshold), -inf elsewhere."""
    return tl.where(j >= thr, j - norm, NEG_INF)


@triton.jit
def _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M: tl.constexpr):
    """For flat indices idx [N]: rank = first valid draft position holding idx (BLOCK_M if none), so idx is among
    the drafts drawn before step i iff rank < i; emitted = idx is an accepted draft."""
    eq = (idx[:, None] == z_vec[None, :]) & zval_vec[None, :]  # [N, BLOCK_M]
    rank = tl.min(tl.where(eq, o_m[None, :], BLOCK_M), axis=1)  # [N]
    emitted = tl.max(tl.where(eq & acc_vec[None, :], 1, 0), axis=1) > 0  # [N]
    return rank, emitted


@triton.jit
def _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec, i_lo, i_hi, o_m):
    """The current residual target T at some pairs, replayed as verify.py computes it:
    T = P (start) or where(emitted, 0, P) / dpm (after the last accept), then for every reject i in [i_lo, i_hi)
    whose residual had mass: T = max(T - where(drawn_i, 0, Q) / denom_i, 0) / tot_i."""
    t = tl.where(after_accept, _div(tl.where(emitted, 0.0, p), dpm), p)
    for i in range(i_lo, i_hi):
        if _pick(rej_vec, o_m, i) != 0:
            den = _pick(den_vec, o_m, i)
            tot = _pick(tot_vec, o_m, i)
            qj = _div(tl.where(rank < i, 0.0, q), den)
            t = _div(tl.maximum(t - qj, 0.0), tot)
    return t


@triton.jit
def _above(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, o_piv, pivots, jmax, S,
           MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """For each pivot key: how many pairs (MASS=False) or how much exp(joint - jmax) (MASS=True) lies strictly above
    it. Pairs under the current threshold lie below every pivot, so they need no mask. [NUM_PIVOTS] fp64."""
    acc = tl.zeros([NUM_PIVOTS], tl.float64)
    for b in range(0, S):
        if _pick(live_s, o_s, b) != 0:
            m_b = _pick(m_vec, o_s, b)
            ls_b = _pick(ls_vec, o_s, b)
            sh_b = _pick(sh_vec, o_s, b)
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                j = _joint_of_y(_y(p_row, o, o < V, temperature), m_b, ls_b, sh_b)  # [BLOCK_V]
                above = _key(j)[:, None] > pivots[None, :]  # [BLOCK_V, NUM_PIVOTS]
                if MASS:
                    w = tl.exp(j - jmax)  # (search only: consistent within the kernel is all it needs)
                    part = tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
                else:
                    part = tl.sum(tl.where(above, 1.0, 0.0), axis=0)
                acc += part.to(tl.float64)
    return acc


@triton.jit
def _search(lo, hi, limit, Z, p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax, S,
            MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Smallest key t in [lo, hi] with (amount strictly above t) < limit (count, or mass / Z), given that hi
    qualifies. Each pass tries NUM_PIVOTS evenly spaced keys and keeps the bracket where the predicate flips, so a
    32-bit range takes ~32 / log2(NUM_PIVOTS) passes. Returns an int64 key (that of a pair's value)."""
    o_piv = tl.arange(0, NUM_PIVOTS)
    while lo < hi:
        step = (hi - lo + NUM_PIVOTS - 1) // NUM_PIVOTS
        piv = lo + o_piv.to(tl.int64) * step  # [NUM_PIVOTS] int64
        m_piv = piv < hi
        amount = _above(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, o_piv,
                        tl.where(m_piv, piv, hi).to(tl.int32), jmax, S, MASS, BLOCK_V, NUM_PIVOTS)
        if MASS:
            ok = (amount / Z) < limit
        else:
            ok = amount < limit
        ok = ok | ~m_piv
        a = tl.min(tl.where(ok, o_piv, NUM_PIVOTS), axis=0)  # first pivot that qualifies
        new_hi = tl.minimum(_pick(piv, o_piv, a), hi)
        new_hi = tl.where(a < NUM_PIVOTS, new_hi, hi)
        lo = tl.where(a > 0, _pick(piv, o_piv, a - 1) + 1, lo)
        hi = new_hi
    return lo


@triton.jit
def _sum_kept(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, jmax, S,
              BLOCK_V: tl.constexpr, ACCURATE: tl.constexpr):
    """Z = sum of exp(joint - jmax) over the kept pairs (logsumexp's sum). fp32."""
    acc = tl.zeros([], tl.float64)
    for b in range(0, S):
        if _pick(live_s, o_s, b) != 0:
            m_b = _pick(m_vec, o_s, b)
            ls_b = _pick(ls_vec, o_s, b)
            sh_b = _pick(sh_vec, o_s, b)
            p_row = p_row0 + b * stride_ls
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                j = _joint_of_y(_y(p_row, o, o < V, temperature), m_b, ls_b, sh_b)
                w = tl.where(j >= thr, _exp(j - jmax, ACCURATE), 0.0)
                acc += tl.sum(w, axis=0).to(tl.float64)
    return acc.to(tl.float32)


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
    SALT_ACCEPT: tl.constexpr,
    SALT_RESIDUAL: tl.constexpr,
    SALT_DIRECT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    o_m = tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_v = tl.arange(0, BLOCK_V).to(tl.int64)
    temperature = tl.load(temperature_ptr + i_r)
    k = tl.load(k_ptr + i_r)
    b_out = tl.full([BLOCK_K], -1, tl.int64)  # outputs in emission order

    if temperature > 0:
        p_row0 = logits_ptr + i_r * stride_lr
        # ---- per-beam scalars: shift, live, log-softmax (passes 1, 2) -------------------------------------------
        m_s = o_s < S
        live_s = tl.load(live_ptr + i_r * stride_lvr + o_s, mask=m_s, other=0) != 0  # [BLOCK_S]
        sc_s = tl.load(scores_ptr + i_r * stride_sr + o_s, mask=m_s, other=0.0)
        top = tl.max(tl.where(live_s, sc_s, NEG_INF), axis=0)
        shift = tl.where((top > NEG_INF) & (top < float("inf")), top, 0.0)
        sh_vec = sc_s - shift
        live_s = (live_s & (sh_vec > NEG_INF)).to(tl.int32)  # a beam with score -inf has joint -inf
        m_vec = tl.full([BLOCK_S], NEG_INF, tl.float32)  # max of y per beam
        mn_vec = tl.full([BLOCK_S], NEG_INF, tl.float32)  # min finite y per beam
        ls_vec = tl.zeros([BLOCK_S], tl.float32)  # log sum exp(y - max) per beam
        n_finite = tl.zeros([], tl.int64)
        for b in range(0, S):
            if _pick(live_s, o_s, b) != 0:
                p_row = p_row0 + b * stride_ls
                mx = tl.full([BLOCK_V], NEG_INF, tl.float32)
                mn = tl.full([BLOCK_V], float("inf"), tl.float32)
                cnt = tl.zeros([BLOCK_V], tl.int32)
                for v0 in range(0, V, BLOCK_V):
                    o = v0 + o_v
                    y = _y(p_row, o, o < V, temperature)
                    fin = y > NEG_INF
                    mx = tl.maximum(mx, y)
                    mn = tl.minimum(mn, tl.where(fin, y, float("inf")))
                    cnt += fin.to(tl.int32)
                m_b = tl.max(mx, axis=0)
                m_vec = tl.where(o_s == b, m_b, m_vec)
                mn_vec = tl.where(o_s == b, tl.min(mn, axis=0), mn_vec)
                n_finite += tl.sum(cnt, axis=0).to(tl.int64)
                acc = tl.zeros([], tl.float64)
                for v0 in range(0, V, BLOCK_V):
                    o = v0 + o_v
                    y = _y(p_row, o, o < V, temperature)
                    acc += tl.sum(_exp(y - m_b, ACCURATE), axis=0).to(tl.float64)
                ls_vec = tl.where(o_s == b, _log(acc.to(tl.float32), ACCURATE), ls_vec)
        live_s = live_s * (m_vec > NEG_INF).to(tl.int32)  # a live beam whose logits are all -inf: contract breach
        # joint extremes, exact: the max sits at y = max (log-softmax 0 - ls), the min at the smallest finite y
        live_b1 = live_s != 0
        jmax = tl.max(tl.where(live_b1, sh_vec + (0.0 - ls_vec), NEG_INF), axis=0)
        jmin = tl.min(tl.where(live_b1, sh_vec + ((mn_vec - m_vec) - ls_vec), float("inf")), axis=0)

        if n_finite > 0:
            # ---- top-k, then top-p over the flattened joint (passes 3-5) -----------------------------------------
            top_k = tl.load(top_k_ptr + i_r)
            top_p = tl.load(top_p_ptr + i_r)
            thr = NEG_INF
            lo_key = _key(jmin).to(tl.int64)
            hi_key = _key(jmax).to(tl.int64)
            if (top_k > 0) & (top_k < n_finite):
                lo_key = _search(lo_key, hi_key, top_k.to(tl.float64), 1.0, p_row0, stride_ls, V, temperature,
                                 live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax, S, False, BLOCK_V, NUM_PIVOTS)
                thr = _from_key(lo_key)
            Z = _sum_kept(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, jmax, S,
                          BLOCK_V, ACCURATE)
            if top_p < 1.0:
                Zs = _sum_kept(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr,
                               jmax, S, BLOCK_V, False)  # the search's own normaliser (tl.exp, like _above)
                lo_key = _search(lo_key, hi_key, top_p.to(tl.float64), Zs.to(tl.float64), p_row0, stride_ls, V,
                                 temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, jmax, S, True, BLOCK_V,
                                 NUM_PIVOTS)
                thr = _from_key(lo_key)
                Z = _sum_kept(p_row0, stride_ls, V, temperature, live_s, m_vec, ls_vec, sh_vec, o_s, o_v, thr, jmax,
                              S, BLOCK_V, ACCURATE)
            norm = _log(Z, ACCURATE) + jmax  # torch.logsumexp: log(sum exp(x - max)) + max

            # ---- the drafts: their p, q and marks, gathered once ----------------------------------------------------
            m_m = o_m < M
            z_vec = tl.load(draft_idx_ptr + i_r * stride_dr + o_m, mask=m_m, other=0)  # [BLOCK_M] int64
            zval_vec = tl.load(draft_valid_ptr + i_r * stride_dvr + o_m, mask=m_m, other=0) != 0
            z_safe = tl.where(zval_vec, z_vec, 0)
            zb = z_safe // V  # beam slot of each draft
            zx = z_safe - zb * V
            onehot = zb[:, None] == o_s[None, :]  # [BLOCK_M, BLOCK_S]
            z_live = tl.sum(tl.where(onehot, live_s[None, :], 0), axis=1) != 0
            z_m = tl.sum(tl.where(onehot, m_vec[None, :], 0.0), axis=1)
            z_ls = tl.sum(tl.where(onehot, ls_vec[None, :], 0.0), axis=1)
            z_sh = tl.sum(tl.where(onehot, sh_vec[None, :], 0.0), axis=1)
            z_y = _y(p_row0 + zb * stride_ls, zx, zval_vec & z_live, temperature)
            z_j = tl.where(z_live, _joint_of_y(z_y, z_m, z_ls, z_sh), NEG_INF)
            pz_vec = _exp(_logp_of_joint(z_j, thr, norm), ACCURATE)  # [BLOCK_M] P at the drafts
            qz_vec = _exp(tl.load(logq_ptr + i_r * stride_qr + z_safe, mask=zval_vec, other=float("-inf")),
                          ACCURATE)  # [BLOCK_M] Q at the drafts
            acc_vec = o_m < 0  # accepted drafts (all False)
            rank_z, em_z = _marks(z_vec, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)

            # ---- pass 6: the recursive rejection chain ---------------------------------------------------------------
            key_acc = _request_key(tl.load(seed_ptr + i_r), tl.load(position_ptr + i_r), SALT_ACCEPT)
            n_out = tl.zeros([], tl.int64)
            q_cum = tl.zeros([], tl.float64)
            after_accept = n_out < 0  # False: T = P
            dpm = tl.full([], 1.0, tl.float32)
            epoch = tl.zeros([], tl.int32)  # first step of the current run of rejects
            rej_vec = tl.zeros([BLOCK_M], tl.int32)  # reject i applied (its residual had mass)
            den_vec = tl.zeros([BLOCK_M], tl.float32)
            tot_vec = tl.zeros([BLOCK_M], tl.float32)
            p_qrow = logq_ptr + i_r * stride_qr
            for jd in range(0, M):
                valid_j = _pick(zval_vec.to(tl.int32), o_m, jd) != 0
                z = _pick(z_vec, o_m, jd)
                live_j = valid_j & (n_out < k)
                den = tl.maximum(1.0 - q_cum, 1e-30).to(tl.float32)
                qz = _pick(qz_vec, o_m, jd)
                em_z = tl.max(tl.where((rank_z[:, None] == o_m[None, :]) & acc_vec[None, :], 1, 0), axis=1) > 0
                t_z = _target(pz_vec, qz_vec, rank_z, em_z, after_accept, dpm, rej_vec, den_vec, tot_vec, epoch,
                              jd, o_m)
                tz = _pick(t_z, o_m, jd)
                u = _uniform(key_acc, jd.to(tl.int64))
                accept = live_j & (u * _div(qz, den) < tz)
                reject = live_j & (not accept)
                if accept:
                    b_out = tl.where(o_k == n_out, z, b_out)
                    n_out += 1
                    acc_vec = acc_vec | (o_m == jd)
                    # T <- where(emitted, 0, P) / sum: one pass for the sum
                    s = tl.zeros([], tl.float64)
                    for b in range(0, S):
                        if _pick(live_s, o_s, b) != 0:
                            m_b = _pick(m_vec, o_s, b)
                            ls_b = _pick(ls_vec, o_s, b)
                            sh_b = _pick(sh_vec, o_s, b)
                            p_row = p_row0 + b * stride_ls
                            for v0 in range(0, V, BLOCK_V):
                                o = v0 + o_v
                                idx = b * V + o
                                p = _exp(_logp_of_joint(_joint_of_y(_y(p_row, o, o < V, temperature), m_b, ls_b,
                                                                    sh_b), thr, norm), ACCURATE)
                                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                                s += tl.sum(tl.where(emitted, 0.0, p), axis=0).to(tl.float64)
                    dpm = tl.maximum(s.to(tl.float32), TINY)
                    after_accept = n_out > 0
                    epoch = jd + 1
                    rej_vec = tl.zeros([BLOCK_M], tl.int32)
                if reject:
                    # T <- max(T - Q_j, 0) / tot if tot > TINY: one pass for tot
                    s = tl.zeros([], tl.float64)
                    for b in range(0, S):
                        if _pick(live_s, o_s, b) != 0:
                            m_b = _pick(m_vec, o_s, b)
                            ls_b = _pick(ls_vec, o_s, b)
                            sh_b = _pick(sh_vec, o_s, b)
                            p_row = p_row0 + b * stride_ls
                            for v0 in range(0, V, BLOCK_V):
                                o = v0 + o_v
                                m_o = o < V
                                idx = b * V + o
                                p = _exp(_logp_of_joint(_joint_of_y(_y(p_row, o, m_o, temperature), m_b, ls_b,
                                                                    sh_b), thr, norm), ACCURATE)
                                q = _exp(tl.load(p_qrow + idx, mask=m_o, other=float("-inf")), ACCURATE)
                                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                                t = _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec,
                                            epoch, jd, o_m)
                                res = tl.maximum(t - _div(tl.where(rank < jd, 0.0, q), den), 0.0)
                                s += tl.sum(tl.where(m_o, res, 0.0), axis=0).to(tl.float64)
                    tot = s.to(tl.float32)
                    if tot > TINY:
                        rej_vec = tl.where(o_m == jd, 1, rej_vec)
                        den_vec = tl.where(o_m == jd, den, den_vec)
                        tot_vec = tl.where(o_m == jd, tot, tot_vec)
                if valid_j:
                    q_cum += qz.to(tl.float64)

            # ---- pass 7a: drafts exhausted, one Gumbel-max draw from T (or from P minus emitted if T is empty) -----
            y_res = tl.full([], -1, tl.int64)
            if n_out < k:
                key_res = _request_key(tl.load(seed_ptr + i_r), tl.load(position_ptr + i_r), SALT_RESIDUAL)
                s = tl.zeros([], tl.float64)
                best_t = tl.full([], NEG_INF, tl.float32)
                arg_t = tl.full([], -1, tl.int64)
                best_p = tl.full([], NEG_INF, tl.float32)
                arg_p = tl.full([], -1, tl.int64)
                for b in range(0, S):
                    if _pick(live_s, o_s, b) != 0:
                        m_b = _pick(m_vec, o_s, b)
                        ls_b = _pick(ls_vec, o_s, b)
                        sh_b = _pick(sh_vec, o_s, b)
                        p_row = p_row0 + b * stride_ls
                        for v0 in range(0, V, BLOCK_V):
                            o = v0 + o_v
                            m_o = o < V
                            idx = b * V + o
                            p = _exp(_logp_of_joint(_joint_of_y(_y(p_row, o, m_o, temperature), m_b, ls_b, sh_b),
                                                    thr, norm), ACCURATE)
                            q = _exp(tl.load(p_qrow + idx, mask=m_o, other=float("-inf")), ACCURATE)
                            rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                            t = _target(p, q, rank, emitted, after_accept, dpm, rej_vec, den_vec, tot_vec, epoch, M,
                                        o_m)
                            t = tl.where(m_o, t, 0.0)
                            s += tl.sum(t, axis=0).to(tl.float64)
                            g = _gumbel(key_res, idx, ACCURATE)
                            kt = tl.where(m_o, _log(t, ACCURATE) + g, NEG_INF)
                            kp = tl.where(m_o, _log(tl.where(emitted, 0.0, p), ACCURATE) + g, NEG_INF)
                            bt = tl.max(kt, axis=0)
                            at = tl.min(tl.where(kt == bt, idx, 2**62), axis=0)
                            if (bt > best_t) | (arg_t < 0):
                                best_t = bt
                                arg_t = at
                            bp = tl.max(kp, axis=0)
                            ap = tl.min(tl.where(kp == bp, idx, 2**62), axis=0)
                            if (bp > best_p) | (arg_p < 0):
                                best_p = bp
                                arg_p = ap
                y_res = tl.where(s.to(tl.float32) > TINY, arg_t, arg_p)
                b_out = tl.where(o_k == n_out, y_res, b_out)
                n_out += 1

            # ---- pass 7b: the rest, Gumbel-top draws from P minus the emitted pairs, one pass per draw ---------------
            key_dir = _request_key(tl.load(seed_ptr + i_r), tl.load(position_ptr + i_r), SALT_DIRECT)
            prev_val = tl.full([], float("inf"), tl.float32)
            prev_idx = tl.full([], -1, tl.int64)
            for _i in range(0, KOUT):
                if n_out < k:
                    best = tl.full([], NEG_INF, tl.float32)
                    arg = tl.full([], -1, tl.int64)
                    for b in range(0, S):
                        if _pick(live_s, o_s, b) != 0:
                            m_b = _pick(m_vec, o_s, b)
                            ls_b = _pick(ls_vec, o_s, b)
                            sh_b = _pick(sh_vec, o_s, b)
                            p_row = p_row0 + b * stride_ls
                            for v0 in range(0, V, BLOCK_V):
                                o = v0 + o_v
                                m_o = o < V
                                idx = b * V + o
                                lp = _logp_of_joint(_joint_of_y(_y(p_row, o, m_o, temperature), m_b, ls_b, sh_b),
                                                    thr, norm)
                                rank, emitted = _marks(idx, z_vec, zval_vec, acc_vec, o_m, BLOCK_M)
                                emitted = emitted | (idx == y_res)
                                key = tl.where(emitted, NEG_INF, lp) + _gumbel(key_dir, idx, ACCURATE)
                                # after (prev_val, prev_idx) in the order (value descending, index ascending)
                                ok = m_o & ((key < prev_val) | ((key == prev_val) & (idx > prev_idx)))
                                key = tl.where(ok, key, NEG_INF)
                                bk = tl.max(key, axis=0)
                                ak = tl.min(tl.where(ok & (key == bk), idx, 2**62), axis=0)
                                if (ak < 2**62) & ((bk > best) | (arg < 0)):
                                    best = bk
                                    arg = ak
                    b_out = tl.where(o_k == n_out, arg, b_out)
                    n_out += 1
                    prev_val = best
                    prev_idx = arg

    m_k = o_k < KOUT
    tl.store(out_idx_ptr + i_r * stride_or + o_k, b_out, mask=m_k)
    tl.store(out_valid_ptr + i_r * stride_ovr + o_k, (o_k < k) & (temperature > 0), mask=m_k)
