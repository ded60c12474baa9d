"""Exact layer-by-layer verification of a draft forest (``docs/design/algorithm.md`` §1).

Vocabulary (per request, per layer d): P = the target joint over the valid beams V x vocab; Q = the draft joint the
layer's drafts were drawn from, without replacement, in *draw order*; K = the layer's width; an *output* is one of the K
pairs the layer emits; an output is a *draft output* when it is a forest node. The layer *passes* when every output is
a forest node; then those nodes are the next layer's valid beams.

Recursive rejection sampling, for draft j = 1, 2, ... while fewer than K outputs:
  Q_j = Q with the earlier drafts z_1..z_{j-1} removed, renormalised (the law z_j was actually drawn from);
  accept z_j with probability min(1, T(z_j) / Q_j(z_j)); T = 0 on pairs whose parent is not valid;
  reject: T <- norm(max(T - Q_j, 0));  accept: emit z_j, T <- norm(P with every emitted pair removed).
When drafts run out: one draw from T, then the rest from P minus the emitted pairs.
The k-th output is then an exact draw from P without the first k - 1 (the speculative-sampling lemma applied
recursively), so the K outputs are K draws without replacement from P. Deterministic rows (temperature 0) emit the
target's top-K (EOS excluded, EOS candidates reported) and pass when those are all forest nodes.
K is at most ``params.layer_width`` (W, or 1 for exact target sampling: then a layer emits one draw from P whatever
the number of drafts it checks, which is multi-draft speculative sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .forest import Forest
from .joint import NEG_INF, joint_logprobs
from .params import BatchParams
from .sampling import beam_step, categorical, gumbel_topk
from .width import choose_width

_TINY = 1e-30


def verify_layer(logp: torch.Tensor, draft_idx: torch.Tensor, draft_valid: torch.Tensor, logq: torch.Tensor,
                 k: torch.Tensor, key_seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One exact verification layer for R sampling requests.

    Args:
        logp:        [R, J] float32 log P, the target joint (normalised; -inf off the support).
        draft_idx:   [R, M] int64 joint indices of the drafts in draw order.
        draft_valid: [R, M] bool; a prefix of each row (the drafts that exist).
        logq:        [R, J] float32 log Q, the draft joint the drafts were drawn from without replacement.
        k:           [R] int64 outputs wanted, 0 <= k <= support of P.
        key_seed:    [R] int64 request seeds.
        position:    [R] int64 position of the layer's tokens (keys the randomness).
    Returns:
        out_idx [R, Kmax] int64 joint indices of the outputs in emission order, out_valid [R, Kmax] bool (k per row).
    """
    R, J = logp.shape
    M = draft_idx.shape[1]
    kmax = max(int(k.max()) if R else 0, 1)
    dev = logp.device
    p = torch.exp(logp)
    any_draft = bool(draft_valid.any()) if M else False
    q = torch.exp(logq) if any_draft else None  # a layer without drafts (the bonus layer) never reads Q
    t = p.clone()
    emitted = torch.zeros(R, J, dtype=torch.bool, device=dev)
    drawn = torch.zeros(R, J, dtype=torch.bool, device=dev)
    q_cum = torch.zeros(R, dtype=torch.float64, device=dev)
    n_out = torch.zeros(R, dtype=torch.int64, device=dev)
    out = torch.full((R, kmax + 1), -1, dtype=torch.int64, device=dev)  # one spare column for masked writes
    rows = torch.arange(R, device=dev)
    base = rng.key_base(key_seed, position)  # the keys of this layer's streams share their (seed, position) part
    key_acc = rng.stream_key(base, rng.Stream.ACCEPT) if any_draft else None
    for j in range(M if any_draft else 0):
        if not bool(draft_valid[:, j].any()):  # no draft in this column: an iteration would change nothing
            continue
        z = draft_idx[:, j]
        live = draft_valid[:, j] & (n_out < k)
        denom = (1.0 - q_cum).clamp(min=_TINY).float()
        qz = q.gather(1, z[:, None]).squeeze(1)
        tz = t.gather(1, z[:, None]).squeeze(1)
        u = rng.uniform(key_acc, torch.full_like(z, j))
        acc = live & (u * (qz / denom) < tz)
        rej = live & ~acc
        out[rows, torch.where(acc, n_out, kmax)] = torch.where(acc, z, -1)
        emitted[rows[acc], z[acc]] = True
        n_out = n_out + acc.long()
        # update T only on the rows concerned (row-wise arithmetic, the same as on the whole batch)
        if bool(rej.any()):
            ri = rej.nonzero().squeeze(1)
            qj = torch.where(drawn[ri], 0.0, q[ri]) / denom[ri, None]
            res = (t[ri] - qj).clamp(min=0.0)
            tot = res.sum(1, keepdim=True)
            t[ri] = torch.where(tot > _TINY, res / tot.clamp(min=_TINY), t[ri])
        # T of a row that has all its outputs is never read again (only rows with n_out < k use it): not updated
        # (with K = 1, exact target sampling, every accepting row is done)
        upd = acc & (n_out < k)
        if bool(upd.any()):
            ai = upd.nonzero().squeeze(1)
            pm = torch.where(emitted[ai], 0.0, p[ai])
            t[ai] = pm / pm.sum(1, keepdim=True).clamp(min=_TINY)
        if j + 1 < M:  # drawn and q_cum serve the later drafts only
            drawn[rows[draft_valid[:, j]], z[draft_valid[:, j]]] = True
            q_cum = q_cum + torch.where(draft_valid[:, j], qz.double(), 0.0)
    # drafts ran out: one draw from the residual T, then the rest straight from P minus the emitted pairs
    need = n_out < k
    if bool(need.any()):
        ni = need.nonzero().squeeze(1)
        tn = t[ni]
        tn = torch.where(tn.sum(1, keepdim=True) > _TINY, tn, torch.where(emitted[ni], 0.0, p[ni]))
        y = categorical(torch.log(tn), rng.stream_key(base[ni], rng.Stream.RESIDUAL))
        out[ni, n_out[ni]] = y
        emitted[ni, y] = True
        n_out[ni] += 1
    need = n_out < k
    if bool(need.any()):
        ni = need.nonzero().squeeze(1)
        rest, _ = gumbel_topk(torch.where(emitted[ni], NEG_INF, logp[ni]), kmax,
                              rng.stream_key(base[ni], rng.Stream.DIRECT))
        cols = torch.arange(kmax, device=dev)[None, :]
        src = (cols - n_out[ni, None]).clamp(0, rest.shape[1] - 1)
        fill = (cols >= n_out[ni, None]) & (cols < k[ni, None])
        out[ni, :kmax] = torch.where(fill, rest.gather(1, src), out[ni, :kmax])
    out = out[:, :kmax]
    return out, torch.arange(kmax, device=dev)[None, :] < k[:, None]


