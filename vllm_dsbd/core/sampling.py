"""One step of beam sampling (or deterministic beam search) over the joint: the baseline's step and the draft's step.

Sampling rows draw W (beam, token) pairs WITHOUT replacement from P, in draw order, with Gumbel-top-W on log P (the
k-th largest perturbed key is distributed as the k-th sequential draw without replacement). Deterministic rows take
the top-W of the joint; in full-width mode EOS is excluded and EOS candidates are reported separately, as vLLM's
``LLM.beam_search`` does: (b, EOS) finishes when EOS is among beam b's top 2W tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .joint import NEG_INF, joint_logprobs, next_token_logprobs
from .params import BatchParams


@dataclass
class BeamStep:
    """Result of one beam step for R requests; Wm = max width of the batch, S = beam slots in, V = vocab."""

    parent: torch.Tensor  # [R, Wm] int64 beam slot of each drawn pair, in draw order
    token: torch.Tensor  # [R, Wm] int64
    score: torch.Tensor  # [R, Wm] float32 new beam score (log P of the pair)
    valid: torch.Tensor  # [R, Wm] bool, the first min(width, support) columns
    joint: torch.Tensor  # [R, S * V] float32 log P the pairs were drawn from (= scores on deterministic rows)
    eos_done: torch.Tensor  # [R, S] bool deterministic rows: (b, EOS) finishes
    eos_score: torch.Tensor  # [R, S] float32 its score

    @property
    def vocab(self) -> int:
        return self.joint.shape[1] // self.eos_done.shape[1]


def gumbel_topk(logp: torch.Tensor, k: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from softmax(logp) per row, in draw order. logp [R, J], key [R] int64.

    Returns (index [R, k] int64, valid [R, k] bool); a column is invalid when the support has fewer entries."""
    keys = logp + rng.gumbel(key, logp.shape[1])
    vals, idx = torch.topk(keys, min(k, logp.shape[1]), dim=-1)
    return idx, torch.isfinite(vals)


def categorical(logp: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One draw per row from softmax(logp) (Gumbel-max). logp [R, J] -> [R] int64."""
    return torch.argmax(logp + rng.gumbel(key, logp.shape[1]), dim=-1)


def beam_step(logits: torch.Tensor, scores: torch.Tensor, live: torch.Tensor, params: BatchParams,
              position: torch.Tensor, stream: rng.Stream) -> BeamStep:
    """One step of beam sampling / beam search for every request of a batch.

    Args:
        logits:   [R, S, V] next-token logits at the S beam slots.
        scores:   [R, S] float32 scores of the beams.
        live:     [R, S] bool live beams.
        params:   per-request settings (temperature 0 = deterministic); width W_r draws.
        position: [R] int64 sequence position of the new tokens (keys the randomness).
        stream:   which random stream (target baseline or draft).
    """
    R, S, V = logits.shape
    facts = params.facts  # host values: no read of a device tensor
    wm = facts.width_max
    joint, score = joint_logprobs(logits, scores, live, params)
    det = params.deterministic
    # vLLM's beam-search EOS rule applies to full-width deterministic rows; single-beam rows treat EOS like any
    # token, so that W = 1 at temperature 0 is plain greedy decoding.
    has_eos = (params.eos >= 0) & ~params.single
    eos_col = params.eos.clamp(min=0)
    eos_done = torch.zeros(R, S, dtype=torch.bool, device=logits.device)
    eos_score = torch.full((R, S), NEG_INF, device=logits.device)
    keys = joint
    if facts.any_eos_rule:  # some row of det & has_eos
        lp = next_token_logprobs(logits, params)  # [R, S, V]
        lp_eos = lp.gather(2, eos_col[:, None, None].expand(R, S, 1)).squeeze(2)
        rank = (lp > lp_eos[:, :, None]).sum(-1)  # tokens strictly better than EOS
        eos_done = (det & has_eos)[:, None] & live & (rank < 2 * params.width[:, None])
        eos_score = torch.where(eos_done, scores.float() + lp_eos, NEG_INF)
        cols = (torch.arange(S, device=logits.device) * V)[None, :] + eos_col[:, None]  # [R, S]
        masked = joint.scatter(1, cols, NEG_INF)
        keys = torch.where((det & has_eos)[:, None], masked, joint)
    if not facts.all_deterministic:
        g = rng.gumbel(rng.request_key(params.seed, position, stream), S * V)
        keys = torch.where(det[:, None], keys, keys + g)
    vals, idx = torch.topk(keys, min(wm, S * V), dim=-1)
    valid = torch.isfinite(vals) & (torch.arange(idx.shape[1], device=idx.device)[None, :] < params.width[:, None])
    return BeamStep(parent=idx // V, token=idx % V, score=score.gather(1, idx), valid=valid, joint=joint,
                    eos_done=eos_done, eos_score=eos_score)
