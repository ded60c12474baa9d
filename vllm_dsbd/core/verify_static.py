"""``verify.verify_layer`` with static shapes and no host synchronisation: the same layer, every row and every draft
column computed under masks instead of row subsets and early exits.

``verify_layer`` reads the device at its data-dependent branches (``int(k.max())``, whether a draft column has any
draft, whether any row rejected, accepted or still needs a draw, the ``nonzero`` subsets): on a GPU each waits for
the device. Here the number of output columns comes from the caller as a host bound (``kmax``), and every update is
computed on every row and kept where ``verify_layer`` makes it:

- a draft column without any draft changes nothing in ``verify_layer`` (it skips it); here its rows are not live, so
  nothing is accepted or rejected, and ``drawn`` / ``q_cum`` gain nothing from it;
- the residual update of the rejecting rows, the reset to P minus the emitted pairs of the accepting rows that want
  more outputs, the residual draw of the rows still short of K after the drafts, and the direct draws after it: each
  is the same element-wise arithmetic on the same row, computed on all rows and selected by the row's mask; the
  random keys are per row (counter-based), so a row's draw does not depend on the other rows;
- ``kmax`` may exceed ``max(k)``: the extra columns are invalid, and the direct draws' top-``kmax`` has the same first
  columns as a top-``max(k)`` (Gumbel-perturbed keys, distinct with probability one).

The only operations whose rounding may depend on the number of rows are the row sums over the joint (the residual's
normaliser, the reset's, the check that T has mass): on a CPU a row sum of a lone long row on 2 threads can differ in
the last bit from the same row among others (``docs/notebook``); with one row (a beam request's layer) the rows are the same
and the results are bit for bit ``verify_layer``'s. ``tests/method/test_verify_static.py`` compares the two.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import rng
from .forest import Forest
from .joint import NEG_INF, joint_logprobs
from .params import BatchParams
from .sampling import beam_step, categorical, gumbel_topk
from .verify import _TINY, LayerRecord, VerifyResult, _Walk, layer_drafts


def verify_layer_static(logp: torch.Tensor, draft_idx: torch.Tensor, draft_valid: torch.Tensor, logq: torch.Tensor,
                        k: torch.Tensor, key_seed: torch.Tensor, position: torch.Tensor,
                        kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify.verify_layer`` (same arguments, same results) with ``kmax`` >= max(k), a host value, and no read of
    a tensor on the host. Draft indices where ``draft_valid`` is False may be anything in ``[0, J)``.
    Returns out_idx [R, max(kmax, 1)] int64, out_valid [R, max(kmax, 1)] bool (k per row)."""
    R, J = logp.shape
    M = draft_idx.shape[1]
    kmax = max(kmax, 1)
    dev = logp.device
    p = torch.exp(logp)
    q = torch.exp(logq) if M else None
    t = p.clone()
    emitted = torch.zeros(R, J, dtype=torch.bool, device=dev)
    drawn = torch.zeros(R, J, dtype=torch.bool, device=dev)
    q_cum = torch.zeros(R, dtype=torch.float64, device=dev)
    n_out = torch.zeros(R, dtype=torch.int64, device=dev)
    out = torch.full((R, kmax + 1), -1, dtype=torch.int64, device=dev)  # one spare column for masked writes
    rows = torch.arange(R, device=dev)
    base = rng.key_base(key_seed, position)
    key_acc = rng.stream_key(base, rng.Stream.ACCEPT)
    for j in range(M):
        z = draft_idx[:, j].clamp(0, J - 1)
        valid = draft_valid[:, j]
        live = valid & (n_out < k)
        denom = (1.0 - q_cum).clamp(min=_TINY).float()
        qz = q.gather(1, z[:, None]).squeeze(1)
        tz = t.gather(1, z[:, None]).squeeze(1)
        u = rng.uniform(key_acc, torch.full_like(z, j))
        acc = live & (u * (qz / denom) < tz)
        rej = live & ~acc
        out[rows, torch.where(acc, n_out, kmax)] = torch.where(acc, z, -1)
        emitted[rows, z] |= acc
        n_out = n_out + acc.long()
        # rejecting rows: T <- norm(max(T - Q_j, 0)) where it has mass
        qj = torch.where(drawn, 0.0, q) / denom[:, None]
        res = (t - qj).clamp(min=0.0)
        tot = res.sum(1, keepdim=True)
        t = torch.where(rej[:, None], torch.where(tot > _TINY, res / tot.clamp(min=_TINY), t), t)
        # accepting rows that want more outputs: T <- P without the emitted pairs, renormalised
        pm = torch.where(emitted, 0.0, p)
        upd = acc & (n_out < k)
        t = torch.where(upd[:, None], pm / pm.sum(1, keepdim=True).clamp(min=_TINY), t)
        if j + 1 < M:
            drawn[rows, z] |= valid
            q_cum = q_cum + torch.where(valid, qz.double(), 0.0)
    # drafts ran out: one draw from the residual T (P minus the emitted pairs where T has no mass) ...
    need = n_out < k
    tn = torch.where(t.sum(1, keepdim=True) > _TINY, t, torch.where(emitted, 0.0, p))
    y = categorical(torch.log(tn), rng.stream_key(base, rng.Stream.RESIDUAL))
    out[rows, torch.where(need, n_out, kmax)] = torch.where(need, y, -1)
    emitted[rows, y] |= need
    n_out = n_out + need.long()
    # ... then the rest straight from P minus the emitted pairs
    need = n_out < k
    rest, _ = gumbel_topk(torch.where(emitted, NEG_INF, logp), kmax, rng.stream_key(base, rng.Stream.DIRECT))
    cols = torch.arange(kmax, device=dev)[None, :]
    src = (cols - n_out[:, None]).clamp(0, rest.shape[1] - 1)
    fill = need[:, None] & (cols >= n_out[:, None]) & (cols < k[:, None])
    out = torch.where(fill, rest.gather(1, src), out[:, :kmax])
    return out, cols < k[:, None]