@dataclass
class LayerRecord:
    """What verification did, per request and layer (layer index 0..G; layer G+1 of the paper = the bonus layer)."""

    processed: torch.Tensor  # [R, L] bool
    width: torch.Tensor  # [R, L] int64 K of the layer
    parent: torch.Tensor  # [R, L, Wm] int64 slot of the output's parent (root slot at layer 0)
    token: torch.Tensor  # [R, L, Wm] int64
    score: torch.Tensor  # [R, L, Wm] float32 cumulative score of the output beam (see joint.py)
    valid: torch.Tensor  # [R, L, Wm] bool
    node: torch.Tensor  # [R, L, Wm] int64 forest slot (at this depth) the output is, -1 when not a forest node
    eos_done: torch.Tensor  # [R, L, Wm] bool deterministic rows: (parent slot s, EOS) finished at this layer
    eos_score: torch.Tensor  # [R, L, Wm] float32

    @staticmethod
    def empty(R: int, L: int, wm: int, S: int, dev) -> "LayerRecord":
        """Nothing processed yet: R requests, L layers, ``wm`` outputs per layer, S parent slots."""
        return LayerRecord(processed=torch.zeros(R, L, dtype=torch.bool, device=dev),
                           width=torch.zeros(R, L, dtype=torch.int64, device=dev),
                           parent=torch.zeros(R, L, wm, dtype=torch.int64, device=dev),
                           token=torch.zeros(R, L, wm, dtype=torch.int64, device=dev),
                           score=torch.full((R, L, wm), NEG_INF, device=dev),
                           valid=torch.zeros(R, L, wm, dtype=torch.bool, device=dev),
                           node=torch.full((R, L, wm), -1, dtype=torch.int64, device=dev),
                           eos_done=torch.zeros(R, L, max(S, wm), dtype=torch.bool, device=dev),
                           eos_score=torch.full((R, L, max(S, wm)), NEG_INF, device=dev))


