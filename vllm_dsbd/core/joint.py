"""The joint (beam, token) distribution of beam sampling, with temperature and top-k / top-p over the flattened joint.

For a request with live beams b (score s_b) and next-token logits l_b, the joint score of (b, x) is
    score(b, x) = s_b + log softmax(l_b / T)[x]          (the new beam's score: cumulative log-probability at T)
and log P(b, x) = score(b, x) after top-k / top-p over all (b, x), renormalised over the joint.
Beam scores stay cumulative (unnormalised): P is unchanged by a constant shared by all beams, and a cumulative score
is what the final length-normalised choice needs (the authors' normalised log P forgets history: at W = 1 it is the
last token's log-probability). At temperature 0 (deterministic beam search) T = 1 in the score, top-k / top-p do not
apply and log P = score, as in vLLM's ``LLM.beam_search``. Joint index of (b, x) is b * V + x.
"""
from __future__ import annotations

import torch

from .params import BatchParams

NEG_INF = float("-inf")


def next_token_logprobs(logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
    """log softmax(l / T) per row; T = 1 for deterministic requests. logits [R, S, V] -> float32 [R, S, V]."""
    t = torch.where(params.deterministic, torch.ones_like(params.temperature), params.temperature)
    return torch.log_softmax(logits.float() / t[:, None, None], dim=-1)


def joint_logprobs(logits: torch.Tensor, scores: torch.Tensor, live: torch.Tensor,
                   params: BatchParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint log P and joint score over (beam, token).

    Args:
        logits: [R, S, V] next-token logits at each of S beam slots.
        scores: [R, S] float32 beam scores (ignored where not live).
        live:   [R, S] bool, the beams that take part.
        params: per-request settings.
    Returns:
        (log P, score), both [R, S * V] float32 and -inf outside the support: log P normalised (sampling rows) or
        equal to the score (deterministic rows); score = s_b + log p(x | b), the cumulative score of the new beam.
    """
    R, S, V = logits.shape
    lp = next_token_logprobs(logits, params)
    s = scores.float()
    top = torch.where(live, s, NEG_INF).max(1, keepdim=True).values
    shift = torch.where(torch.isfinite(top), top, 0.0)  # keeps the normalisation accurate for long sequences
    joint = torch.where(live[:, :, None], (s - shift)[:, :, None] + lp, NEG_INF).reshape(R, S * V)
    sampling = ~params.deterministic
    facts = params.facts
    joint = _top_k_top_p(joint, torch.where(sampling, params.top_k, 0), torch.where(sampling, params.top_p, 1.0),
                         facts.top_k_max, facts.any_top_p)
    score = joint + shift
    norm = torch.logsumexp(joint, dim=-1, keepdim=True)
    norm = torch.where(sampling[:, None] & torch.isfinite(norm), norm, -shift)
    return joint - norm, score


def _top_k_top_p(joint: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, top_k_max: int | None = None,
                 any_top_p: bool | None = None) -> torch.Tensor:
    """Masks [R, J] log-weights to the top-k entries, then to the smallest top set holding mass >= top_p.

    Ties at a threshold are all kept. Rows with top_k = 0 / top_p = 1 are untouched. Sorts only when needed.
    ``top_k_max`` (= max of top_k) and ``any_top_p`` (= any top_p < 1), when given, are those values known on the
    host: the branches then read no tensor (no host synchronisation on a device)."""
    use_k = top_k > 0
    if top_k_max is None:
        top_k_max = int(top_k.max()) if bool(use_k.any()) else 0
    if top_k_max > 0:
        kmax = top_k_max
        vals = torch.topk(joint, min(kmax, joint.shape[1]), dim=-1).values  # [R, kmax]
        kth = vals.gather(1, (top_k.clamp(1, vals.shape[1]) - 1)[:, None])
        joint = torch.where(use_k[:, None] & (joint < kth), NEG_INF, joint)
    use_p = top_p < 1.0
    if any_top_p if any_top_p is not None else bool(use_p.any()):
        srt = torch.sort(joint, dim=-1, descending=True).values  # [R, J]
        probs = torch.softmax(srt, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each sorted entry
        keep = before < top_p[:, None]
        keep[:, 0] = True
        # smallest kept value is the threshold
        last = keep.sum(dim=-1, keepdim=True) - 1
        thr = srt.gather(1, last)
        joint = torch.where(use_p[:, None] & (joint < thr), NEG_INF, joint)
    return joint
