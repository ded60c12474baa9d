"""The beam step of several beam requests at once (:func:`step_beams`), and its verified forest layers.

T = 0 steps are host work on each row's best tokens; the T > 0 steps' device work runs for all of them together
(``sampling.py``): one beam-sampling draw for the requests without a forest and, beside it in the same read, the
verified layers of the requests with one. This module imports no vLLM.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from vllm_dsbd.core import rng

from .. import reads
from . import sampling as beam_sampling
from .grammar import structured_tops
from .trie import BeamRequest, LiveBeam, PendingStep, StepResult, beam_params

def step_one(beam: BeamRequest, eos_score_token: int | None,
             forest_logits: torch.Tensor | Any | None = None, static_layers: bool = True,
             fused: bool | None = None) -> StepResult:
    """One beam step of one request over its collected leaves, then (a forest verified) more steps while the target's
    new beams are all forest nodes, whose logits this pass computed (``forest_logits``: [F, V] on any device, or their
    ``TopRows`` at T = 0; the first F forest nodes, the ones vLLM scheduled). ``eos_score_token``: the EOS id vLLM's
    length penalty looks at (the tokenizer's, even when EOS is ignored). :func:`step_beams` steps several requests at
    once (``static_layers`` / ``fused`` there)."""
    return reads.run(step_beams([(beam, eos_score_token, forest_logits)], static_layers, fused))[0]


def step_beams(items: list[tuple[BeamRequest, int | None, Any]], static_layers: bool = True,
               fused: bool | None = None) -> reads.Reader[list[StepResult]]:
    """:func:`step_one` of several beam requests whose leaves are all in (``(request, eos_score_token, forest_logits)``
    each); a reader. T = 0 steps are host work; the T > 0 draws and verified layers run on the device for all at once,
    in one read. ``static_layers``: all layers in one read (else one per layer); ``fused``: the layers' kernel (None:
    ``fused.fused_default``)."""
    steps = [b.begin_step(eos, flogits) for b, eos, flogits in items]
    plain = []
    for st in steps:
        b = st.beam
        if b.temperature <= 0.0:
            st.cands = b.search(st.logits, st.eos)
            b.steps += 1
            if st.forest is not None:
                st.n0 = len(b.tokens)  # the trie's length before the forest is grafted
                st.cands, st.passed = b.verify_layers(st.cands, st.forest, st.flogits, st.eos, st.beams)
        elif st.forest is None:
            plain.append(st)
    layered = [st for st in steps if st.beam.temperature > 0.0 and st.forest is not None]
    # a request with stop token ids or strings verifies layer by layer: whether a layer passes depends on which of
    # its pairs finish a beam, which only the host's StopRule knows (the device's static check knows one EOS id)
    yield from reads.gather(_sample_plain(plain) if plain else None,
                            _sample_layers([st for st in layered if st.beam.stops is None], static_layers, fused),
                            _sample_layers([st for st in layered if st.beam.stops is not None], False, fused))
    return [st.beam.end_step(st) for st in steps]


def _sample_plain(plain: list[PendingStep]) -> reads.Reader[None]:
    """T > 0 without a forest: one beam-sampling step of every such request at once."""
    beams = [st.beam for st in plain]
    dev = plain[0].logits.device
    pairs, _ = yield from beam_sampling.sample([st.logits for st in plain],
                                               [[x.sample_score for x in b.live] for b in beams],
                                               [[True] * len(b.live) for b in beams], beam_params(beams, dev),
                                               [b.prompt_len + b.steps for b in beams], rng.Stream.TARGET_DRAW)
    for st, ps in zip(plain, pairs):
        st.cands = [c for p in ps if (c := st.beam.pair(p.beam, p.token, p.logprob, p.score, st.eos)) is not None]
        st.beam.steps += 1


def _sample_layers(steps: list[PendingStep], static_layers: bool = True,
                   fused: bool | None = None) -> reads.Reader[None]:
    """T > 0 with a forest: DSBD's exact layer-by-layer verification (``docs/design/algorithm.md`` §1,
    ``docs/design/beams.md`` §3.3): each layer's K outputs are K draws without replacement from the target joint P
    over the current beams (K = W, or the dynamic-width rule from P and Q only), so each layer is exactly one step of
    target beam sampling; while every new beam is a forest node the next layer runs on its rows. Sets each step's last
    candidates, layers passed and drafted layers' widths."""
    for st in steps:
        st.n0 = st.beam.graft(st.forest, len(st.flogits))
        st.rows = st.logits
    if not steps:
        return
    if static_layers:
        results = yield from beam_sampling.verify_forests(
            [_plan(st) for st in steps], beam_params([st.beam for st in steps], steps[0].logits.device), fused)
        for st, layers in zip(steps, results):
            passed = False
            for n, (pairs, k) in enumerate(layers):
                st.drafts = _layer_drafts(st)
                passed = _take(st, pairs, k, rows=False)
                if passed != (n + 1 < len(layers)):
                    raise RuntimeError(f"DSBD beams: layer {n + 1} of a static verification "
                                       f"{'passed' if passed else 'ended'} on the host, not on the device")
        return
    active = list(steps)
    while active:
        layers = []
        for st in active:
            b, f, V = st.beam, st.forest, st.rows.shape[-1]
            st.drafts = _layer_drafts(st)
            layers.append(beam_sampling.Layer(
                logits=st.rows, scores=[x.sample_score for x in b.live],
                drafts=[f.slots[c] * V + f.tokens[c] for c in st.drafts],
                logq=f.q[f.layers[st.drafts[0]] - 1] if st.drafts else None, position=b.prompt_len + b.steps,
                dynamic=b.params.dynamic_width))
        pairs, ks = yield from beam_sampling.verify(layers, beam_params([st.beam for st in active],
                                                                       active[0].rows.device), fused)
        active = [st for st, ps, k in zip(active, pairs, ks) if _take(st, ps, k)]