@dataclass
class VerifyResult:
    layers: LayerRecord
    passed: torch.Tensor  # [R] int64 layers passed (accepted depth)
    last: torch.Tensor  # [R] int64 index of the last processed layer; its outputs are the new beams


def verify_forest(forest: Forest, target_logits: torch.Tensor, root_scores: torch.Tensor, root_live: torch.Tensor,
                  params: BatchParams, context_len: torch.Tensor) -> VerifyResult:
    """Verifies every request's forest, layer by layer, from the logits of ONE target pass.

    Args:
        forest:        the draft forest (G depths, Wm slots).
        target_logits: [R, G + 1, S, V] target logits at the parents of each layer: [:, 0] at the root slots,
                       [:, d] at the depth-d node slots (S = max(roots, Wm)).
        root_scores:   [R, S] float32 target scores of the live beams; root_live: [R, S] bool.
        params:        per-request settings (width, depth <= G, dynamic width, tau, min width, eos, ...).
        context_len:   [R] int64 length of the live beams (the position of the layer-0 outputs).
    """
    R, L, S, V = target_logits.shape
    G = L - 1
    dev = target_logits.device
    wm = params.facts.width_max
    kw = params.layer_width  # [R] the most outputs per layer (W, or 1 for exact target sampling)
    det = params.deterministic
    min_w = torch.minimum(params.min_width, kw)  # the dynamic width's floor
    rec = LayerRecord.empty(R, L, wm, S, dev)
    st = _Walk.start(root_live, root_scores)
    for d in range(L):
        drafted = st.alive & (d < params.depth)  # layers with drafts; d == depth is the bonus layer
        rows = st.alive & (d <= params.depth)
        if not bool(rows.any()):
            break
        pos = context_len + d
        logits = target_logits[:, d]
        logp, jscore = joint_logprobs(logits, st.scores, st.live, params)  # [R, S * V]
        didx, dval, logq = layer_drafts(forest, d, G, drafted, logp, V)
        # width: W, or the acceptance-count policy on drafted sampling layers
        support = torch.isfinite(logp).sum(1)
        k = torch.minimum(kw, support)
        pol = drafted & params.dynamic & ~det
        if bool(pol.any()) and bool((min_w[pol] == kw[pol]).all()):
            # choose_width clamps its count to [min_width, width]: with min_width = width (exact target sampling,
            # K = 1) it returns min(width, support of exp(logp)) whatever the law says; the same value without the law
            k = torch.where(pol, torch.minimum(kw, (torch.exp(logp) > 0).sum(-1)), k)
        elif bool(pol.any()):
            valid_par = torch.isfinite(logp).reshape(R, S, V).any(2)  # [R, S] parents in V
            q_masked = torch.exp(logq).reshape(R, S, V) * valid_par[:, :, None]
            kp = choose_width(torch.exp(logp), q_masked.reshape(R, S * V), dval.sum(1), kw, min_w, params.tau)
            k = torch.where(pol, kp, k)
        k = torch.where(rows, k, 0)
        out_idx = torch.zeros(R, wm, dtype=torch.int64, device=dev)
        out_val = torch.zeros(R, wm, dtype=torch.bool, device=dev)
        samp = rows & ~det
        if bool(samp.any()):
            sel = slice(None) if bool(samp.all()) else samp  # every row: the same rows without the masked copies
            oi, ov = verify_layer(logp[sel], didx[sel], dval[sel], logq[sel], k[sel], params.seed[sel], pos[sel])
            out_idx[sel, : oi.shape[1]] = oi.clamp(min=0)
            out_val[sel, : ov.shape[1]] = ov
        drow = rows & det
        if bool(drow.any()):
            bs = beam_step(logits[drow], st.scores[drow], st.live[drow],
                           params.select(drow).with_(width=kw[drow]), pos[drow], rng.Stream.DIRECT)
            out_idx[drow, : bs.parent.shape[1]] = bs.parent * V + bs.token
            out_val[drow, : bs.valid.shape[1]] = bs.valid
            rec.eos_done[drow, d, :S] = bs.eos_done
            rec.eos_score[drow, d, :S] = bs.eos_score
        st.record(rec, d, rows, drafted, out_idx, out_val & rows[:, None], didx, dval, jscore, params)
    return VerifyResult(layers=rec, passed=st.passed, last=st.last)


