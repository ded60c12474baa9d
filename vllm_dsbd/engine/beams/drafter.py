"""Draft forests for beam requests: the draft beam-searches (T = 0) or beam-samples (T > 0) a few steps ahead of the W
live beams of every beam request of the step, one draft pass per depth for all of them. Each depth has N >= W nodes
(``BeamRequest.nodes``, over-drafting; the cost model may choose fewer, never below W: ``BeamDraftJob.nodes``):
at T = 0 the draft's N best (beam, token) pairs, at T > 0 N draws without replacement, and all N go on to the next
depth.

A catch-up pass computes the draft K/V still missing (linear context causally, trie nodes under their ancestor masks);
each depth's pairs go after the trie (forest node c at slot ``base + len(trie) + c``) and become the request's draft
tokens after its remaining leaves. A forest is cut (deepest nodes first) to the draft slots and the KV blocks the
request owns now: the drafter may not write beyond them. Catch-up, depth steps, the static loop's bet:
docs/design/beams.md §3.3 ("Beam drafting"). With the draft-free sources beside the draft (``BeamDraftJob.linear``),
each depth's rows are mixed with their candidates first (``engine/mixing.py``; the general loop only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dsbd.core import rng
from vllm_dsbd.core.sampling import beam_step

from .. import mixing, reads
from ..attention import ForestBatch, ForestEntry
from ..kv import slots_of
from ..chunks import VERIFY_BUDGET
from ..state import RequestState
from . import sampling as beam_sampling
from .trie import BeamForest, beam_params


@dataclass
class BeamDraftJob:
    state: RequestState
    row: int  # the request's row in the runner's input batch (its block-table row)
    prompt_tail: list[int]  # prompt tokens from ``start`` (catch-up start) to the prompt's end, if start < P
    start: int  # first slot of the catch-up pass
    depth: int  # >= 1
    max_nodes: int  # forest nodes the scheduler can take after the leaves
    # N, nodes per depth: the request's (None), or fewer chosen by the cost model (>= W; engine/cost.py)
    nodes: int | None = None
    # a draft mixed with the draft-free sources (mixing.py): the linear context's last tokens
    linear: list[int] | None = None

    @property
    def width(self) -> int:
        """The nodes per depth this forest is drafted with."""
        return self.state.beam.nodes if self.nodes is None else self.nodes


def catch_up_start(st: RequestState) -> int:
    """First slot of a beam request whose draft K/V are missing (prompt, linear prefix or trie)."""
    beam = st.beam
    if st.draft_len < beam.prompt_len:
        return st.draft_len
    if beam.draft_gap is not None:  # a trie node without draft K/V became linear context (BeamRequest._relayout)
        return beam.draft_gap
    return beam.base + beam.first_without_draft()


def _sampled_pairs(beams: list, logits: list[torch.Tensor], scores: list[list[float]], live: list[list[bool]],
                   d: int, widths: list[int]) -> tuple[list[list[tuple[int, int, float]]], torch.Tensor]:
    """The draft's beam-sampling step (T > 0) of several beam requests at once (``core.beam_step`` keyed by each
    request's seed, the forest's root position and depth d (``rng.forest_position``) and ``Stream.DRAFT_DRAW``): N pairs (``widths``: each request's N for this
    forest) drawn without replacement from each draft joint Q, in draw order, read in one copy; a drafted EOS is not
    continued. Returns (per request [(beam, token, draft score)], log Q [R, S * V] float32: row r request r's, -inf
    past its beams)."""
    pairs, joint = reads.run(beam_sampling.sample(logits, scores, live, beam_params(beams, logits[0].device, widths),
                                                  [rng.forest_position(b.prompt_len + b.steps - 1, d) for b in beams],
                                                  rng.Stream.DRAFT_DRAW))
    return [[(p.beam, p.token, p.score) for p in ps] for ps in pairs], joint


def _budget(drafter) -> int:
    """The float32 elements one chunk of the T = 0 top-N may hold (the runner's verification budget)."""
    return getattr(getattr(drafter, "runner", None), "dsbd_verify_elements", VERIFY_BUDGET)


def top_n(rows_of, sc: torch.Tensor, eos: list[int], k: int, V: int,
          budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The T = 0 draft step's k best (beam, token) pairs of each request: ``topk(log_softmax(rows) + sc, k)`` over its
    flattened ``[S, V]`` joint in float64, EOS (``eos[r]`` >= 0) excluded. ``rows_of(a, b)``: requests a..b-1's rows
    ``[b - a, S, V]``; sc: ``[R, S]`` float64. Requests go in chunks whose float64 temporaries (rows, log-softmax:
    4 float32 elements a pair) stay under ``budget`` float32 elements: row-wise work, the same values as one batch.
    Returns (values [R, k] float64, joint indices [R, k] int64)."""
    R, S = sc.shape
    n = max(1, budget // (4 * max(S, 1) * V))
    vals, idx = [], []
    for a in range(0, R, n):
        b = min(R, a + n)
        joint = torch.log_softmax(rows_of(a, b).double(), dim=-1).add_(sc[a:b, :, None])  # missing rows: -inf
        ban = [(r - a, eos[r]) for r in range(a, b) if eos[r] >= 0]
        if ban:
            bt = torch.tensor(ban, dtype=torch.int64, device=joint.device)
            joint[bt[:, 0], :, bt[:, 1]] = -torch.inf
        v, i = torch.topk(joint.flatten(1), k)
        del joint
        vals.append(v)
        idx.append(i)
    return (vals[0], idx[0]) if len(vals) == 1 else (torch.cat(vals), torch.cat(idx))


def _top_pairs(logits: list[torch.Tensor], scores: list[list[float]], widths: list[int],
               eos: list[int | None], budget: int = VERIFY_BUDGET) -> list[list[tuple[int, int, float]]]:
    """The draft's beam step at temperature 0 of several beam requests at once: each request's ``widths`` (its N)
    best (beam, token) pairs by cumulative score (float64, as the target's beam search sums them), EOS excluded, on the
    logits' device (:func:`top_n`, chunked by ``budget``), read in one copy. Returns per request [(beam, token,
    score)]."""
    V = logits[0].shape[-1]
    S = max(lg.shape[0] for lg in logits)
    sc = torch.tensor([s + [-math.inf] * (S - len(s)) for s in scores], dtype=torch.float64, device=logits[0].device)
    vals, idx = top_n(lambda a, b: beam_sampling.joint_rows(logits[a:b], scores[a:b], torch.float64, slots=S)[0], sc,
                      [-1 if e is None else e for e in eos], min(max(widths), S * V), V, budget)
    vals_l, idx_l = torch.stack([vals, idx.double()]).tolist()  # one copy (ids are exact in float64)
    return [[(int(i) // V, int(i) % V, v) for i, v in zip(idx_l[r][:w], vals_l[r][:w]) if v > -torch.inf]
            for r, w in enumerate(widths)]


@torch.inference_mode()
def propose_beam_forests(drafter, jobs: list[BeamDraftJob]) -> reads.Reader[None]:
    """Drafts the forest of every job (``state.beam.forest``); updates the draft K/V bookkeeping. A reader
    (``engine/reads.py``): the runner drives it beside the plain requests' drafting, one read for both."""
    if not jobs:
        return
    table, bs, owned = drafter.block_table_host()
    rows = torch.tensor([j.row for j in jobs], dtype=torch.int64)
    block_rows = table[rows]
    brow = block_rows.numpy()
    owned = [int(owned[j.row]) for j in jobs]

    # pass 0: catch-up; logits at every live leaf (a long linear context first, in passes of at most the drafter's
    # ``max_catch_up`` tokens)
    head = getattr(drafter, "head", False)  # an EAGLE-3 head: each row also takes its parent slot's target feature
    if sum(j.state.beam.base + len(j.state.beam.tokens) - j.start for j in jobs) > drafter.max_catch_up:
        new = drafter.catch_up_prefix(
            [(j.start, j.state.beam.base, j.state.beam.base + len(j.state.beam.tokens) - j.start,
              lambda lo, hi, j=j: j.prompt_tail[lo - j.start : hi - j.start],
              lambda lo, hi, j=j: drafter.beam_features(j.state, [x - 1 for x in range(lo, hi)])) for j in jobs],
            block_rows, brow, bs, np.asarray(owned, dtype=np.int64))
        for j, s0 in zip(jobs, new):
            j.prompt_tail, j.start = j.prompt_tail[s0 - j.start :], s0
    ids, pos, slots, qlens, seqs, entries, sample = [], [], [], [], [], [], []
    feats = []
    t0 = 0
    for k, job in enumerate(jobs):
        beam = job.state.beam
        B, n = beam.base, len(beam.tokens)
        s = list(range(job.start, B + n))
        if head:
            feats.append(drafter.beam_features(job.state, [x - 1 if x < B else (
                B + beam.parents[x - B] if beam.parents[x - B] >= 0 else B - 1) for x in s]))
        ids += job.prompt_tail + beam.tokens[max(0, job.start - B):]
        pos += [beam.position(x) for x in s]
        slots.append(slots_of(brow[k], s, bs, owned[k]))
        qlens.append(len(s))
        seqs.append(B + n)
        trie = [x for x in s if x >= B]
        entries.append(ForestEntry(req_row=k, token_rows=[t0 + x - job.start for x in trie], context_len=B,
                                   parents=list(beam.parents), query_nodes=[x - B for x in trie]))
        sample += [t0 + B + b.node - job.start for b in beam.live]
        t0 += len(s)
    fb = ForestBatch.build(entries, max_nodes=max(len(e.parents) for e in entries))
    # the draft logits stay on the device: each depth's beam step runs there for all requests at once, and what the
    # tries and forests (host lists) need comes over in one copy per depth
    logits = drafter.forward_ragged(ids, pos, np.concatenate(slots), qlens, seqs, block_rows, sample, fb, 0,
                                    torch.cat(feats) if head else None)
    leaf_logits, at = [], 0
    # a head's own hidden state of each draft beam, by node number (depth 1: the live leaves' catch-up rows)
    hidden_of = [{} for _ in jobs] if head else None
    for k, job in enumerate(jobs):
        beam = job.state.beam
        if head:
            for b, r in zip(beam.live, sample[at : at + len(beam.live)]):
                hidden_of[k][b.node] = drafter.last_hidden[r]
        leaf_logits.append(logits[at : at + len(beam.live)])
        at += len(beam.live)
        beam.has_draft = [True] * len(beam.tokens)
        beam.draft_gap = None
        job.state.draft_len = max(job.state.draft_len, beam.prompt_len)

    # depths 1..G: the draft's beam search / beam sampling; pass d computes the depth-d nodes' logits when a deeper
    # depth follows. First the static loop (one host copy in all) where its bet holds, else the general one.
    # the beams each depth is drawn from: (node number, score, continues); depth 1: the live beams
    beams_of = [[(b.node, b.score if job.state.beam.temperature <= 0.0 else b.sample_score, True)
                 for b in job.state.beam.live] for job in jobs]
    forests = None
    mixed = any(j.linear is not None for j in jobs)  # mixed with the draft-free sources (engine/mixing.py)
    if mixed:  # lookup also indexes each live beam's newest tokens (as the draft-free drafter does)
        for job in jobs:
            mixing.index_live_beams(job.state.sources, job.state.beam, job.linear, job.depth)
    # a head: the general loop (its hidden states); mixed: likewise (each depth's contexts)
    if drafter.static_drafting and _static_layout(jobs) and not head and not mixed:
        if drafter.beam_static_skip:
            drafter.beam_static_skip -= 1
        else:
            forests = yield from _draft_static(drafter, jobs, leaf_logits, beams_of, brow, bs, owned, block_rows)
            drafter.beam_static_backoff = 0 if forests else min(max(2 * drafter.beam_static_backoff, 1), 16)
            drafter.beam_static_skip = drafter.beam_static_backoff
            drafter.beam_static_misses += forests is None
    if forests is None:
        forests = _draft_loop(drafter, jobs, leaf_logits, beams_of, brow, bs, owned, block_rows, hidden_of)
    for job, f in zip(jobs, forests):
        f.nodes = job.width
        job.state.beam.forest = f if f.tokens else None


def _draft_loop(drafter, jobs: list[BeamDraftJob], leaf_logits: list[torch.Tensor], beams_of: list, brow: np.ndarray,
                bs: int, owned: list[int], block_rows: torch.Tensor, hidden_of: list[dict] | None = None
                ) -> list[BeamForest]:
    """The general depth loop: each depth's pairs of all requests in one copy, then pass d over the depth-d nodes
    of the requests that go deeper. Returns the forests. ``hidden_of``: an EAGLE-3 head's hidden state of each draft
    beam by node number (a node's row takes its parent's)."""
    leaf_logits, beams_of = list(leaf_logits), list(beams_of)
    forests = [BeamForest([], [], [], []) for _ in jobs]
    for d in range(1, max(j.depth for j in jobs) + 1):
        layer_of = {}
        go = [k for k, job in enumerate(jobs) if _goes(job, forests[k], beams_of[k], d)]
        for k in go:
            job, f = jobs[k], forests[k]
            if job.linear is not None:  # mixed with the draft-free sources (engine/mixing.py)
                leaf_logits[k] = mixing.mix(leaf_logits[k], [job.state.sources.propose(mixing.text_tail(
                    job.state.beam, job.linear, f.tokens, f.parents, nd)) if c else None for nd, _, c in beams_of[k]])
        pairs_of = _depth_pairs([jobs[k] for k in go], [leaf_logits[k] for k in go], [beams_of[k] for k in go], d,
                                _budget(drafter))
        for k, (pairs, q) in zip(go, pairs_of):
            beams_of[k], deeper = _grow(jobs[k], forests[k], beams_of[k], pairs, q, d)
            if deeper:
                layer_of[k] = beams_of[k]
        if not layer_of:
            break
        ids, pos, slots, qlens, seqs, entries, hid = [], [], [], [], [], [], []
        t0 = 0
        for e, (k, layer) in enumerate(layer_of.items()):
            beam, f = jobs[k].state.beam, forests[k]
            B, n = beam.base, len(beam.tokens)
            nodes = [nd for nd, *_ in layer]
            if hidden_of is not None:
                hid += [hidden_of[k][f.parents[nd - n]] for nd in nodes]
            ids += [f.tokens[nd - n] for nd in nodes]
            pos += [beam.prompt_len - 1 + f.depths[nd - n] for nd in nodes]
            slots.append(slots_of(brow[k], [B + nd for nd in nodes], bs, owned[k]))
            qlens.append(len(nodes))
            seqs.append(B + n + len(f.tokens))
            entries.append(ForestEntry(req_row=e, token_rows=list(range(t0, t0 + len(nodes))), context_len=B,
                                       parents=beam.parents + f.parents, query_nodes=nodes))
            t0 += len(nodes)
            for nd in nodes:
                f.drafted[nd - n] = True
        sub = list(layer_of)
        fb = ForestBatch.build(entries, max_nodes=max(len(e.parents) for e in entries))
        logits = drafter.forward_ragged(ids, pos, np.concatenate(slots), qlens, seqs, block_rows[torch.tensor(sub)],
                                  list(range(t0)), fb, d, torch.stack(hid) if hidden_of is not None else None)
        at = 0
        for k in sub:
            m = len(layer_of[k])
            leaf_logits[k] = logits[at : at + m]
            if hidden_of is not None:
                for j, (nd, *_) in enumerate(layer_of[k]):
                    hidden_of[k][nd] = drafter.last_hidden[at + j]
            at += m
    return forests


def _goes(job: BeamDraftJob, f: BeamForest, beams: list[tuple[int, float, bool]], d: int) -> bool:
    """Whether a request drafts depth d: within its depth, room for a node, and a beam that continues."""
    return d <= job.depth and job.max_nodes > len(f.tokens) and any(c for *_, c in beams)


def _grow(job: BeamDraftJob, f: BeamForest, beams: list[tuple[int, float, bool]], pairs: list[tuple[int, int, float]],
          q: torch.Tensor | None, d: int) -> tuple[list[tuple[int, float, bool]], bool]:
    """Adds depth d's pairs ``(beam slot, token, score)`` of one request to its forest (cut to the nodes left) and
    its draft joint ``q`` (T > 0). Returns the depth's beams ``(node, score, continues)`` and whether pass d runs on
    them (a deeper depth, room for a node, and a beam that continues: a drafted EOS is not continued)."""
    beam = job.state.beam
    pairs = pairs[: job.max_nodes - len(f.tokens)]
    if q is not None:
        f.q.append(q)
    p = beam.params
    eos = None if p.ignore_eos else p.eos_token_id
    n = len(beam.tokens)
    layer = []
    for b, t, sc in pairs:
        par = beams[b][0]
        f.tokens.append(t)
        f.parents.append(par)
        f.depths.append((beam.depths[par] if par < n else f.depths[par - n]) + 1)
        f.drafted.append(False)
        f.layers.append(d)
        f.slots.append(b)
        layer.append((n + len(f.tokens) - 1, sc, eos is None or t != eos))
    return layer, d < job.depth and len(f.tokens) < job.max_nodes and any(c for *_, c in layer)


def _plan(job: BeamDraftJob) -> list[int]:
    """The nodes per depth of a job's forest when every depth's draws fill its N (``nodes``): N, cut to the nodes
    left (``_grow``)."""
    out, left = [], job.max_nodes
    for _ in range(job.depth):
        c = min(job.width, left)
        if c <= 0:
            break
        out.append(c)
        left -= c
    return out


def _static_layout(jobs: list[BeamDraftJob]) -> bool:
    """Whether the static loop can plan these jobs: every request's live beams are trie nodes at one depth (as a
    beam search's are: one token per beam per step), so the depth-d nodes' positions are known in advance."""
    for job in jobs:
        beam = job.state.beam
        if not beam.live or any(b.node < 0 for b in beam.live) or len({beam.depths[b.node] for b in beam.live}) > 1:
            return False
    return True


def _draft_static(drafter, jobs: list[BeamDraftJob], leaf_logits: list[torch.Tensor], beams_of: list,
                  brow: np.ndarray, bs: int, owned: list[int],
                  block_rows: torch.Tensor) -> reads.Reader[list[BeamForest] | None]:
    """:func:`_draft_loop` with one host copy for all depths, on a bet: each depth's draws fill every request's N
    (cut to the nodes left, :func:`_plan`) wherever a pass runs on them, so every node's number, slot and position are
    known in advance and the masks are built on the device (``ForestBatch.assemble``). The final copy feeds
    :func:`_grow`, which checks the bet: None when a pass the loop would run saw another layout (the caller then runs
    the loop: the same keyed draws, rewriting the forest's draft K/V)."""
    beams = [j.state.beam for j in jobs]
    dev, V, R = leaf_logits[0].device, leaf_logits[0].shape[-1], len(jobs)
    plan = [_plan(j) for j in jobs]
    G, W = max(len(p) for p in plan), max(j.width for j in jobs)  # W: the most nodes per depth (N)
    offs = [np.concatenate([[0], np.cumsum(p)]).astype(np.int64) for p in plan]  # first node of each depth
    n_trie = [len(b.tokens) for b in beams]
    nmax = max(int(o[-1]) for o in offs)
    det = [k for k, b in enumerate(beams) if b.temperature <= 0.0]
    samp = [k for k, b in enumerate(beams) if b.temperature > 0.0]
    det_t, samp_t = (torch.tensor(x, dtype=torch.int64, device=dev) for x in (det, samp))
    params_s = beam_params([beams[k] for k in samp], dev, draws=[jobs[k].width for k in samp]) if samp else None
    width = torch.tensor([j.width for j in jobs], dtype=torch.int64, device=dev)
    eos_l = [-1 if b.params.ignore_eos or b.params.eos_token_id is None else b.params.eos_token_id for b in beams]
    eos = torch.tensor(eos_l, dtype=torch.int64, device=dev)
    cap = torch.tensor([[p[d] if d < len(p) else 0 for p in plan] for d in range(G)], dtype=torch.int64, device=dev)
    leaf_nodes = [[nd for nd, *_ in bo] for bo in beams_of]
    S1 = max(len(x) for x in leaf_nodes)
    leaf_t = torch.tensor([x + [0] * (S1 - len(x)) for x in leaf_nodes], dtype=torch.int64, device=dev)
    trie_par = torch.tensor([p for b in beams for p in b.parents], dtype=torch.int64, device=dev)
    trie_at = np.concatenate([[0], np.cumsum(n_trie)]).astype(np.int64)
    fpar = torch.zeros(R * max(nmax, 1), dtype=torch.int64, device=dev)  # forest node parents (node numbers)
    rows, sc = beam_sampling.joint_rows(leaf_logits, [[x[1] for x in bo] for bo in beams_of], torch.float64)
    rows = rows.float()
    live = torch.isfinite(sc)
    draws, qs = [], []
    cols = torch.arange(W, device=dev)[None, :]
    for d in range(1, G + 1):
        S = rows.shape[1]
        parent = torch.zeros(R, W, dtype=torch.int64, device=dev)
        token = torch.zeros(R, W, dtype=torch.int64, device=dev)
        score = torch.full((R, W), -torch.inf, dtype=torch.float64, device=dev)
        valid = torch.zeros(R, W, dtype=torch.bool, device=dev)
        if det:  # ``_top_pairs`` on every T = 0 request
            kk = min(max(jobs[k].width for k in det), S * V)
            vals, idx = top_n(lambda a, b: rows[det_t[a:b]], sc[det_t], [eos_l[k] for k in det], kk, V,
                              _budget(drafter))
            parent[det_t, :kk], token[det_t, :kk], score[det_t, :kk] = idx // V, idx % V, vals
            valid[det_t, :kk] = torch.isfinite(vals) & (cols[:, :kk] < width[det_t][:, None])
        if samp:  # ``_sampled_pairs`` on every T > 0 request
            pos = torch.tensor([rng.forest_position(beams[k].prompt_len + beams[k].steps - 1, d) for k in samp], dtype=torch.int64,
                               device=dev)
            st = beam_step(rows[samp_t], sc[samp_t].float(), live[samp_t], params_s, pos, rng.Stream.DRAFT_DRAW)
            ws = st.valid.shape[1]
            parent[samp_t, :ws], token[samp_t, :ws], score[samp_t, :ws] = st.parent, st.token, st.score.double()
            valid[samp_t, :ws] = st.valid
            qs.append(st.joint)
        draws.append(torch.stack([parent.double(), token.double(), valid.double(), score]))
        planned = valid & (cols < cap[d - 1][:, None])
        cont = planned & ((eos < 0)[:, None] | (token != eos[:, None]))
        # the forest's parents of this depth's planned nodes: a live beam's node at depth 1, a node of depth d - 1
        rk = np.concatenate([np.full(p[d - 1], k) for k, p in enumerate(plan) if d <= len(p)]).astype(np.int64)
        sk = np.concatenate([np.arange(p[d - 1]) for p in plan if d <= len(p)]).astype(np.int64)
        rk_t, sk_t = torch.from_numpy(rk).to(dev), torch.from_numpy(sk).to(dev)
        if d == 1:
            par = leaf_t[rk_t, parent[rk_t, sk_t].clamp(max=S1 - 1)]
        else:
            prev = np.array([plan[k][d - 2] for k in rk], dtype=np.int64)
            base = np.array([n_trie[k] + offs[k][d - 2] for k in rk], dtype=np.int64)
            par = (torch.from_numpy(base).to(dev)
                   + torch.minimum(parent[rk_t, sk_t], torch.from_numpy(prev - 1).to(dev)))
        at = rk * max(nmax, 1) + np.array([offs[k][d - 1] for k in rk], dtype=np.int64) + sk
        fpar[torch.from_numpy(at).to(dev)] = par
        sub = [k for k in range(R) if d < len(plan[k])]  # planned deeper: pass d over their depth-d nodes
        if not sub:
            break
        ids_at, pos, slots, qlens, seqs, cu, ctx, flen, query, gather = [], [], [], [], [], [0], [], [], [], []
        t0, n0 = 0, 0
        for k in sub:
            beam, c, o = beams[k], plan[k][d - 1], int(offs[k][d - 1])
            B, n = beam.base, n_trie[k]
            nodes = [n + o + s for s in range(c)]
            ids_at += [k * W + s for s in range(c)]
            pos += [beam.prompt_len - 1 + beam.depths[leaf_nodes[k][0]] + d] * c
            slots.append(slots_of(brow[k], [B + nd for nd in nodes], bs, owned[k]))
            qlens.append(c)
            seqs.append(B + n + o + c)
            cu.append(cu[-1] + c)
            ctx.append(B)
            flen.append(n + o + c)
            query += [n0 + nd for nd in nodes]
            gather += list(range(int(trie_at[k]), int(trie_at[k]) + n))
            gather += [len(trie_par) + k * max(nmax, 1) + j for j in range(o + c)]
            n0 += n + o + c
            t0 += c
        fb = ForestBatch.assemble(list(range(len(sub))), list(range(t0)), cu, ctx, flen,
                                  torch.cat([trie_par, fpar])[torch.tensor(gather, dtype=torch.int64, device=dev)],
                                  query, max(flen))
        ids_t = torch.tensor(ids_at, dtype=torch.int64, device=dev)
        logits = drafter.forward_ragged(token.flatten()[ids_t], pos, np.concatenate(slots), qlens, seqs,
                                  block_rows[torch.tensor(sub)], list(range(t0)), fb, d)
        rows = torch.zeros(R * W, V, device=dev).index_copy_(0, ids_t, logits).reshape(R, W, V)
        sc, live = torch.where(planned, score, -torch.inf), cont
    host, = yield [torch.stack(draws)]  # the one copy: [depth][parent, token, valid, score][request][slot]
    host = host.tolist()
    forests = [BeamForest([], [], [], []) for _ in jobs]
    beams_of = list(beams_of)
    samp_row = {k: r for r, k in enumerate(samp)}  # a T > 0 request's row in the joints ``qs``
    for d in range(1, len(draws) + 1):
        par_l, tok_l, val_l, sc_l = host[d - 1]
        for k, job in enumerate(jobs):
            if not _goes(job, forests[k], beams_of[k], d):
                continue
            pairs = [(int(par_l[k][s]), int(tok_l[k][s]), sc_l[k][s]) for s in range(W) if val_l[k][s]]
            q = qs[d - 1][samp_row[k]] if k in samp_row else None
            beams_of[k], deeper = _grow(job, forests[k], beams_of[k], pairs, q, d)
            if deeper:
                if d >= len(plan[k]) or len(beams_of[k]) != plan[k][d - 1]:
                    return None  # the loop's pass d would see another layout than the one drafted
                f, n = forests[k], n_trie[k]
                for nd, *_ in beams_of[k]:
                    f.drafted[nd - n] = True
    return forests


def _depth_pairs(jobs: list[BeamDraftJob], logits: list[torch.Tensor], beams_of: list[list[tuple[int, float, bool]]],
                 d: int, budget: int = VERIFY_BUDGET) -> list[tuple[list[tuple[int, int, float]], torch.Tensor | None]]:
    """Depth d's draft beam step of the given jobs (their current draft beams ``(node, score, continues)`` and
    those beams' draft logits rows): T = 0 requests together (``_top_pairs``), T > 0 requests together
    (``_sampled_pairs``). Per request: (its pairs in draw / rank order, its log Q [S * V] at T > 0, else None)."""
    beams = [j.state.beam for j in jobs]
    out: list = [None] * len(beams)
    det = [i for i, b in enumerate(beams) if b.temperature <= 0.0]
    samp = [i for i, b in enumerate(beams) if b.temperature > 0.0]
    scores = [[sc for _, sc, _ in bo] for bo in beams_of]
    if det:
        eos = [None if beams[i].params.ignore_eos else beams[i].params.eos_token_id for i in det]
        tops = _top_pairs([logits[i] for i in det], [scores[i] for i in det],
                          [jobs[i].width for i in det], eos, budget)
        for i, pairs in zip(det, tops):
            out[i] = (pairs, None)
    if samp:
        pairs, q = _sampled_pairs([beams[i] for i in samp], [logits[i] for i in samp], [scores[i] for i in samp],
                                  [[c for *_, c in beams_of[i]] for i in samp], d, [jobs[i].width for i in samp])
        for r, i in enumerate(samp):
            out[i] = (pairs[r], q[r])
    return out