def _layer_drafts(st: PendingStep) -> list[int]:
    """The forest nodes (numbers c, in draw order) of the layer the step verifies next."""
    return [c for c in range(len(st.flogits)) if st.forest.layers[c] == st.layer]


def _plan(st: PendingStep) -> beam_sampling.Plan:
    """A step's forest as ``beam_sampling.verify_forests`` takes it."""
    b, f, V = st.beam, st.forest, st.logits.shape[-1]
    by_depth: dict[int, list[int]] = {}
    for c in range(len(st.flogits)):
        by_depth.setdefault(f.layers[c], []).append(c)
    drafts = [by_depth.get(d, []) for d in range(1, max(by_depth, default=0) + 1)]
    return beam_sampling.Plan(
        leaves=st.logits, scores=[x.sample_score for x in b.live], nodes=st.flogits, drafts=drafts,
        joint=[[f.slots[c] * V + f.tokens[c] for c in ds] for ds in drafts], logq=f.q[: len(drafts)],
        position=b.prompt_len + b.steps, layers=b.params.max_tokens - b.steps, dynamic=b.params.dynamic_width,
        eos=-1 if st.eos is None else st.eos)


def _take(st: PendingStep, pairs: list, k: int, rows: bool = True) -> bool:
    """Applies one verified layer's outputs (``st.drafts`` its drafts) to the request: EOS pairs finish beams, the
    others are the step's candidates. Returns whether the layer passed (drafts there, a candidate, every candidate a
    draft, a step left): then the drafts become the live beams, scored by the candidates they are (the others dead
    slots), and (``rows``) their logits rows the next layer's."""
    b, f, V = st.beam, st.forest, st.logits.shape[-1]
    node_of = {f.slots[c] * V + f.tokens[c]: st.n0 + c for c in st.drafts}
    cands, nodes = [], []
    for p in pairs:
        if (c := b.pair(p.beam, p.token, p.logprob, p.score, st.eos)) is not None:
            cands.append(c)
            nodes.append(node_of.get(p.beam * V + p.token))
    b.steps += 1
    if st.drafts:
        st.widths.append(k)
    st.cands = cands
    if not st.drafts or not cands or None in nodes or b.steps >= b.params.max_tokens:
        return False
    st.passed += 1
    # the layer passed: the next layer's beams are forest nodes; its parent slots are this depth's nodes (what the
    # deeper drafts were drawn from), the ones that are not beams stay in as dead slots
    live = [LiveBeam(st.n0 + c, -math.inf, -math.inf) for c in st.drafts]
    slot_of = {st.n0 + c: i for i, c in enumerate(st.drafts)}
    for nd, (_, _, cum, v, ss) in zip(nodes, cands):
        b.logprobs[nd] = v
        live[slot_of[nd]] = LiveBeam(nd, cum, ss)
    b.live = live
    if rows:
        st.rows = st.flogits[torch.tensor(st.drafts, device=st.flogits.device)]
    st.layer += 1
    return True


def beam_rows(logits: torch.Tensor, plan: list, ks: list[int]) -> reads.Reader[dict]:
    """What the beam steps of beam requests ``ks`` (plan indices) read of their logits rows (leaves, then forest nodes),
    a reader: T > 0 the float32 rows, left on the device; T = 0 their ``TopRows``, computed on the device and read in
    one copy. No logits row leaves the device. Returns plan index -> its rows."""
    if not ks:
        return {}
    spans = [(plan[k].first_row, plan[k].leaves + plan[k].forest_nodes) for k in ks]
    idx = torch.tensor([a + j for a, m in spans for j in range(m)], dtype=torch.int64, device=logits.device)
    rows = logits[idx].float()
    out, at, det, gram = {}, 0, [], []
    for k, (_, m) in zip(ks, spans):
        beam = plan[k].state.beam
        if beam.grammar is not None:  # structured outputs (grammar.py): leaves only, never a forest
            if plan[k].forest_nodes:
                raise RuntimeError("DSBD beams: a structured beam request was scheduled a forest")
            gram.append((k, at, m))
        elif beam.temperature <= 0.0:
            det.append((k, at, m, 2 * beam.params.width))
        else:
            out[k] = rows[at : at + m]
        at += m
    sel = torch.cat([torch.arange(a, a + m) for _, a, m, _ in det]).to(logits.device) if det else None
    gsel = torch.cat([torch.arange(a, a + m) for _, a, m in gram]).to(logits.device) if gram else None
    tops, gtops = yield from reads.gather(
        beam_sampling.top_rows(rows[sel], [w for *_, w in det], [m for _, _, m, _ in det]) if det else None,
        structured_tops(rows[gsel], [(plan[k].state.beam, m) for k, _, m in gram]) if gram else None)
    out.update({k: t for (k, *_), t in zip(det, tops or [])})
    out.update({k: t for (k, *_), t in zip(gram, gtops or [])})
    return out
