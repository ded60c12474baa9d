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

from . import beam_sampling
from .attention import ForestBatch
from .beams import BeamForest, beam_params
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


def _sampled_pairs(beams: list, logits: list[torch.Tensor], scores: list[list[float]], live: list[list[bool]],
                   d: int) -> tuple[list[list[tuple[int, int, float]]], torch.Tensor]:
    """The draft's beam-sampling step at temperature T > 0 of several beam requests at once (``core.beam_step``, each
    request's temperature, top-k and top-p on its joint, keyed by its seed, the depth-d tokens' position and
    ``Stream.DRAFT_DRAW``; ``beam_sampling.sample``): W (beam, token) pairs drawn without replacement from each draft
    joint Q, in draw order, read in one copy. EOS is an ordinary draw (a drafted EOS is not continued). Returns
    (per request [(beam, token, draft score)], log Q [R, S * V] float32: row r is request r's joint, -inf past its
    beams)."""
    pairs, joint = beam_sampling.sample(logits, scores, live, beam_params(beams, logits[0].device),
                                        [b.prompt_len + b.steps + d - 1 for b in beams], rng.Stream.DRAFT_DRAW)
    return [[(p.beam, p.token, p.score) for p in ps] for ps in pairs], joint


def _top_pairs(logits: list[torch.Tensor], scores: list[list[float]], widths: list[int],
               eos: list[int | None]) -> list[list[tuple[int, int, float]]]:
    """The draft's beam step at temperature 0 of several beam requests at once: each request's ``width`` best
    (beam, token) pairs by cumulative score (float64, as the target's beam search sums them), EOS excluded, on the
    logits' device, read in one copy. Returns per request [(beam, token, score)]."""
    V = logits[0].shape[-1]
    rows, sc = beam_sampling.joint_rows(logits, scores, torch.float64)
    joint = torch.log_softmax(rows, dim=-1) + sc[:, :, None]  # missing rows: -inf
    ban = torch.tensor([[r, e] for r, e in enumerate(eos) if e is not None], dtype=torch.int64, device=rows.device)
    if ban.numel():
        joint[ban[:, 0], :, ban[:, 1]] = -torch.inf
    vals, idx = torch.topk(joint.flatten(1), min(max(widths), joint.shape[1] * V))
    vals_l, idx_l = torch.stack([vals, idx.double()]).tolist()  # one copy (ids are exact in float64)
    return [[(int(i) // V, int(i) % V, v) for i, v in zip(idx_l[r][:w], vals_l[r][:w]) if v > -torch.inf]
            for r, w in enumerate(widths)]


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
    # the draft logits stay on the device: each depth's beam step runs there for all requests at once, and what the
    # tries and forests (host lists) need comes over in one copy per depth
    logits = drafter._forward(ids, pos, np.concatenate(slots), qlens, seqs, block_rows, sample, fb, 0)
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
        go = [k for k, job in enumerate(jobs) if d <= job.depth and job.max_nodes > len(forests[k].tokens)
              and any(c for *_, c in beams_of[k])]
        pairs_of = _depth_pairs([jobs[k].state.beam for k in go], [leaf_logits[k] for k in go],
                                [beams_of[k] for k in go], d)
        for k, (pairs, q) in zip(go, pairs_of):
            job = jobs[k]
            beam, f = job.state.beam, forests[k]
            pairs = pairs[: job.max_nodes - len(f.tokens)]
            if q is not None:
                f.q.append(q)
            p = beam.params
            eos = None if p.ignore_eos else p.eos_token_id
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
                                  list(range(t0)), fb, d)
        at = 0
        for k in sub:
            m = len(layer_of[k])
            leaf_logits[k] = logits[at : at + m]
            at += m
    for job, f in zip(jobs, forests):
        job.state.beam.forest = f if f.tokens else None


def _depth_pairs(beams: list, logits: list[torch.Tensor], beams_of: list[list[tuple[int, float, bool]]],
                 d: int) -> list[tuple[list[tuple[int, int, float]], torch.Tensor | None]]:
    """Depth d's draft beam step of the given requests (their current draft beams ``(node, score, continues)`` and
    those beams' draft logits rows): T = 0 requests together (``_top_pairs``), T > 0 requests together
    (``_sampled_pairs``). Per request: (its pairs in draw / rank order, its log Q [S * V] at T > 0, else None)."""
    out: list = [None] * len(beams)
    det = [i for i, b in enumerate(beams) if b.temperature <= 0.0]
    samp = [i for i, b in enumerate(beams) if b.temperature > 0.0]
    scores = [[sc for _, sc, _ in bo] for bo in beams_of]
    if det:
        eos = [None if beams[i].params.ignore_eos else beams[i].params.eos_token_id for i in det]
        tops = _top_pairs([logits[i] for i in det], [scores[i] for i in det],
                          [beams[i].params.width for i in det], eos)
        for i, pairs in zip(det, tops):
            out[i] = (pairs, None)
    if samp:
        pairs, q = _sampled_pairs([beams[i] for i in samp], [logits[i] for i in samp], [scores[i] for i in samp],
                                  [[c for *_, c in beams_of[i]] for i in samp], d)
        for r, i in enumerate(samp):
            out[i] = (pairs[r], q[r])
    return out
