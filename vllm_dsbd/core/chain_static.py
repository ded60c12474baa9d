"""Chain verification with static shapes and no host synchronisation: ``chain.verify_chains``'s decisions, computed on
every row and every layer with masks instead of row subsets and early exits.

``chain.verify_chains`` steps through the layers on the rows still verifying (``nonzero`` subsets, ``bool(any())``
branches): each branch and each data-dependent shape makes the host wait for a GPU. Here every layer runs on all R
rows, whether or not a row still verifies, and what a row does not need is masked away; the results stay on the
device, with a flag for the rows the chain core would decline (NaN logits). The caller reads them in one copy. Fixed
shapes and no reads on the host also make the computation capturable in a CUDA graph (not done yet).

Why the decisions are the chain core's (``tests/method/test_verify_chain.py`` compares both with the general path):
- the joint, its normaliser, P and Q are the same operations on the same rows (the chain core already computes the
  joint on every row); exp, log, the uniforms and the Gumbel keys are element-wise and exact per entry, argmax and
  top-1 are exact;
- a residual draw is made on every row and every layer, with the key of its (request, layer), and used where the chain
  core makes it: a row that rejects its draft, or has none. Drawing now or after the loop gives the same token (the
  same T row and key). A residual draw lands on the rejected draft only where the residual has no mass there, which
  is when the chain core draws at once and lets the draw pass the layer; elsewhere the draft's residual is exactly 0
  (log 0 = -inf) and the draw cannot be it. So ``passes = accepted | (draw == draft)`` is the chain core's rule;
- the only operations whose rounding can depend on the number of rows are the residual's row sum and the check that
  T has mass (sums over V). On one thread, and on any number of threads for two or more rows, a CPU row sum does not
  depend on the other rows (measured; a lone row on two threads can differ in the last bit); a 1-ulp difference of a
  normaliser moves a decision only when a Gumbel race is tied within that ulp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .chain import _Progress, _Setup
from .params import BatchParams
from .verify import _TINY


@dataclass
class ChainTensors:
    """Per request, on the logits' device: what ``chain.ChainResult`` holds, plus whether the chain core declines."""

    last: torch.Tensor  # [R] int64 index of the last processed layer
    passed: torch.Tensor  # [R] int64 layers passed
    token: torch.Tensor  # [R] int64 the last processed layer's output token
    declined: torch.Tensor  # [R] bool a processed row without finite target log-probabilities


def verify_chains_static(logits: torch.Tensor, src: torch.Tensor, token: torch.Tensor, valid: torch.Tensor,
                         q_joint: torch.Tensor, params: BatchParams, context_len: torch.Tensor) -> ChainTensors:
    """``chain.verify_chains`` (same arguments) without reading a tensor on the host; the rows it would decline are
    flagged (``declined.any()``: the general path must decide the step). ``src`` must hold a valid row of ``logits``
    everywhere (any row where the node is not valid): every layer reads every row."""
    R, L = src.shape
    G = L - 1
    V = logits.shape[1]
    dev = logits.device
    c = _Setup.of(params, token, valid, context_len, L)
    draws = not c.facts.all_deterministic  # every row deterministic: no row draws (its top-1 decides)
    residual_key = rng.stream_key(c.base, rng.Stream.RESIDUAL) if draws else None
    st = _Progress.start(R, dev)
    declined = torch.zeros(R, dtype=torch.bool, device=dev)
    for d in range(L):
        rows = st.alive & c.in_depth[:, d]
        logp = c.logp(logits[src[:, d]], st.s)
        z, dval = c.z_all[:, d], c.has_draft[:, d] & st.alive
        if not draws:  # out and passes are the top-1's on every row (below)
            out, passes = z, torch.zeros_like(dval)
        else:
            out, passes = _draw_layer(c, d, G, logp, q_joint, z, dval, rows, residual_key, declined, V)
        if c.greedy:
            vals, idx = torch.topk(logp, 1, dim=-1)
            declined |= rows & c.det & ~torch.isfinite(vals[:, 0])
            out = torch.where(c.det, idx[:, 0], out)
            passes = torch.where(c.det, idx[:, 0] == z, passes)
        st.advance(c, d, rows, dval & passes, out, logp)
    return ChainTensors(last=st.last, passed=st.passed, token=st.final, declined=declined)


def _draw_layer(c: _Setup, d: int, G: int, logp: torch.Tensor, q_joint: torch.Tensor, z: torch.Tensor,
                dval: torch.Tensor, rows: torch.Tensor, residual_key: torch.Tensor, declined: torch.Tensor,
                V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer d's sampling decisions on every row: (output, passes); ``declined`` is updated in place."""
    zi = z[:, None]
    p = torch.exp(logp)
    if d < G:
        q = torch.exp(q_joint[:, d])
        hit = (c.coin[:, d, None] * q.gather(1, zi) < p.gather(1, zi)).squeeze(1)
        acc = dval & hit
        res = (p - q).clamp(min=0.0)
        tot = res.sum(1, keepdim=True)
        tr = torch.where(tot > _TINY, res / tot, p)
        tn = torch.where((dval & ~hit)[:, None], tr, p)  # rejected: the residual; no draft: P
    else:
        acc = torch.zeros_like(dval)
        tn = p
    samp = rows & c.sampling
    declined |= samp & ~acc & torch.isnan(tn).any(1)  # the chain core's decline: a row that draws, NaN in T
    tn = torch.where(tn.sum(1, keepdim=True) > _TINY, tn, p)  # no mass left: P
    y = torch.argmax(torch.log(tn) + rng.gumbel(residual_key[:, d], V), dim=-1)
    return torch.where(acc, z, y), acc | (y == z)