def verify_forest_static(forest: Forest, target_logits: torch.Tensor, root_scores: torch.Tensor,
                         root_live: torch.Tensor, params: BatchParams, context_len: torch.Tensor,
                         layer=None) -> VerifyResult:
    """``verify.verify_forest`` (same arguments, same results) for exact target sampling (every request's
    ``max_k`` = 1: one output per layer, the engine's mode "sample"), with no read of a tensor on the host: every
    layer runs on every row (a row that stopped verifying has no outputs there, as in ``verify_forest``), the width
    rule's two branches are computed and selected per row, the sampling rows' layer is ``verify_layer_static`` with
    ``kmax`` = 1 (not run when the batch has none: a host fact) and the deterministic rows' top-1 is ``beam_step`` on
    every row (when the batch has some).
    ``layer``: a callable making the sampling rows' layer from the logits instead (the engine's fused kernel,
    ``engine/fused.py``: ``layer(logits, scores, live, params, position, draft_idx, draft_valid, logq, k, kmax)``
    -> ``(out_idx, out_valid)``, the same decisions)."""
    R, L, S, V = target_logits.shape
    G = L - 1
    facts = params.facts
    kw = params.layer_width  # [R] 1 for every row (max_k = 1)
    det = params.deterministic
    rec = LayerRecord.empty(R, L, facts.width_max, S, target_logits.device)
    # the deterministic rows' beam step takes K = 1 pairs (``verify_forest`` passes width = kw, whose maximum is 1)
    top1 = params.with_(width=kw, facts=replace(facts, width_max=1)) if facts.any_deterministic else None
    st = _Walk.start(root_live, root_scores)
    for d in range(L):
        drafted = st.alive & (d < params.depth)
        rows = st.alive & (d <= params.depth)
        pos = context_len + d
        logits = target_logits[:, d]
        logp, jscore = joint_logprobs(logits, st.scores, st.live, params)
        didx, dval, logq = layer_drafts(forest, d, G, drafted, logp, V)
        # width: min(W, support); on drafted sampling rows with the policy on, choose_width's value at
        # min_width = width (K = 1): min(W, entries of exp(log P) above 0)
        k = torch.minimum(kw, torch.isfinite(logp).sum(1))
        pol = drafted & params.dynamic & ~det
        k = torch.where(pol, torch.minimum(kw, (torch.exp(logp) > 0).sum(-1)), k)
        k = torch.where(rows, k, 0)
        samp = rows & ~det
        ks = torch.where(samp, k, 0)
        if facts.all_deterministic:  # no sampling row (a host fact): its layer would output nothing (k = 0 everywhere)
            oi = torch.zeros(R, 1, dtype=torch.int64, device=logits.device)
            ov = torch.zeros(R, 1, dtype=torch.bool, device=logits.device)
        elif layer is not None:
            oi, ov = layer(logits, st.scores, st.live, params, pos, didx, dval, logq, ks, 1)
        else:
            oi, ov = verify_layer_static(logp, didx, dval, logq, ks, params.seed, pos, 1)
        out_idx = torch.nn.functional.pad(oi.clamp(min=0), (0, facts.width_max - 1))
        out_val = torch.nn.functional.pad(ov, (0, facts.width_max - 1))
        if top1 is not None:
            drow = rows & det
            bs = beam_step(logits, st.scores, st.live, top1, pos, rng.Stream.DIRECT)
            out_idx[:, :1] = torch.where(drow[:, None], bs.parent * V + bs.token, out_idx[:, :1])
            out_val[:, :1] = torch.where(drow[:, None], bs.valid, out_val[:, :1])
            rec.eos_done[:, d, :S] = torch.where(drow[:, None], bs.eos_done, rec.eos_done[:, d, :S])
            rec.eos_score[:, d, :S] = torch.where(drow[:, None], bs.eos_score, rec.eos_score[:, d, :S])
        st.record(rec, d, rows, drafted, out_idx, out_val & rows[:, None], didx, dval, jscore, params)
    return VerifyResult(layers=rec, passed=st.passed, last=st.last)
