"""A T = 0 beam step's candidates ranked as arrays (``BeamRequest.search`` without stops: O(W) Python objects per step,
for wide beams) are vLLM's: an independent reference written as vLLM's ``LLM.beam_search`` loop does it (each live
beam's 2W best tokens in rank order, a candidate ending in EOS completes its beam, the others ``sorted(...,
reverse=True)`` by cumulative log-probability or by ``get_beam_search_score`` and cut to W), on random rows with many
ties (values from a small set), with EOS among the candidates, kept with ``ignore_eos`` under ``rank_by_score`` and a
length penalty != 1. A planted variant (an unstable sort) is told apart, so the comparison can fail."""
from __future__ import annotations

import random

import pytest

from vllm_dsbd.engine.beams.sampling import TopRows
from vllm_dsbd.engine.beams.trie import BeamRequest, LiveBeam
from vllm_dsbd.requests import BeamParams

P, EOS = 7, 3


def _reference(scores, top, W, eos, score_eos, rank_by_score, lp, n, stable=True):
    cands, done = [], []
    for b, s in enumerate(scores):
        for v, t in zip(top.vals[b], top.idx[b]):
            if eos is not None and t == eos:
                done.append((b, s + v))
            else:
                cands.append((b, t, s + v, v))

    def key(c):
        if not rank_by_score or score_eos is None:
            return c[2]
        return c[2] / ((n - 1 if c[1] == score_eos else n) ** lp)

    if stable:
        ranked = sorted(cands, key=key, reverse=True)
    else:  # planted: equal keys in the opposite order
        ranked = sorted(cands[::-1], key=key, reverse=True)
    return [c[:4] for c in ranked[:W]], done


def _case(rng, W, ignore_eos, rank_by_score, lp):
    k = 2 * W
    scores = [rng.choice([-1.0, -1.5, -2.25]) for _ in range(W)]
    vals, idx = [], []
    for _ in range(W):
        toks = rng.sample(range(40), k)
        if rng.random() < 0.4 and EOS not in toks:
            toks[rng.randrange(k)] = EOS
        row = sorted((rng.choice([-0.5, -0.75, -1.0, -1.25, -2.0]) for _ in range(k)), reverse=True)
        vals.append(row)
        idx.append(toks)
    beam = BeamRequest(BeamParams(width=W, max_tokens=8, length_penalty=lp, ignore_eos=ignore_eos,
                                  eos_token_id=EOS, rank_by_score=rank_by_score), P, 0.0, 0)
    beam.live = [LiveBeam(j, s, s) for j, s in enumerate(scores)]
    beam.tokens, beam.parents, beam.depths = list(range(W)), [-1] * W, [1] * W
    beam.logprobs, beam.top, beam.has_draft = [0.0] * W, [None] * W, [False] * W
    beam.steps = 1
    beam._eos_score = EOS
    return beam, scores, TopRows(vals, idx)


@pytest.mark.parametrize("ignore_eos, rank_by_score, lp", [(False, False, 1.0), (False, True, 1.3),
                                                           (True, True, 0.7), (True, False, 1.0)])
def test_array_search_is_vllms_rule(ignore_eos, rank_by_score, lp):
    rng = random.Random(hash((ignore_eos, rank_by_score, lp)) & 0xFFFF)
    planted_differs = 0
    for _ in range(30):
        W = rng.choice([1, 2, 3, 8, 16])
        beam, scores, top = _case(rng, W, ignore_eos, rank_by_score, lp)
        eos = None if ignore_eos else EOS
        n = P + beam.steps + 1
        got = beam.search(top, eos)
        want, done = _reference(scores, top, W, eos, EOS, rank_by_score, lp, n)
        assert [c[:4] for c in got] == want
        assert all(c[4] == c[2] for c in got)  # T = 0: the sampling score is the cumulative one
        assert [(f.tokens[-1], f.cum_logprob) for f in beam.finished] == [(EOS, s) for _, s in done]
        assert all(f.finish_reason == "stop" and f.top[-1] is not None for f in beam.finished)
        planted, _ = _reference(scores, top, W, eos, EOS, rank_by_score, lp, n, stable=False)
        planted_differs += planted != want
    assert planted_differs > 0  # ties decide some cases: the order is really checked