def layer_drafts(forest: Forest, d: int, G: int, drafted: torch.Tensor, logp: torch.Tensor,
                 V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer d's drafts as ``verify_layer`` takes them: their joint indices [R, Wm], which exist (on the ``drafted``
    rows), and log Q over the layer's joint (``logp``'s width S * V); the bonus layer (d = G) has none."""
    R, J = logp.shape
    if d < G:
        didx = forest.parent[:, d] * V + forest.token[:, d]
        dval = forest.valid[:, d] & drafted[:, None]
        logq = forest.q_joint[:, d]
        if logq.shape[1] < J:
            logq = torch.nn.functional.pad(logq, (0, J - logq.shape[1]), value=NEG_INF)
        return didx, dval, logq
    return (torch.zeros(R, 1, dtype=torch.int64, device=logp.device),
            torch.zeros(R, 1, dtype=torch.bool, device=logp.device), torch.full_like(logp, NEG_INF))


@dataclass
class _Walk:
    """Per request, layer after layer: the live beams and their scores, whether it still verifies, layers passed and
    the last processed layer."""

    live: torch.Tensor  # [R, S] bool
    scores: torch.Tensor  # [R, S] float32
    alive: torch.Tensor  # [R] bool
    passed: torch.Tensor  # [R] int64
    last: torch.Tensor  # [R] int64

    @staticmethod
    def start(root_live: torch.Tensor, root_scores: torch.Tensor) -> "_Walk":
        R, dev = root_live.shape[0], root_live.device
        return _Walk(live=root_live, scores=root_scores.float(), alive=root_live.any(1),
                     passed=torch.zeros(R, dtype=torch.int64, device=dev),
                     last=torch.zeros(R, dtype=torch.int64, device=dev))

    def record(self, rec: LayerRecord, d: int, rows: torch.Tensor, drafted: torch.Tensor, out_idx: torch.Tensor,
               out_val: torch.Tensor, didx: torch.Tensor, dval: torch.Tensor, jscore: torch.Tensor,
               params: BatchParams) -> None:
        """Records layer d's outputs (``out_idx`` joint indices, ``out_val`` which exist, on the processed ``rows``)
        and moves on: the layer passes when every output is a forest node; then its non-EOS outputs are the next
        layer's live beams."""
        R, S = self.live.shape
        V = jscore.shape[1] // S
        dev = out_idx.device
        same = (out_idx[:, :, None] == didx[:, None, :]) & dval[:, None, :] & out_val[:, :, None]
        node = torch.where(same.any(2), same.float().argmax(2), -1)  # which outputs are forest nodes
        tok = out_idx % V
        rec.processed[:, d] = rows
        rec.width[:, d] = torch.where(rows, out_val.sum(1), 0)
        rec.parent[:, d] = out_idx // V
        rec.token[:, d] = tok
        rec.score[:, d] = torch.where(out_val, jscore.gather(1, out_idx), NEG_INF)
        rec.valid[:, d] = out_val
        rec.node[:, d] = torch.where(out_val, node, -1)
        self.last = torch.where(rows, d, self.last)
        ok = drafted & ((node >= 0) | ~out_val).all(1) & out_val.any(1)
        self.passed = self.passed + ok.long()
        cont = out_val & ~((params.eos >= 0)[:, None] & (tok == params.eos[:, None]))
        slot = torch.where(cont & ok[:, None], node, S)
        new_live = torch.zeros(R, S + 1, dtype=torch.bool, device=dev).scatter(1, slot, True)[:, :S]
        new_scores = torch.full((R, S + 1), NEG_INF, device=dev).scatter(1, slot, rec.score[:, d])[:, :S]
        self.live = torch.where(ok[:, None], new_live, self.live)
        self.scores = torch.where(ok[:, None], new_scores, self.scores)
        self.alive = ok & new_live.any(1)
