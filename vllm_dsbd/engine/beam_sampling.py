"""The device work of beam sampling (T > 0) for several beam requests at once: their beams' logits rows side by side,
one joint, one draw or one verified layer for all of them, and one copy of what their tries need to the host.

Used by the target's beam steps (``beams.step_beams``: a step of every beam request whose leaves are in, layer after
layer while forests pass) and by the draft's (``beam_drafter``: each depth of every request's forest). Request r's
beams are rows ``[r, :S_r]`` of an ``[R, S, V]`` block (S = the most beams of a request); the rows past S_r are not
live (score -inf), so their joint entries are -inf and never drawn: each request's results are those of its own
``[1, S_r, V]`` call, up to the rounding of the joint's normaliser over a longer row of -inf entries (the random
keys are per request and per joint entry, ``core.rng``). Nothing here reads the device but the final copy (and
``choose_width`` takes its draft count from the host).

This module imports no vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dsbd.core import rng
from vllm_dsbd.core.joint import joint_logprobs
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.core.verify_static import verify_layer_static
from vllm_dsbd.core.width import choose_width

from .fused import fused_default, fused_layer


def joint_rows(logits: list[torch.Tensor], scores: list[list[float]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' beam rows side by side: ``[R, S, V]`` (a request's missing rows are zero logits) and their
    scores ``[R, S]`` (-inf on the missing rows), on the logits' device. ``logits[r]``: ``[len(scores[r]), V]``."""
    dev, V = logits[0].device, logits[0].shape[-1]
    S = max(lg.shape[0] for lg in logits)
    at = torch.tensor([r * S + b for r, sc in enumerate(scores) for b in range(len(sc))], dtype=torch.int64,
                      device=dev)
    rows = torch.zeros(len(logits) * S, V, dtype=dtype, device=dev).index_copy_(0, at, torch.cat(logits).to(dtype))
    sc = torch.tensor([s + [-math.inf] * (S - len(s)) for s in scores], dtype=dtype, device=dev)
    return rows.reshape(len(logits), S, V), sc


@dataclass
class Pair:
    """One (beam, token) output of a request's beam step or verified layer."""

    beam: int
    token: int
    logprob: float  # raw log-probability of the token after the beam (log_softmax of the logits)
    score: float  # the new beam's beam-sampling score (joint score)


