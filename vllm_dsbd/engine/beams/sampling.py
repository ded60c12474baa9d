"""The device work of beam sampling (T > 0) for several beam requests at once: their beams' logits rows side by side,
one joint, one draw or one verified layer for all, and one copy of what their tries need.

Request r's beams are rows ``[r, :S_r]`` of an ``[R, S, V]`` block; rows past S_r score -inf, so their joint entries are
never drawn and each request gets what its own call would (up to the rounding of the normaliser over the padding; random
keys are per request and joint entry). Nothing reads the device but the final copy: :func:`sample`, :func:`verify`,
:func:`verify_forests` and :func:`top_rows` are readers (``engine/reads.py``). Imports no vLLM. Used by ``step.py`` (the
target's steps) and ``drafter.py`` (the draft's); docs/design/beams.md §3.3.
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

from .. import reads
from ..fused import fused_default, fused_layer
from ..reads import Reader


@dataclass
class TopRows:
    """What a deterministic beam step (T = 0) reads of logits rows: each row's ``2W`` best tokens and their
    log-probabilities (float32 ``log_softmax`` then ``topk``, as vLLM's beam search gets them from its sampler), as host
    lists, computed on the logits' device (:func:`top_rows`)."""

    vals: list[list[float]]
    idx: list[list[int]]

    def __len__(self) -> int:
        return len(self.vals)

    def __getitem__(self, rows: slice) -> "TopRows":
        return TopRows(self.vals[rows], self.idx[rows])

    def pick(self, rows: list[int]) -> "TopRows":
        return TopRows([self.vals[r] for r in rows], [self.idx[r] for r in rows])

    @staticmethod
    def cat(parts: list["TopRows"]) -> "TopRows":
        return TopRows([v for p in parts for v in p.vals], [i for p in parts for i in p.idx])


def top_rows(logits: torch.Tensor, ks: list[int], counts: list[int]) -> reads.Reader[list[TopRows]]:
    """The :class:`TopRows` of consecutive groups of logits rows ([sum counts, V], on any device): group g has
    ``counts[g]`` rows and keeps its rows' ``ks[g]`` best tokens. One ``log_softmax`` and one ``topk`` for all rows
    (both exact per row: a row's results do not depend on the other rows), one read (a reader: ``engine/reads.py``)."""
    V = logits.shape[-1]
    kk = min(max(ks, default=1), V)
    vals, idx = torch.topk(torch.log_softmax(logits.float(), dim=-1), kk, dim=-1)
    host, = yield [torch.stack([vals.double(), idx.double()])]  # float32 values and token ids are exact in float64
    v_l, i_l = host[0].tolist(), host[1].long().tolist()
    out, at = [], 0
    for k, n in zip(ks, counts):
        k = min(k, V)
        out.append(TopRows([r[:k] for r in v_l[at : at + n]], [r[:k] for r in i_l[at : at + n]]))
        at += n
    return out



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
          extra: list[torch.Tensor]) -> Reader[tuple[list[list[Pair]], list[list[float]]]]:
    """The valid outputs of every request (``idx`` [R, K] joint indices, ``ok`` [R, K], ``score`` [R, K]) with their
    raw log-probabilities from ``rows`` [R, S, V], and ``extra`` [R]-shaped tensors, in one copy to the host."""
    R, S, V = rows.shape
    j = idx.clamp(min=0)
    lp = torch.log_softmax(rows.float(), dim=-1).reshape(R, S * V).gather(1, j)
    K = j.shape[1]
    parts = [j.double(), ok.double(), lp.double(), score.double()] + [e.double()[:, None].expand(R, K) for e in extra]
    host, = yield [torch.stack(parts)]  # float32 values and joint indices are exact in float64
    host = host.tolist()
    pairs = [[Pair(int(a) // V, int(a) % V, v, s) for a, o, v, s in zip(*cols) if o] for cols in zip(*host[:4])]
    return pairs, [[row[0] for row in e] for e in host[4:]]


def sample(logits: list[torch.Tensor], scores: list[list[float]], live: list[list[bool]], params: BatchParams,
           positions: list[int], stream: rng.Stream) -> Reader[tuple[list[list[Pair]], torch.Tensor]]:
    """Beam sampling's step for R requests (``core.beam_step`` on their rows side by side): W_r pairs drawn without
    replacement from each joint, in draw order. ``logits[r]`` ``[S_r, V]`` float32, ``scores[r]`` / ``live[r]`` its
    beams', ``params`` one row per request, ``positions`` the new tokens'. Returns (per request its pairs, log P [R, S *
    V] float32, -inf past a request's beams)."""
    dev = logits[0].device
    rows, sc = joint_rows(logits, scores, torch.float32)
    S = rows.shape[1]
    lv = torch.tensor([m + [False] * (S - len(m)) for m in live], dtype=torch.bool, device=dev)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    st = beam_step(rows, sc, lv, params, pos, stream)
    V = rows.shape[2]
    pairs, _ = yield from _read(rows, st.parent * V + st.token, st.valid, st.score, [])
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


def verify(layers: list[Layer], params: BatchParams,
           fused: bool | None = None) -> Reader[tuple[list[list[Pair]], list[int]]]:
    """DSBD's exact verification of one layer for R requests at once (``core.verify_layer``'s rule, computed by
    ``verify_layer_static`` or the fused kernel, ``fused``): K = W_r outputs (or the dynamic-width rule's K from P and
    Q) that are K draws without replacement from the target joint P, in emission order. Returns (per request its
    outputs, per request K)."""
    dev = layers[0].logits.device
    rows, sc = joint_rows([ly.logits for ly in layers], [ly.scores for ly in layers], torch.float32)
    J = rows.shape[1] * rows.shape[2]
    didx, dval, logq = _draft_block([ly.drafts for ly in layers], [ly.logq for ly in layers], J, dev)
    pos = torch.tensor([ly.position for ly in layers], dtype=torch.int64, device=dev)
    out, ok, score, k = _layer(rows, sc, didx, dval, logq, pos, [ly.dynamic for ly in layers],
                               [len(ly.drafts) for ly in layers], params, fused)
    pairs, (ks,) = yield from _read(rows, out, ok, score, [k])
    return pairs, [int(x) for x in ks]


def _draft_block(drafts: list[list[int]], logqs: list[torch.Tensor | None], J: int, dev):
    """The requests' drafts as ``[R, M]`` joint indices and validity, and their draft joints as ``[R, J]`` log Q
    (-inf where a request has none, or past its beams)."""
    M = max(max((len(d) for d in drafts), default=0), 1)
    didx = torch.tensor([d + [0] * (M - len(d)) for d in drafts], dtype=torch.int64, device=dev)
    dval = torch.tensor([[c < len(d) for c in range(M)] for d in drafts], dtype=torch.bool, device=dev)
    neg = torch.full((J,), -math.inf, device=dev)
    logq = torch.stack([neg if q is None else torch.nn.functional.pad(q.float(), (0, J - q.shape[0]),
                                                                      value=-math.inf)[:J] for q in logqs])
    return didx, dval, logq


def _layer(rows: torch.Tensor, sc: torch.Tensor, didx: torch.Tensor, dval: torch.Tensor, logq: torch.Tensor,
           pos: torch.Tensor, dynamic: list[bool], nd: list[int], params: BatchParams, fused: bool | None,
           active: torch.Tensor | None = None):
    """One verified layer on the device (no read): rows [R, S, V], scores [R, S] (-inf: not a beam), drafts
    ``didx`` / ``dval`` [R, M] (``nd`` per request, host), ``logq`` [R, S * V]; ``active`` [R] (None: all) masks
    requests to K = 0. Returns (out joint indices [R, K'], valid [R, K'], their joint scores, K [R])."""
    R, S, V = rows.shape
    dev = rows.device
    logp, jscore = joint_logprobs(rows, sc, torch.isfinite(sc), params)
    k = torch.minimum(torch.isfinite(logp).sum(1), params.width)
    dyn = [d and n > 0 for d, n in zip(dynamic, nd)]
    if any(dyn):
        par_ok = torch.isfinite(logp).reshape(R, S, V).any(2)
        q_valid = (torch.exp(logq).reshape(R, S, V) * par_ok[:, :, None]).reshape(R, S * V)
        kd = choose_width(torch.exp(logp), q_valid, torch.tensor(nd, device=dev), params.width, params.min_width,
                          params.tau, max_drafts=max(nd))
        k = torch.where(torch.tensor(dyn, device=dev), kd, k)
    if active is not None:
        k = torch.where(active, k, 0)
    if fused_default(dev) if fused is None else fused:
        out, ok = fused_layer(rows, sc, torch.isfinite(sc), params, pos, didx, dval, logq, k, params.facts.width_max)
    else:
        out, ok = verify_layer_static(logp, didx, dval, logq, k, params.seed, pos, params.facts.width_max)
    return out, ok, jscore.gather(1, out.clamp(min=0)), k


@dataclass
class Plan:
    """One request's verification of its whole forest (:func:`verify_forests`): the layers its forest drafted, then
    the bonus layer, while every new beam is a forest node."""

    leaves: torch.Tensor  # [Wl, V] float32 rows of the live beams (layer 1's beams)
    scores: list[float]  # their beam-sampling scores
    nodes: torch.Tensor  # [F, V] float32 rows of the forest nodes the pass computed (later layers' beams)
    drafts: list[list[int]]  # per forest depth: its nodes (numbers c < F, in draw order)
    joint: list[list[int]]  # per forest depth: the nodes' joint indices (parent slot * V + token)
    logq: list[torch.Tensor]  # per forest depth: the draft joint its nodes were drawn from
    position: int  # of layer 1's tokens
    layers: int  # the most layers the request may make (its steps left)
    dynamic: bool
    eos: int  # the EOS id that finishes a beam (-1: none)


def verify_forests(plans: list[Plan], params: BatchParams,
                   fused: bool | None = None) -> Reader[list[list[tuple[list[Pair], int]]]]:
    """:func:`verify` of every layer of R requests' forests with one device read; whether a layer passed is decided on
    the device, and a stopped request has K = 0 after. Returns per request its layers' (outputs, K): what layer-by-layer
    :func:`verify` returns (the same keyed draws, up to rounding over more padding)."""
    dev = plans[0].leaves.device
    R, V = len(plans), plans[0].leaves.shape[-1]
    L = max(min(len(p.drafts) + 1, p.layers) for p in plans)
    rows, sc = joint_rows([p.leaves for p in plans], [p.scores for p in plans], torch.float32)
    F = max(max(p.nodes.shape[0] for p in plans), 1)
    at = torch.tensor([r * F + c for r, p in enumerate(plans) for c in range(p.nodes.shape[0])], dtype=torch.int64,
                      device=dev)
    nodes = torch.zeros(R * F, V, device=dev).index_copy_(0, at, torch.cat([p.nodes.float() for p in plans]))
    eos = torch.tensor([p.eos for p in plans], dtype=torch.int64, device=dev)
    active = torch.ones(R, dtype=torch.bool, device=dev)
    dummy = torch.full((1, 1), 0.0, device=dev)
    records = []
    for layer in range(L):
        drafts = [p.joint[layer] if layer < len(p.joint) else [] for p in plans]
        S = rows.shape[1]
        didx, dval, logq = _draft_block(drafts, [p.logq[layer] if drafts[r] else None for r, p in enumerate(plans)],
                                        S * V, dev)
        pos = torch.tensor([p.position + layer for p in plans], dtype=torch.int64, device=dev)
        # a stopped request: one dummy beam of score 0 (finite joint), K = 0
        sc_run = torch.where(active[:, None], sc, torch.nn.functional.pad(dummy, (0, S - 1), value=-math.inf))
        out, ok, score, k = _layer(rows, sc_run, didx, dval, logq, pos, [p.dynamic for p in plans],
                                   [len(d) for d in drafts], params, fused, active)
        lp = torch.log_softmax(rows.float(), dim=-1).reshape(R, S * V).gather(1, out.clamp(min=0))
        records.append(torch.stack([out.double(), ok.double(), lp.double(), score.double(),
                                    torch.where(active, k, -1).double()[:, None].expand_as(score)]))
        if layer + 1 == L:
            break
        # the layer passed: outputs (not EOS) all among the drafts, at least one, drafts there, a step left
        cand = ok & ((eos < 0)[:, None] | (out % V != eos[:, None]))
        match = (out[:, :, None] == didx[:, None, :]) & dval[:, None, :] & cand[:, :, None]  # [R, K, M]
        more = torch.tensor([bool(drafts[r]) and layer + 1 < p.layers for r, p in enumerate(plans)], device=dev)
        active = active & more & cand.any(1) & (match.any(2) | ~cand).all(1)
        # the next layer's beams: this layer's drafts in draw order, scored by the output each matched
        M = didx.shape[1]
        sc = torch.where(match, score[:, :, None], -math.inf).amax(1)  # [R, M]
        sc = torch.where(active[:, None] & dval, sc, -math.inf)
        idx = torch.tensor([[r * F + c for c in (p.drafts[layer] if layer < len(p.drafts) else [])]
                            + [r * F] * (M - (len(p.drafts[layer]) if layer < len(p.drafts) else 0))
                            for r, p in enumerate(plans)], dtype=torch.int64, device=dev)
        rows = nodes[idx]  # [R, M, V]
    # the one copy: [layer][out, ok, lp, score, K (-1: the request had stopped)][request][column]
    host, = yield [torch.stack(records)]
    host = host.tolist()
    result = []
    for r in range(R):
        mine = []
        for layer in range(L):
            out_l, ok_l, lp_l, sc_l, k_l = (x[r] for x in host[layer])
            if k_l[0] < 0:
                break
            pairs = [Pair(int(a) // V, int(a) % V, v, s) for a, o, v, s in zip(out_l, ok_l, lp_l, sc_l) if o]
            mine.append((pairs, int(k_l[0])))
        result.append(mine)
    return result
