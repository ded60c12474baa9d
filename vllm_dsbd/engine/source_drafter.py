"""Forests without a draft model: nodes from the draft-free sources (``core/sources.py``: the target's own recycled
rows and lookup in the request's text), for plain and beam requests alike.

Each depth, every node of the frontier (the root or the live beams at depth 1) gets the sources' candidates with
their estimated log-probabilities as a row of "draft logits" (-inf at every other token), a plain request's rows go
through its grammar, logits rules and penalties after the node's path (``processors.DraftRows``, as a draft model's
rows do), and the engine's own draft step runs on those rows as it runs on a draft model's: plain requests
``core.beam_step`` (T = 0 the W best pairs, T > 0 W draws without replacement from the joint Q, keyed by the request's
seed, the forest's root and the depth (``rng.forest_position``) and ``DRAFT_DRAW``), beam requests the N best pairs by
beam score + estimate (T = 0) or N draws from Q (T > 0, as ``beams.drafter._sampled_pairs``). So the proposal law Q is
a function of the past only and each draw is a real draw from it: verification (which is told Q) stays exact, and a
node with a single candidate is a point mass (Q one-hot: accepted with probability p(x)). Nothing runs on the model:
a forest costs host work only.

The rows the target computes feed the recycle table (:func:`harvest`, in the runner's read of the step); lookup
indexes each request's text when it drafts. docs/design.md §3.4 (plain forests), §3.3 (beam drafting).
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core import rng
from vllm_dsbd.core.forest import Forest
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.core.sources import NMAX, RECYCLE_K, SourceIndex

from . import chunks, reads
from .beams import sampling as beam_sampling
from .beams.drafter import BeamDraftJob, _grow
from .beams.trie import BeamForest, beam_params
from .drafter import DraftJob, draft_rows
from .layout import _layout_np, _pad_cols
from .mixing import beam_tail, index_live_beams

from .state import PendingForest, RequestState, batch_params

logger = logging.getLogger("vllm.vllm_dsbd.engine")


def sources_of(st: RequestState, cfg: DSBDConfig) -> SourceIndex:
    """The request's source index, made on first use."""
    if st.sources is None:
        st.sources = SourceIndex(recycle="recycle" in cfg.sources, lookup="lookup" in cfg.sources)
    return st.sources


