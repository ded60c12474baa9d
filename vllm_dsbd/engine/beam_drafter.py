"""Draft forests for beam requests (DSBD full width): the draft model beam-searches (T = 0) or beam-samples (T > 0) a
few steps ahead of the W live beams of every beam request of the step, in one draft pass per depth.

* Pass 0 ("catch-up"): the slots whose draft K/V are missing, from the first of them to the end of the trie (the
  prompt's after its prefill, then the new leaves and any node whose draft K/V never were): the linear context (the
  prompt and the beams' common prefix) causally, trie nodes under the trie's ancestor masks
  (``attention.ForestBatch``, context = the linear context). Its logits at the
  live leaves start the draft's beam search.
* Depth d = 1..G: the draft's beam step from the current beams. T = 0: scored as the target's beam search scores
  them (cumulative log-probabilities, EOS finishing a beam so never continued), the W best (beam, token) pairs of the
  joint. T > 0: W pairs drawn without replacement from the draft's beam-sampling joint Q (``core.beam_step``, keyed
  by the request's seed and the tokens' position), in draw order, with Q kept for the exact verification
  (``BeamRequest.step``); a drafted EOS is not continued. The depth-d nodes go after the trie and the earlier depths
  (node c of the forest at slot ``base + len(trie) + c``); if deeper depths follow, pass d runs the draft on them under
  forest attention.

The forest goes back to the request (``BeamRequest.forest``); its tokens follow the remaining leaves as the request's
draft tokens, so the target computes them with the leaves in the next pass and ``BeamRequest.step`` verifies them.
A forest is cut (deepest nodes first) to what fits in the scheduler's draft slots and in the KV blocks the request
owns now (the drafter may not write beyond them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dsbd.core import rng
from vllm_dsbd.core.sampling import beam_step

from .attention import ForestBatch
from .beams import BeamForest
from .kv import slots_of
from .state import RequestState


@dataclass
class BeamDraftJob:
    state: RequestState
    row: int  # the request's row in the runner's input batch (its block-table row)
    prompt_tail: list[int]  # prompt tokens from ``start`` (catch-up start) to the prompt's end, if start < P
    start: int  # first slot of the catch-up pass
    depth: int  # >= 1
    max_nodes: int  # forest nodes the scheduler can take after the leaves


def catch_up_start(st: RequestState) -> int:
    """First slot of a beam request whose draft K/V are missing (prompt, linear prefix or trie)."""
    beam = st.beam
    if st.draft_len < beam.prompt_len:
        return st.draft_len
    if beam.draft_gap is not None:  # a trie node without draft K/V became linear context (BeamRequest._relayout)
        return beam.draft_gap
    return beam.base + beam.first_without_draft()


def _sampled_pairs(beam, logits: torch.Tensor, scores: list[float], live: list[bool], d: int):
    """The draft's beam-sampling step at temperature T > 0 (``core.beam_step``, the request's temperature, top-k and
    top-p on the joint, keyed by its seed, the depth-d tokens' position and ``Stream.DRAFT_DRAW``): W (beam, token)
    pairs drawn without replacement from the draft joint Q, in draw order. EOS is an ordinary draw (a drafted EOS is
    not continued). Returns ([(beam, token, draft score)], log Q [S * V] float32)."""
    params = beam.batch_params()
    pos = torch.tensor([beam.prompt_len + beam.steps + d - 1], dtype=torch.int64)
    st = beam_step(logits.float()[None], torch.tensor([scores], dtype=torch.float32),
                   torch.tensor([live], dtype=torch.bool), params, pos, rng.Stream.DRAFT_DRAW)
    pairs = [(int(st.parent[0, j]), int(st.token[0, j]), float(st.score[0, j]))
             for j in range(st.valid.shape[1]) if bool(st.valid[0, j])]
    return pairs, st.joint[0]


def _top_pairs(logits: torch.Tensor, scores: list[float], width: int, eos: int | None):
    """The draft's beam step at temperature 0: the ``width`` best (beam, token) pairs by cumulative score
    (float64, as the target's beam search sums them), EOS excluded. Returns [(beam, token, score)]."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    joint = lp + torch.tensor(scores, dtype=torch.float64)[:, None]
    if eos is not None:
        joint[:, eos] = -torch.inf
    vals, idx = torch.topk(joint.flatten(), min(width, joint.numel()))
    V = logits.shape[-1]
    return [(i // V, i % V, v) for i, v in zip(idx.tolist(), vals.tolist()) if v > -torch.inf]


@torch.inference_mode()
def propose_beam_forests(drafter, jobs: list[BeamDraftJob]) -> None:
    """Drafts the forest of every job (``state.beam.forest``); updates the draft K/V bookkeeping."""
    if not jobs:
        return
    table, bs, owned = drafter._block_table()
    rows = torch.tensor([j.row for j in jobs], dtype=torch.int64)
    block_rows = table[rows]
    brow = block_rows.numpy()
    owned = [int(owned[j.row]) for j in jobs]

    # pass 0: catch-up; logits at every live leaf
    ids, pos, slots, qlens, seqs, entries, sample = [], [], [], [], [], [], []
    t0 = 0
    for k, job in enumerate(jobs):
        beam = job.state.beam
        B, n = beam.base, len(beam.tokens)
        s = list(range(job.start, B + n))
        ids += job.prompt_tail + beam.tokens[max(0, job.start - B):]
        pos += [beam.position(x) for x in s]
        slots.append(slots_of(brow[k], s, bs, owned[k]))
        qlens.append(len(s))
        seqs.append(B + n)
        trie = [x for x in s if x >= B]
        entries.append((k, [t0 + x - job.start for x in trie], B, list(beam.parents), [x - B for x in trie]))
        sample += [t0 + B + b.node - job.start for b in beam.live]
        t0 += len(s)
    fb = ForestBatch.build(entries, max_nodes=max(len(e[3]) for e in entries))
    # beam requests keep their tries and forests on the host (per-request Python work): the draft logits come over
    logits = drafter._forward(ids, pos, np.concatenate(slots), qlens, seqs, block_rows, sample, fb, 0).cpu()
    leaf_logits, at = [], 0
    for job in jobs:
        beam = job.state.beam
        leaf_logits.append(logits[at : at + len(beam.live)])
        at += len(beam.live)
        beam.has_draft = [True] * len(beam.tokens)
        beam.draft_gap = None
        job.state.draft_len = max(job.state.draft_len, beam.prompt_len)

    # depths 1..G: the draft's beam search / beam sampling; pass d computes the depth-d nodes' logits when a deeper
    # depth follows
    forests = [BeamForest([], [], [], []) for _ in jobs]
    # the beams each depth is drawn from: (node number, score, continues); depth 1: the live beams
    beams_of = [[(b.node, b.score if job.state.beam.temperature <= 0.0 else b.sample_score, True)
                 for b in job.state.beam.live] for job in jobs]
    for d in range(1, max(j.depth for j in jobs) + 1):
        layer_of = {}
        for k, job in enumerate(jobs):
            beam, f = job.state.beam, forests[k]
            cap = job.max_nodes - len(f.tokens)
            if d > job.depth or cap <= 0 or not any(c for *_, c in beams_of[k]):
                continue
            p = beam.params
            eos = None if p.ignore_eos else p.eos_token_id
            scores = [sc for _, sc, _ in beams_of[k]]
            if beam.temperature <= 0.0:
                pairs = _top_pairs(leaf_logits[k], scores, p.width, eos)[:cap]
            else:
                pairs, q = _sampled_pairs(beam, leaf_logits[k], scores, [c for *_, c in beams_of[k]], d)
                pairs = pairs[:cap]
                f.q.append(q)
            n = len(beam.tokens)
            layer = []
            for b, t, sc in pairs:
                par = beams_of[k][b][0]
                f.tokens.append(t)
                f.parents.append(par)
                f.depths.append((beam.depths[par] if par < n else f.depths[par - n]) + 1)
                f.drafted.append(False)
                f.layers.append(d)
                f.slots.append(b)
                layer.append((n + len(f.tokens) - 1, sc, eos is None or t != eos))
            beams_of[k] = layer
            if d < job.depth and len(f.tokens) < job.max_nodes and any(c for *_, c in layer):
                layer_of[k] = layer
        if not layer_of:
            break
        ids, pos, slots, qlens, seqs, entries = [], [], [], [], [], []
        t0 = 0
        for e, (k, layer) in enumerate(layer_of.items()):
            beam, f = jobs[k].state.beam, forests[k]
            B, n = beam.base, len(beam.tokens)
            nodes = [nd for nd, *_ in layer]
            ids += [f.tokens[nd - n] for nd in nodes]
            pos += [beam.prompt_len - 1 + f.depths[nd - n] for nd in nodes]
            slots.append(slots_of(brow[k], [B + nd for nd in nodes], bs, owned[k]))
            qlens.append(len(nodes))
            seqs.append(B + n + len(f.tokens))
            entries.append((e, list(range(t0, t0 + len(nodes))), B, beam.parents + f.parents, nodes))
            t0 += len(nodes)
            for nd in nodes:
                f.drafted[nd - n] = True
        sub = list(layer_of)
        fb = ForestBatch.build(entries, max_nodes=max(len(e[3]) for e in entries))
        logits = drafter._forward(ids, pos, np.concatenate(slots), qlens, seqs, block_rows[torch.tensor(sub)],
                                  list(range(t0)), fb, d).cpu()
        at = 0
        for k in sub:
            m = len(layer_of[k])
            leaf_logits[k] = logits[at : at + m]
            at += m
    for job, f in zip(jobs, forests):
        job.state.beam.forest = f if f.tokens else None