def _read(rows: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, score: torch.Tensor,
          extra: list[torch.Tensor]) -> tuple[list[list[Pair]], list[list[float]]]:
    """The valid outputs of every request (``idx`` [R, K] joint indices, ``ok`` [R, K], ``score`` [R, K]) with their
    raw log-probabilities from ``rows`` [R, S, V], and ``extra`` [R]-shaped tensors, in one copy to the host."""
    R, S, V = rows.shape
    j = idx.clamp(min=0)
    lp = torch.log_softmax(rows.float(), dim=-1).reshape(R, S * V).gather(1, j)
    K = j.shape[1]
    parts = [j.double(), ok.double(), lp.double(), score.double()] + [e.double()[:, None].expand(R, K) for e in extra]
    host = torch.stack(parts).tolist()  # float32 values and joint indices are exact in float64
    pairs = [[Pair(int(a) // V, int(a) % V, v, s) for a, o, v, s in zip(*cols) if o] for cols in zip(*host[:4])]
    return pairs, [[row[0] for row in e] for e in host[4:]]


def sample(logits: list[torch.Tensor], scores: list[list[float]], live: list[list[bool]], params: BatchParams,
           positions: list[int], stream: rng.Stream) -> tuple[list[list[Pair]], torch.Tensor]:
    """Beam sampling's step for R requests (``core.beam_step`` on their rows side by side): W_r (beam, token) pairs
    drawn without replacement from each request's joint, in draw order. ``logits[r]`` ``[S_r, V]`` float32 rows of
    request r's beams, ``scores[r]`` / ``live[r]`` their beam-sampling scores and which take part; ``params`` one
    row per request (``beams.beam_params``), ``positions`` the new tokens' positions. Returns (per request its pairs,
    the joints log P [R, S * V] float32, row r request r's, -inf past its beams)."""
    dev = logits[0].device
    rows, sc = joint_rows(logits, scores, torch.float32)
    S = rows.shape[1]
    lv = torch.tensor([m + [False] * (S - len(m)) for m in live], dtype=torch.bool, device=dev)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    st = beam_step(rows, sc, lv, params, pos, stream)
    V = rows.shape[2]
    pairs, _ = _read(rows, st.parent * V + st.token, st.valid, st.score, [])
    return pairs, st.joint


@dataclass
class Layer:
    """One request's verified layer: its beams' logits rows and scores (-inf: a dead slot), and its drafts."""

    logits: torch.Tensor  # [S, V] float32
    scores: list[float]  # [S]
    drafts: list[int]  # joint indices (slot * V + token) of the layer's drafts in draw order
    logq: torch.Tensor | None  # [>= S * V] float32 the draft joint they were drawn from (-inf past its beams)
    position: int  # of the layer's tokens
    dynamic: bool  # the dynamic-width rule picks K (else K = W)


def verify(layers: list[Layer], params: BatchParams, fused: bool | None = None) -> tuple[list[list[Pair]], list[int]]:
    """DSBD's exact verification of one layer for R requests at once (``core.verify_layer``'s rule, as
    ``core.verify_static.verify_layer_static`` computes it, or the fused kernel: ``fused``, default on CUDA,
    ``engine/fused.py``): the target joint P over each request's beams, K = W_r outputs (or the dynamic-width rule's
    K from P and Q) that are K draws without replacement from P, in emission order. Returns (per request its
    outputs, per request K)."""
    dev = layers[0].logits.device
    R = len(layers)
    rows, sc = joint_rows([ly.logits for ly in layers], [ly.scores for ly in layers], torch.float32)
    S, V = rows.shape[1], rows.shape[2]
    J = S * V
    logp, jscore = joint_logprobs(rows, sc, torch.isfinite(sc), params)
    k = torch.minimum(torch.isfinite(logp).sum(1), params.width)
    M = max(max((len(ly.drafts) for ly in layers), default=0), 1)
    didx = torch.tensor([ly.drafts + [0] * (M - len(ly.drafts)) for ly in layers], dtype=torch.int64, device=dev)
    dval = torch.tensor([[c < len(ly.drafts) for c in range(M)] for ly in layers], dtype=torch.bool, device=dev)
    neg = torch.full((J,), -math.inf, device=dev)
    logq = torch.stack([neg if ly.logq is None else
                        torch.nn.functional.pad(ly.logq.float(), (0, J - ly.logq.shape[0]), value=-math.inf)[:J]
                        for ly in layers])
    dyn = [ly.dynamic and bool(ly.drafts) for ly in layers]
    if any(dyn):
        par_ok = torch.isfinite(logp).reshape(R, S, V).any(2)
        q_valid = (torch.exp(logq).reshape(R, S, V) * par_ok[:, :, None]).reshape(R, J)
        nd = [len(ly.drafts) for ly in layers]
        kd = choose_width(torch.exp(logp), q_valid, torch.tensor(nd, device=dev), params.width, params.min_width,
                          params.tau, max_drafts=max(nd))
        k = torch.where(torch.tensor(dyn, device=dev), kd, k)
    pos = torch.tensor([ly.position for ly in layers], dtype=torch.int64, device=dev)
    if fused_default(dev) if fused is None else fused:
        out, ok = fused_layer(rows, sc, torch.isfinite(sc), params, pos, didx, dval, logq, k, params.facts.width_max)
    else:
        out, ok = verify_layer_static(logp, didx, dval, logq, k, params.seed, pos, params.facts.width_max)
    pairs, (ks,) = _read(rows, out, ok, jscore.gather(1, out.clamp(min=0)), [k])
    return pairs, [int(x) for x in ks]
