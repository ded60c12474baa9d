"""Verification of chain forests (one node per depth, one output per layer) with the decisions of ``verify_forest``,
bit for bit, in a fraction of its operations.

At width 1 in mode "sample" (``max_k`` = 1) every request's forest is a chain and every layer emits one token: plain
speculative sampling along the chain (accept the draft z when u * Q(z) < P(z), else one draw from
norm(max(P - Q, 0)); the bonus layer after the last draft draws from P), or at temperature 0 the target's top-1.
``verify.verify_forest`` handles any width with well over a hundred small tensor operations per layer, a layer
record and ``outputs.iteration_outputs`` afterwards; here a layer takes a few dozen.

Why it still steps layer by layer instead of verifying every layer of every request in one stacked call: the float
operations whose results decide (the joint's normaliser, exp of P and Q, the residual's sum, the logs of the draws)
must see tensors of exactly the shapes ``verify_forest`` gives them, because CPU kernels are not invariant to the
number of rows (measured on 2 threads: ``logsumexp`` or ``sum`` of one 49152-entry row alone differs in the last bit
from the same row among others, a two-pass reduction split across threads). So each layer computes the joint of
every request, then P and Q of the same rows ``verify_layer`` gets (every row when all are sampling rows still
verifying, else those rows, by the same mask), and the draws of one layer are made together, as ``verify_layer``
makes them. What is shared across layers is exact whatever the shape (integer hashing, the uniforms' exact float
steps, comparisons); what cannot change a decision is dropped (the layer record, the width policy, which gives 1 at
K = 1, the bookkeeping for later drafts of a multi-draft layer). The joint is ``joint.joint_logprobs``'s float
operations in its order, without what is the identity with one live beam per row (the live mask; the score shift,
s - s = 0, which still adds its 0.0), and with the deterministic rows' score kept only when the batch has some.

A residual draw never lands on the rejected draft (its residual mass there is exactly 0), so it cannot pass its layer
and is made after the loop, all layers' integer noise at once; a layer whose draw could land on its draft
(``verify_layer``'s fallbacks to P when the residual has no mass) draws at once, in the loop.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import rng
from .joint import _top_k_top_p
from .params import BatchParams, HostFacts
from .verify import _TINY


@dataclass
class ChainResult:
    """Per request (Python lists, read once): what ``verify_forest`` + ``iteration_outputs`` give for a chain."""

    last: list[int]  # index of the last processed layer: the request emits its first ``last`` nodes, then ``token``
    passed: list[int]  # layers passed (an accepted EOS node passes its layer and ends the chain)
    token: list[int]  # the last processed layer's output token


def verify_chains(logits: torch.Tensor, src: torch.Tensor, token: torch.Tensor, valid: torch.Tensor,
                  q_joint: torch.Tensor, params: BatchParams, context_len: torch.Tensor) -> ChainResult | None:
    """Verifies R chains from the logits of one target pass: ``verify_forest`` at width 1 and ``max_k`` = 1.

    Args:
        logits:  [N, V] float32 target logits rows.
        src:     [R, G + 1] int64 row of ``logits`` at the parent of layer d (d = 0: the root; d >= 1: after the
                 depth-d node); any row where that node is not valid (never read).
        token:   [R, G] int64 node token at depth d + 1; valid: [R, G] bool.
        q_joint: [R, G, V] float32 log Q of each depth, laid out as ``verify_forest`` gets it (``sampler.verify``
                 concatenates the requests' forests): its layer views are what the exp of Q runs over.
        params:  width 1, ``max_k`` 1 (exact target sampling); depth <= G per request.
        context_len: [R] int64 position of the layer-0 token.
    Returns:
        the per-request results, or None when a processed row has no finite target log-probability (NaN logits):
        ``verify_forest`` emits nothing there, which the caller's general path then reports.
    """
    R, L = src.shape
    G = L - 1
    dev = logits.device
    c = _Setup.of(params, token, valid, context_len, L)
    det, sampling, greedy = c.det, c.sampling, c.greedy  # c.base, c.coin: computed when a row draws
    st = _Progress.start(R, dev)
    later = []  # (layer, rows, T) of the draws made after the loop
    for d in range(L):
        rows = st.alive & c.in_depth[:, d]
        if not bool(rows.any()):
            break
        logp = c.logp(logits[src[:, d]], st.s)
        z, dval = c.z_all[:, d], c.has_draft[:, d] & st.alive
        out = z.clone()
        samp = rows & sampling if greedy else rows
        passes = None
        if bool(samp.any()):
            every = bool(samp.all())
            take = (lambda t: t) if every else (lambda t: t[samp])
            got = _layer(take(logp), take(z), take(dval), take(c.coin[:, d]) if d < G else None,
                         q_joint[:, d] if d < G else None,
                         None if every else samp)
            if got is None:
                return None
            acc, need, tn, now = got
            if every:
                passes, at = acc, need
            else:
                idx = samp.nonzero().squeeze(1)
                passes = torch.zeros(R, dtype=torch.bool, device=dev).index_put_((idx,), acc)
                at = idx[need]  # the rows that draw, in batch order
            if now:  # the draw may land on the draft: made now, and it passes the layer when it does
                y = _draw([tn], rng.stream_key(c.base[at, d], rng.Stream.RESIDUAL))[0]
                out[at] = y
                passes[at] = y == z[at]
            elif at.numel():
                later.append((d, at, tn))
        if greedy:
            passes = torch.zeros(R, dtype=torch.bool, device=dev) if passes is None else passes
            drow = rows & det
            if bool(drow.any()):  # beam_step's top-1 (single-beam rows: EOS is an ordinary token there)
                vals, idx = torch.topk(logp[drow], 1, dim=-1)
                if not bool(torch.isfinite(vals).all()):
                    return None
                out[drow] = idx[:, 0]
                passes[drow] = idx[:, 0] == z[drow]
        st.advance(c, d, rows, dval & passes, out, logp)
    if later:
        at = torch.cat([a for _, a, _ in later])
        lay = torch.cat([torch.full_like(a, d) for d, a, _ in later])
        keys = rng.stream_key(c.base[at, lay], rng.Stream.RESIDUAL)
        st.final[at] = torch.cat(_draw([t for _, _, t in later], keys))
    last_l, passed_l, token_l = torch.stack([st.last, st.passed, st.final]).tolist()  # one copy to the host
    return ChainResult(last=last_l, passed=passed_l, token=token_l)


def greedy_roots(logits: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_chains` (or ``chain_static``) at L = 1 (no request has a draft) when every request is
    deterministic: each request's top-1 of its root row's joint, by the same float operations (``_Setup.logp`` with
    temperature 1 and score 0, then ``topk``). logits: [N, V]; first: [R] int64 root rows. Returns (value, token), [R]
    each; a value that is not finite is a row the chain cores decline."""
    R, V = first.shape[0], logits.shape[1]
    joint = torch.log_softmax(logits[first].float()[:, None], dim=-1).reshape(R, V) + 0.0  # T = 1: x / 1 is x
    vals, idx = torch.topk(joint - (-0.0), 1, dim=-1)  # the score shift of a deterministic row, s = 0
    return vals[:, 0], idx[:, 0]


@dataclass
class _Setup:
    """What both chain paths (this module's and ``chain_static``'s) prepare once per call."""

    greedy: bool  # some row is deterministic: those rows need their beam's score (and the general joint's masks)
    truncated: bool  # some sampling row uses top-k or top-p
    facts: HostFacts
    det: torch.Tensor  # [R] bool
    sampling: torch.Tensor  # [R] bool
    temp: torch.Tensor  # [R, 1, 1] (1 on deterministic rows)
    top_k: torch.Tensor  # [R] (0 on deterministic rows)
    top_p: torch.Tensor  # [R] (1 on deterministic rows)
    in_depth: torch.Tensor  # [R, L] layer d is processed (if alive)
    has_draft: torch.Tensor  # [R, L] layer d has a draft
    z_all: torch.Tensor  # [R, L] the draft token of layer d (0 on the bonus layer)
    eos: torch.Tensor  # [R] the EOS id, -1 (never a token) when there is none
    seed: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R, L] int64 the position of layer d's token (context_len + d)

    @functools.cached_property
    def base(self) -> torch.Tensor:  # [R, L] the key base of layer d's random streams (only when a row draws)
        return rng.key_base(self.seed[:, None], self.positions)

    @functools.cached_property
    def coin(self) -> torch.Tensor:  # [R, L] the acceptance uniform of layer d's draft (only where there are drafts)
        # keys and acceptance coins of every layer at once (integer hashing and exact float steps: the bits of the
        # per-layer calls of verify_layer on any subset of rows)
        return rng.uniform(rng.stream_key(self.base, rng.Stream.ACCEPT), torch.zeros_like(self.base))

    @staticmethod
    def of(params: BatchParams, token: torch.Tensor, valid: torch.Tensor, context_len: torch.Tensor,
           L: int) -> "_Setup":
        det, facts = params.deterministic, params.facts  # facts: host values (no read of a device tensor)
        sampling = ~det
        if facts.any_deterministic:
            temp = torch.where(det, torch.ones_like(params.temperature), params.temperature)
            top_k, top_p = torch.where(sampling, params.top_k, 0), torch.where(sampling, params.top_p, 1.0)
        else:  # the same tensors' values
            temp, top_k, top_p = params.temperature, params.top_k, params.top_p
        layers = torch.arange(L, device=token.device)
        return _Setup(
            greedy=facts.any_deterministic, truncated=facts.top_k_max > 0 or facts.any_top_p, facts=facts, det=det,
            sampling=sampling, temp=temp[:, None, None], top_k=top_k, top_p=top_p,
            in_depth=layers[None, :] <= params.depth[:, None],
            has_draft=torch.nn.functional.pad(valid, (0, 1)) & (layers[None, :] < params.depth[:, None]),
            z_all=torch.nn.functional.pad(token, (0, 1)), eos=torch.where(params.eos >= 0, params.eos, -1),
            seed=params.seed, positions=context_len[:, None] + layers)

    def logp(self, rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``joint.joint_logprobs`` of every row with its one live beam (score s: s - s = 0 on the joint), from the
        layer's logits rows [R, V]."""
        R, V = rows.shape
        joint = torch.log_softmax(rows.float()[:, None] / self.temp, dim=-1).reshape(R, V) + 0.0
        if self.truncated:
            joint = _top_k_top_p(joint, self.top_k, self.top_p, self.facts.top_k_max, self.facts.any_top_p)
        if self.facts.all_deterministic:  # the where below takes -s on every row: no normaliser to compute
            return joint - (-s)
        norm = torch.logsumexp(joint, dim=-1, keepdim=True)
        if self.greedy:
            return joint - torch.where(self.sampling[:, None] & torch.isfinite(norm), norm, -s)
        return joint - norm  # the same on every row with a finite norm (the others are NaN either way: declined)


@dataclass
class _Progress:
    """Per request, layer after layer: the beam's score (deterministic rows), whether it still verifies, layers
    passed, the last processed layer and its output."""

    s: torch.Tensor
    alive: torch.Tensor
    passed: torch.Tensor
    last: torch.Tensor
    final: torch.Tensor

    @staticmethod
    def start(R: int, dev) -> "_Progress":
        i64 = dict(dtype=torch.int64, device=dev)
        return _Progress(s=torch.zeros(R, 1, device=dev), alive=torch.ones(R, dtype=torch.bool, device=dev),
                         passed=torch.zeros(R, **i64), last=torch.zeros(R, **i64), final=torch.zeros(R, **i64))

    def advance(self, c: _Setup, d: int, rows: torch.Tensor, ok: torch.Tensor, out: torch.Tensor,
                logp: torch.Tensor) -> None:
        """Layer d processed ``rows``; ``ok``: they passed it (their output is their draft), ``out``: the output."""
        self.passed += ok
        self.last = torch.where(rows, d, self.last)
        self.final = torch.where(rows, out, self.final)
        if c.greedy:
            self.s = torch.where(ok[:, None], logp.gather(1, out[:, None]), self.s)
        self.alive = ok & (out != c.eos)


def _layer(logp: torch.Tensor, z: torch.Tensor, dval: torch.Tensor, coin: torch.Tensor | None,
           logq: torch.Tensor | None, sel: torch.Tensor | None):
    """``verify_layer`` with k = 1 and at most one draft per row, on its n sampling rows (``sel`` their mask over the
    batch, None: every row). logp: [n, V]; z, dval, coin: [n] draft token, whether there is one, acceptance uniform;
    logq: [R, V] log Q of the layer (None: no drafts). Returns (accepted [n], need [m] int64 rows of the n that draw,
    T [m, V] what they draw from, whether a draw may land on its draft) or None on a row without finite log P."""
    p = torch.exp(logp)
    if logq is not None and bool(dval.any()):
        q = torch.exp(logq if sel is None else logq[sel])
        zi = z[:, None]
        hit = (coin[:, None] * q.gather(1, zi) < p.gather(1, zi)).squeeze(1)  # u * (qz / (1 - 0)) < T(z) = P(z)
        acc = dval & hit
        ri = (dval & ~hit).nonzero().squeeze(1)  # rejected
    else:
        acc = torch.zeros_like(dval)
        ri = acc.nonzero().squeeze(1)
    need = (~acc).nonzero().squeeze(1)
    m, now = need.numel(), False
    if not m:
        return acc, need, None, now
    pn = p[need]
    tn = pn
    if ri.numel():
        # the residual after a rejected draft: norm(max(P - Q, 0)), or P where it has no mass (all rows at once)
        pr = pn if ri.numel() == m else p[ri]  # every row that draws was rejected: the same rows
        res = (pr - q[ri]).clamp(min=0.0)
        tot = res.sum(1, keepdim=True)
        good = tot > _TINY
        tr = torch.where(good, res / tot, pr)  # verify_layer divides by tot.clamp(min=_TINY): tot where it is used
        if ri.numel() == m:
            tn = tr
        else:
            tn = pn.clone()
            tn[dval[need]] = tr  # the rejected rows among those that draw (the others have no draft)
        now = not bool(good.all())  # a fallback to P: the draw may hit the draft
    full = tn.sum(1, keepdim=True) > _TINY
    if not bool(full.all()):
        if bool(torch.isnan(tn).any()):  # a row without finite log P: verify_forest gives it no output (k = 0)
            return None
        tn = torch.where(full, tn, pn)
        now = True
    return acc, need, tn, now


def _draw(ts: list[torch.Tensor], keys: torch.Tensor) -> list[torch.Tensor]:
    """``sampling.categorical(log T, key)`` of each group of rows in ``ts`` ([m_i, V]; ``keys`` [sum m_i], in the same
    order): the integer noise of all groups at once, its logs and the argmax group by group (the shapes
    ``verify_layer`` uses)."""
    g = rng.gumbel(keys, ts[0].shape[1])  # row by row the noise categorical draws
    out, a = [], 0
    for t in ts:
        out.append(torch.argmax(torch.log(t) + g[a : a + t.shape[0]], dim=-1))
        a += t.shape[0]
    return out