class SourceDrafter:
    """The drafter of an engine without a draft model whose ``sources`` are draft-free: no model, no K/V of its own
    (``kv_cache_gid`` 0: the target's group, for the blocks a beam forest may use)."""

    kv_cache_gid = 0
    static_drafting = False
    model = None  # no draft model (load_probe: its pass costs nothing)

    def __init__(self, runner, cfg: DSBDConfig):
        self.runner, self.cfg = runner, cfg
        self.forward_passes = 0
        self.static_misses = self.beam_static_misses = 0

    def load_model(self, target_model) -> None:
        logger.info("DSBD: engine without a draft model drafting from %s", "+".join(self.cfg.sources))

    def propose(self, *args, **kwargs):  # what vLLM's custom-class proposer check asks for; never called
        raise RuntimeError("DSBD engine without a draft model: vLLM's proposer is not used")

    def block_table_host(self):
        bt = self.runner.input_batch.block_table[self.kv_cache_gid]
        return bt.block_table.cpu, bt.block_size, bt.num_blocks_per_row

    # plain requests ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_forests(self, jobs: list[DraftJob]) -> reads.Reader[list[PendingForest | None]]:
        """One forest per job (``job.tokens``: the whole text up to the root, since no draft K/V is ever kept), its
        depth-d nodes ``core.beam_step``'s draws on the sources' rows, masked by the request's grammar and logits rules
        and penalised (``processors.DraftRows``, from ``job.history``) as a draft model's rows are. A reader: the jobs
        without rows to process are drafted on the host (:func:`host_layers`, the same draws, no read of the
        device), the others on the device with one host read per depth (and one per depth for a grammar's paths)."""
        out: list[PendingForest | None] = [None] * len(jobs)
        host = [k for k, j in enumerate(jobs) if on_host(j)]
        if host:
            for k, pf in zip(host, self._host_forests([jobs[k] for k in host])):
                out[k] = pf
        hosted = set(host)
        rest = [k for k in range(len(jobs)) if k not in hosted]
        if rest:
            got = yield from self._device_forests([jobs[k] for k in rest])
            for k, pf in zip(rest, got):
                out[k] = pf
        return out

    def _host_forests(self, jobs: list[DraftJob]) -> list[PendingForest | None]:
        """:meth:`propose_forests` of jobs without rows to process: ``beam_step``'s draws (:func:`host_layers`) made
        on the host, and the forest put on the device in one go (its joint -inf outside the drawn-from entries, as
        ``beam_step`` leaves it)."""
        dev, W = self.runner.device, self.cfg.width
        V = self.runner.model_config.get_vocab_size()
        for j in jobs:
            sources_of(j.state, self.cfg).index_text(j.tokens)
        valid, parent, token, score, depth, cand = host_layers(jobs, W, V)
        g, G, R = valid.shape[1], self.cfg.depth, len(jobs)
        if g == 0:
            return [None] * R

        def full(a, fill):  # [R, g, W] -> [R, G, W] on the device: every request's forest is then a view of it
            return torch.from_numpy(np.pad(a, ((0, 0), (0, G - g), (0, 0)), constant_values=fill)).to(dev)

        q = torch.full((R, G, W * V), -math.inf, device=dev)
        if cand[0]:
            q[torch.tensor(cand[:3], dtype=torch.int64).to(dev).unbind()] = torch.tensor(cand[3]).to(dev)
        forest = Forest(parent=full(parent, 0), token=full(token, 0), valid=full(valid, False),
                        score=full(score, -math.inf), q_joint=q, depth=torch.from_numpy(depth).to(dev))
        return self._pending(jobs, forest, valid, parent, token, depth, W, V, views=True)

    def _pending(self, jobs, forest: Forest, fv: np.ndarray, parent: np.ndarray, tokens: np.ndarray,
                 depth_np: np.ndarray, W: int, V: int, views: bool = False) -> list[PendingForest | None]:
        """Each job's pending forest from the batch's forest (``fv``, ``parent``, ``tokens``: its valid mask, parent
        slots and tokens [R, g, W] on the host, ``fv`` already cut at ``depth_np``); ``views``: the batch's forest is
        already [R, depth, W] (joint [R, depth, W V]), so each request's is a view of it (no device operation)."""
        g = fv.shape[1]
        _, _, parents = _layout_np(fv, parent)
        fdepth = np.repeat(np.arange(1, g + 1)[:, None], W, 1)
        out = []
        for i, j in enumerate(jobs):
            v = fv[i]
            if depth_np[i] <= 0 or not v.any():
                out.append(None)
                continue
            f = (Forest(*(t[i : i + 1] for t in (forest.parent, forest.token, forest.valid, forest.score,
                                                  forest.q_joint, forest.depth)))
                 if views else _one(forest, i, self.cfg.depth, W, V))
            # uncut: what ``sampler.truncate`` gives when nothing is cut (every layer up to the depth has a node), so
            # the runner reads nothing of it
            out.append(PendingForest(forest=f, tokens=tokens[i][v].tolist(), parents=parents[i][v].tolist(),
                                     depths=fdepth[v].tolist(), root_pos=j.root_pos, depth=int(depth_np[i]),
                                     uncut=f))
        return out

    def _device_forests(self, jobs: list[DraftJob]) -> reads.Reader[list[PendingForest | None]]:
        """:meth:`propose_forests` on the device: ``core.beam_step`` on the sources' rows, one read per depth."""
        dev = self.runner.device
        R, W = len(jobs), self.cfg.width
        G = max(j.depth for j in jobs)
        params = batch_params([j.state for j in jobs], [j.depth for j in jobs], self.cfg)
        if any(j.width is not None for j in jobs):
            w = torch.tensor([j.state.width if j.width is None else j.width for j in jobs], dtype=torch.int64)
            params = params.with_(width=w, min_width=torch.minimum(params.min_width, w))
        params = params.to(dev)
        root_pos = np.array([j.root_pos for j in jobs], dtype=np.int64)
        L = torch.from_numpy(root_pos + 1).to(dev)
        V = self.runner.model_config.get_vocab_size()
        ctx = []  # per request, per slot: the slot's last tokens (None: no beam there)
        for j in jobs:
            src = sources_of(j.state, self.cfg)
            src.index_text(j.tokens)
            ctx.append([list(j.tokens[-NMAX:])] + [None] * (W - 1))
        depth_np = np.array([j.depth for j in jobs], dtype=np.int64)
        scores = torch.zeros(R, W, device=dev)
        steps, valid_np, parent_np, token_np = [], [], [], []
        eos = [j.state.eos for j in jobs]
        # requests with a grammar, logits rules or penalties: each slot's row processed by the slot's own history
        # before each draft step, as the model drafter's rows are (so Q, recorded for verification, is that law)
        pen = draft_rows(jobs, W, V, dev)
        for d in range(1, G + 1):
            full, live, live_np = _rows([[None if c is None else jobs[r].state.sources.propose(c) for c in ctx[r]]
                                         for r in range(R)], V, dev)
            live &= torch.from_numpy(depth_np >= d)[:, None].to(dev)
            live_np &= (depth_np >= d)[:, None]  # the same mask on the host
            if d == 1:
                depth_np = np.where(live_np.any(1), depth_np, 0)  # no candidate at the root: no forest
            if not live_np.any():
                break
            if pen is not None:  # a row whose every candidate the rules mask is no longer live (its draws end)
                full = pen.apply(full)
                live &= torch.isfinite(full).any(-1)
            st = beam_step(full, scores, live, params.with_(depth=torch.from_numpy(depth_np.copy()).to(dev)),
                           rng.forest_position(L - 1, d), rng.Stream.DRAFT_DRAW)
            if pen is not None:
                pen.advance(st.parent, st.token)
            st.valid &= torch.from_numpy(depth_np >= d)[:, None].to(dev)
            steps.append(st)
            ws = st.valid.shape[1]
            host, = yield [torch.cat([st.valid.long(), st.parent, st.token], 1)]
            host = host.numpy()
            v_np, p_np, t_np = host[:, :ws].astype(bool), host[:, ws : 2 * ws], host[:, 2 * ws :]
            valid_np.append(_pad_cols(v_np, W, False))
            parent_np.append(_pad_cols(p_np, W, 0))
            token_np.append(_pad_cols(t_np, W, 0))
            scores = torch.nn.functional.pad(st.score, (0, W - ws), value=-math.inf)
            new = []
            for r in range(R):
                row = [None] * W
                for s in range(ws):
                    if v_np[r, s] and not (eos[r] >= 0 and t_np[r, s] == eos[r]):
                        row[s] = (ctx[r][p_np[r, s]] + [int(t_np[r, s])])[-NMAX:]
                new.append(row)
            ctx = new
            depth_np = np.where(v_np.any(1) | (depth_np < d), depth_np, d - 1)  # draws ended: the forest ends
        depth_np = np.minimum(depth_np, len(steps))
        if not steps:
            return [None] * R
        depth = torch.from_numpy(depth_np.copy()).to(dev)
        forest = Forest.from_steps(steps, depth, W)
        g = len(steps)
        fv = np.stack(valid_np, 1) & (np.arange(g)[None, :] < depth_np[:, None])[:, :, None]
        return self._pending(jobs, forest, fv, np.stack(parent_np, 1), np.stack(token_np, 1), depth_np, W, V)

    # beam requests -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_beam_forests(self, jobs: list[BeamDraftJob]) -> reads.Reader[None]:
        """Every job's forest (``state.beam.forest``): depth by depth, T = 0 the N best (beam, token) pairs by
        cumulative score + the sources' estimate (EOS excluded), T > 0 N draws without replacement from Q (the
        sources' rows at the request's temperature, kept for the verification); N is ``job.width`` (the cost model's
        N' where it chose one), the N the forest is booked with. A reader (no read at T = 0)."""
        V = self.runner.model_config.get_vocab_size()
        dev = self.runner.device
        for job in jobs:
            beam, src = job.state.beam, sources_of(job.state, self.cfg)
            linear = job.prompt_tail  # the whole linear context (no draft K/V: the catch-up starts at 0)
            src.index_text(linear)
            t0 = beam.temperature <= 0.0
            # (node, score, continues, last tokens); the beams' newest tokens indexed for lookup
            frontier = [(b.node, b.score if t0 else b.sample_score, True, tail)
                        for b, tail in zip(beam.live, index_live_beams(src, beam, linear, job.depth))]
            eos = None if beam.params.ignore_eos else beam.params.eos_token_id
            f = BeamForest([], [], [], [])
            for d in range(1, job.depth + 1):
                if job.max_nodes <= len(f.tokens) or not any(c for _, _, c, _ in frontier):
                    break
                props = [src.propose(tail) if c else {} for _, _, c, tail in frontier]
                if t0:  # the N best pairs by score (stable: beam order, then the sources' order)
                    cands = [(sc + v, b, t) for b, ((_, sc, _, _), p) in enumerate(zip(frontier, props))
                             for t, v in p.items() if t != eos]
                    cands.sort(key=lambda c: c[0], reverse=True)
                    pairs, q = [(b, t, v) for v, b, t in cands[: job.width]], None
                else:
                    rows, _, live_np = _rows([props], V, dev)
                    live_np &= np.array([[c for _, _, c, _ in frontier]], dtype=bool)
                    if not live_np.any():
                        break
                    got, joint = yield from beam_sampling.sample(
                        [rows[0]], [[sc for _, sc, _, _ in frontier]], live_np.tolist(),
                        beam_params([beam], dev, [job.width]),
                        [rng.forest_position(beam.prompt_len + beam.steps - 1, d)], rng.Stream.DRAFT_DRAW)
                    pairs, q = [(p.beam, p.token, p.score) for p in got[0]], joint[0]
                if not pairs:
                    break
                layer, deeper = _grow(job, f, [(nd, sc, c) for nd, sc, c, _ in frontier], pairs, q, d)
                n = len(beam.tokens)
                frontier = [(nd, sc, c, (frontier[f.slots[nd - n]][3] + [f.tokens[nd - n]])[-NMAX:])
                            for nd, sc, c in layer]
                if not deeper:
                    break
            f.nodes = job.width
            beam.forest = f if f.tokens else None


def on_host(job: DraftJob) -> bool:
    """Whether a plain job is drafted on the host (:func:`host_layers`): no grammar, logits rules or penalties, whose
    processing of the rows runs on the device (``job.history`` is given exactly for those)."""
    return job.history is None


def _lse(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(math.fsum(math.exp(x - top) for x in xs))


def _mask_top_k_top_p(pairs: list[list], top_k: int, top_p: float) -> list[list]:
    """``core.joint._top_k_top_p`` on a row's finite entries ([joint, index, ...], any order): the top-k (ties at the
    k-th kept; all when fewer), then the smallest top set holding mass >= top_p (ties at its threshold kept)."""
    if top_k > 0 and len(pairs) > top_k:
        kth = sorted((p[0] for p in pairs), reverse=True)[top_k - 1]
        pairs = [p for p in pairs if p[0] >= kth]
    if top_p < 1.0:
        srt = sorted((p[0] for p in pairs), reverse=True)
        z = _lse(srt)
        before, last = 0.0, 0
        for k, x in enumerate(srt):
            if k > 0 and before >= top_p:
                break
            last = k
            before += math.exp(x - z)
        pairs = [p for p in pairs if p[0] >= srt[last]]
    return pairs


def host_layers(jobs: list[DraftJob], W: int, V: int):
    """The forests ``core.beam_step`` draws from the sources' rows (``_device_forests``), computed on the host. Depth
    by depth, each request's live slots (the root, then the kept nodes not ending in EOS) get the sources' candidates
    (tokens in [0, V)) as a row -inf elsewhere: log-softmax of the row at the request's temperature (1 at T = 0) plus
    the slot's score is the joint over (slot, token). T = 0: the request's ``width`` best pairs by it (ties: the lower
    joint index ``slot * V + token``). T > 0: the joint shifted by the live slots' best score, masked by the request's
    top-k / top-p, normalised to log Q, and the ``width`` best pairs by log Q + Gumbel noise drawn at those pairs' joint
    indices with ``beam_step``'s key (seed, ``rng.forest_position(root, d)``, ``DRAFT_DRAW``): the same numbers it adds
    to every entry, needed only where log Q is finite. A request ends where it has no live slot or reaches its depth.

    Returns host arrays ``valid``, ``parent``, ``token``, ``score`` [R, g, W] (g: the deepest depth drawn; ``valid``
    cut at each request's depth), ``depth`` [R] and the finite entries of each depth's joint (lists of request, depth,
    joint index and log Q; T = 0: the score, as ``beam_step`` leaves it), -inf elsewhere."""
    R = len(jobs)
    slots: list[list] = [[(list(j.tokens[-NMAX:]), 0.0)] for j in jobs]  # per request: (last tokens, score) | None
    layers: list[list] = [[] for _ in jobs]  # per request, per depth: [(slot, token, score)] of the kept pairs
    live = [j.depth >= 1 for j in jobs]
    cr, cd, ci, cv = [], [], [], []
    for d in range(1, max((j.depth for j in jobs), default=0) + 1):
        draws = []  # sampling requests of this depth: (r, entries [log Q, index, score])
        for r, j in enumerate(jobs):
            if not live[r] or d > j.depth:
                live[r] = False
                continue
            st = j.state
            t = float(np.float32(st.temperature)) if st.temperature > 0.0 else 1.0  # the params' float32 values
            entries, scores = [], []
            for s, slot in enumerate(slots[r]):
                if slot is None:
                    continue
                prop = [(tok, v / t) for tok, v in st.sources.propose(slot[0]).items() if 0 <= tok < V
                        and math.isfinite(v)]
                if not prop:
                    continue
                z = _lse([x for _, x in prop])
                scores.append(slot[1])
                entries += [[slot[1] + (x - z), s * V + tok] for tok, x in prop]
            if not entries:
                live[r] = False
                continue
            if st.temperature <= 0.0:
                entries.sort(key=lambda e: (-e[0], e[1]))
                for e in entries:
                    cr.append(r), cd.append(d - 1), ci.append(e[1]), cv.append(e[0])
                _keep(jobs, r, W, V, d, slots, layers, [(e[1], e[0]) for e in entries])
                continue
            shift = max(scores)
            entries = _mask_top_k_top_p([[e[0] - shift, e[1], e[0]] for e in entries], st.top_k,
                                        float(np.float32(st.top_p)))
            z = _lse([e[0] for e in entries])
            draws.append((r, [[e[0] - z, e[1], e[2]] for e in entries]))
        if draws:  # the noise of every sampling request's finite entries at this depth, at once
            idx = torch.tensor([e[1] for _, es in draws for e in es], dtype=torch.int64)
            n = torch.tensor([len(es) for _, es in draws])
            seed = torch.tensor([jobs[r].state.seed for r, _ in draws], dtype=torch.int64)
            root = torch.tensor([jobs[r].root_pos for r, _ in draws], dtype=torch.int64)
            key = draft_keys(seed, root, d)
            noise = rng.gumbel_of_(rng.uniform(key.repeat_interleave(n), idx)).tolist()
            at = 0
            for r, es in draws:
                for e in es:
                    cr.append(r), cd.append(d - 1), ci.append(e[1]), cv.append(e[0])
                keys = sorted(((e[0] + noise[at + k], e[1], e[2]) for k, e in enumerate(es)),
                              key=lambda x: (-x[0], x[1]))
                at += len(es)
                _keep(jobs, r, W, V, d, slots, layers, [(i, sc) for _, i, sc in keys])
    depth = np.array([len(ls) for ls in layers], dtype=np.int64)
    g = int(depth.max()) if R else 0
    valid = np.zeros((R, g, W), dtype=bool)
    parent = np.zeros((R, g, W), dtype=np.int64)
    token = np.zeros((R, g, W), dtype=np.int64)
    score = np.full((R, g, W), -math.inf, dtype=np.float32)
    for r, ls in enumerate(layers):
        for d, kept in enumerate(ls):
            for k, (s, t, v) in enumerate(kept):
                valid[r, d, k], parent[r, d, k], token[r, d, k], score[r, d, k] = True, s, t, v
    return valid, parent, token, score, depth, (cr, cd, ci, cv)


def draft_keys(seed: torch.Tensor, root: torch.Tensor, depth: int) -> torch.Tensor:
    """The ``DRAFT_DRAW`` keys of the depth-``depth`` draws of forests rooted at ``root`` (int64 [n], with their
    requests' seeds): ``beam_step``'s, from the word ``rng.forest_position(root, depth)``."""
    return rng.request_key(seed, rng.forest_position(root, depth), rng.Stream.DRAFT_DRAW)


def _keep(jobs, r: int, W: int, V: int, d: int, slots: list, layers: list, ranked: list[tuple[int, float]]) -> None:
    """Request r's depth-d nodes: the first ``width`` of ``ranked`` (joint index, score), best first; its next slots
    (an EOS node is not continued)."""
    j = jobs[r]
    width, eos = min(W, j.state.width if j.width is None else j.width), j.state.eos
    kept = [(i // V, i % V, sc) for i, sc in ranked[:width]]
    layers[r].append(kept)
    old = slots[r]
    slots[r] = [None if (eos >= 0 and t == eos) else ((old[s][0] + [t])[-NMAX:], sc) for s, t, sc in kept]


def _rows(props: list[list[dict[int, float] | None]], V: int, dev) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Draft-logits rows [R, S, V] from the candidates of each slot (-inf elsewhere; a slot without candidates is a
    row of zeros, not live), made on ``dev`` from the candidates alone (no [R, S, V] host tensor to copy), and the live
    mask [R, S] on ``dev`` and on the host (the callers' branches read the host one: no read of the device)."""
    R, S = len(props), max(len(p) for p in props)
    live = np.zeros((R, S), dtype=bool)
    r_i, s_i, t_i, v_i = [], [], [], []
    for r, row in enumerate(props):
        for s, p in enumerate(row):
            if p:
                live[r, s] = True
                for t, v in p.items():
                    if 0 <= t < V:
                        r_i.append(r), s_i.append(s), t_i.append(t), v_i.append(v)
    full = torch.full((R, S, V), -math.inf, device=dev)
    if r_i:
        idx = torch.tensor([r_i, s_i, t_i], dtype=torch.int64).to(dev)
        full[idx[0], idx[1], idx[2]] = torch.tensor(v_i, dtype=torch.float32).to(dev)
    live_t = torch.from_numpy(live.copy()).to(dev)
    full[~live_t] = 0.0
    return full, live_t, live


def _one(forest: Forest, i: int, G: int, W: int, V: int) -> Forest:
    """Request i's forest padded to [1, G, W] (joint [1, G, W * V])."""
    g = forest.parent.shape[1]

    def pad(t, fill):
        t = t[i : i + 1]
        return torch.nn.functional.pad(t, (0, W - t.shape[2], 0, G - g), value=fill)

    qj = forest.q_joint[i : i + 1]
    qj = torch.nn.functional.pad(qj, (0, W * V - qj.shape[2], 0, G - g), value=-math.inf)
    return Forest(parent=pad(forest.parent, 0), token=pad(forest.token, 0), valid=pad(forest.valid, False),
                  score=pad(forest.score, -math.inf), q_joint=qj, depth=forest.depth[i : i + 1].clone())


def row_contexts(plan: list, token_ids, discard) -> list[tuple[RequestState, int, list[int]]]:
    """The step's target rows of requests with sources, before the step changes them: (state, logits row, the row's
    last two tokens) for each plain root and forest node, and each leaf and forest node of a beam request's pass
    (``token_ids``: the input batch's host token ids, row i = plan entry i; every request's index was made by
    :func:`prompt_rows` when the step was planned)."""
    out = []
    for i, row in enumerate(plan):
        st = row.state
        if discard[i] or st.sources is None:
            continue
        if st.beam is None:
            L = row.context_len
            root = [int(t) for t in token_ids[i, max(0, L - 2):L]]
            out.append((st, row.first_row, root))
            if row.forest is not None:
                toks, pars = row.forest.tokens, row.forest.parents
                for c in range(row.num_nodes):
                    prev = root[-1] if pars[c] < 0 else toks[pars[c]]
                    out.append((st, row.first_row + 1 + c, [prev, toks[c]]))
            continue
        beam = st.beam
        P = beam.prompt_len
        linear = [int(t) for t in token_ids[i, max(0, P - 2):P]] + beam.prefix[-2:]
        first = beam.fixed - 1
        for j in range(row.leaves):
            if first + j < len(beam.live):
                out.append((st, row.first_row + j, beam_tail(beam, linear, beam.live[first + j].node, 2)))
        f = beam.forest
        if f is not None and row.forest_nodes:
            n = len(beam.tokens)
            for c in range(min(row.forest_nodes, len(f.tokens))):
                p = f.parents[c]
                prev = beam_tail(beam, linear, p, 1) if p < n else [f.tokens[p - n]]
                out.append((st, row.first_row + row.leaves + c, prev[-1:] + [f.tokens[c]]))
    return out


PROMPT_ROWS = 1024  # the most prompt rows of a request recycled (its last ones)
PROMPT_CHUNK = 256  # prompt rows per LM-head call (bounds the [rows, V] logits block)


def prompt_rows(plan: list, batch, qsl, computed, scheduled, cfg: DSBDConfig, keep=None, limit=None) -> list[
        tuple[RequestState, int, list[int]]]:
    """The prefill rows of this pass worth recycling: (state, row in the pass, the row's last two tokens) for each
    prompt token before the last (whose row vLLM computes anyway: the root's), within the prompt's last
    ``PROMPT_ROWS`` (``batch``: vLLM's input batch, row i = plan entry i), of the requests ``keep(state)`` keeps
    (default all); with ``limit(state, prompt length)`` (an int, or None: no limit) within the prompt's last that
    many (the cost model's price of rows, ``cost.prompt_row_limit``)."""
    out, token_ids = [], batch.token_ids_cpu
    for i, row in enumerate(plan):
        st, c, P = sources_of(row.state, cfg), int(computed[i]), int(batch.num_prompt_tokens[i])
        if c >= P - 1 or (keep is not None and not keep(row.state)):
            continue
        cap = PROMPT_ROWS if limit is None or (n := limit(row.state, P)) is None else min(PROMPT_ROWS, n)
        lo, hi = max(c, P - 1 - cap), min(c + int(scheduled[i]), P - 1)
        toks = token_ids[i, max(0, lo - 1):hi].tolist()
        for pos in range(lo, hi):
            j = pos - max(0, lo - 1)
            out.append((row.state, int(qsl[i]) + pos - c, toks[max(0, j - 1):j + 1]))
    return out


def recycle_prompt(model, hidden: torch.Tensor, rows: list[tuple[RequestState, int, list[int]]],
                   budget: int | None = None) -> None:
    """The recycle source's intake of prompt rows: the target's LM head over their hidden states (which vLLM leaves
    without logits), in chunks, each row's ``RECYCLE_K`` best tokens into its request's table (:func:`harvest`, under
    ``budget``)."""
    for a in range(0, len(rows), PROMPT_CHUNK):
        part = rows[a : a + PROMPT_CHUNK]
        idx = torch.tensor([r for _, r, _ in part], dtype=torch.int64, device=hidden.device)
        reads.run(harvest(model.compute_logits(hidden[idx]), [(st, k, ctx) for k, (st, _, ctx) in enumerate(part)],
                          budget))


# float32 [rows, V] blocks one chunk of the harvest holds at once: the rows' gather (and their float copy where the
# logits are narrower), their log-softmax and its working set
HARVEST_BLOCKS = 4


def harvest(logits: torch.Tensor, rows: list[tuple[RequestState, int, list[int]]],
            budget: int | None = None) -> reads.Reader[None]:
    """The recycle source's intake: each row's ``RECYCLE_K`` best tokens and raw log-probabilities into its request's
    table, keyed by the row's last tokens. In chunks of rows whose float32 working set stays under ``budget``
    elements (default ``chunks.VERIFY_BUDGET``; the runner's is verification's): only the chunks' ``[rows, K]``
    results are held while the reader waits for its one read (verification runs meanwhile, ``reads.gather``)."""
    if not rows:
        return
    V = logits.shape[-1]
    step = max(1, (chunks.VERIFY_BUDGET if budget is None else budget) // (HARVEST_BLOCKS * V))
    got = []
    for a in range(0, len(rows), step):
        idx = torch.tensor([r for _, r, _ in rows[a : a + step]], dtype=torch.int64, device=logits.device)
        x = torch.log_softmax(logits[idx].float(), dim=-1)  # (a CPU's log_softmax costs half of logsumexp)
        vals, ids = torch.topk(x, RECYCLE_K, dim=-1)
        got.append(torch.stack([vals.double(), ids.double()]))
        del x
    host, = yield [torch.cat(got, 1) if len(got) > 1 else got[0]]
    vals_l, ids_l = host.tolist()
    for (st, _, ctx), v, t in zip(rows, vals_l, ids_l):
        st.sources.add_row(ctx, [int(x) for x in t], v)
