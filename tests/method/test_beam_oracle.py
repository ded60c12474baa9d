"""The enumeration oracle of beam sampling (``beam_oracle.py``) against hand computations and against the core's own
beam-sampling baseline (``reference.beam_decode``), with a power check (the baseline at a temperature 15% off)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from beam_oracle import beam_sampling_law, sampling_law, truncate
from chisq import goodness_of_fit, report_power
from vllm_dsbd.core import reference
from vllm_dsbd.core.synthetic import NGramLM, random_table


def table_lm(vocab, order, seed, concentration=0.5):
    g = torch.Generator().manual_seed(seed)
    return NGramLM(random_table(vocab, order, concentration=concentration, generator=g))


def probs_of(model):
    return lambda context: model.probs(context).tolist()


def test_one_step_by_hand():
    p = [0.5, 0.3, 0.2]
    law = beam_sampling_law(lambda ctx: p, [0], width=2, max_new_tokens=1)
    # {a, b} = a then b, or b then a
    pair = lambda a, b: p[a] * p[b] / (1 - p[a]) + p[b] * p[a] / (1 - p[b])  # noqa: E731
    want = {((0,), (1,)): pair(0, 1), ((0,), (2,)): pair(0, 2), ((1,), (2,)): pair(1, 2)}
    assert law.keys() == want.keys()
    assert all(math.isclose(law[k], want[k], rel_tol=1e-12) for k in want)
    # width >= support: every token, surely
    assert beam_sampling_law(lambda ctx: p, [0], width=5, max_new_tokens=1) == pytest.approx({((0,), (1,), (2,)): 1.0})


def test_truncation_on_the_joint():
    w = {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}
    assert truncate(w, 2, None) == pytest.approx({"a": 4 / 7, "b": 3 / 7})
    assert truncate(w, None, 0.65) == pytest.approx({"a": 4 / 7, "b": 3 / 7})  # b crosses 0.65: kept
    # top-p acts on the renormalised top-3 (c has 0.7 of the mass before it in w, 0.78 in the top-3): dropped
    assert truncate(w, 3, 0.75) == pytest.approx({"a": 4 / 7, "b": 3 / 7})
    with pytest.raises(ValueError):
        truncate({"a": 0.5, "b": 0.25, "c": 0.25}, 2, None)  # a tie at the top-k boundary


def test_width_one_is_plain_sampling_and_laws_sum_to_one():
    lm = table_lm(4, 3, seed=5)
    for temperature in (1.0, 0.7):
        beam = beam_sampling_law(probs_of(lm), [0, 1], width=1, max_new_tokens=4, eos=3, temperature=temperature)
        plain = sampling_law(probs_of(lm), [0, 1], 4, 3, temperature=temperature)
        assert beam.keys() == {(s,) for s in plain}
        assert all(math.isclose(beam[(s,)], q, rel_tol=1e-9) for s, q in plain.items())
        assert math.isclose(sum(beam.values()), 1.0, rel_tol=1e-9)
    law = beam_sampling_law(probs_of(lm), [0, 1], width=3, max_new_tokens=3, eos=3, top_k=7, top_p=0.9)
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-9)


@pytest.mark.parametrize("name,kw", [("W2-eos", dict(width=2, eos=4)),
                                     ("W3-topk-topp-T0.8", dict(width=3, eos=4, top_k=8, top_p=0.9,
                                                                temperature=0.8))])
def test_core_beam_sampling_matches_the_oracle(name, kw):
    """The core's beam-sampling baseline against the oracle; power check: the baseline at temperature x 1.15."""
    n, steps = 3000, 3
    lm = table_lm(5, 2, seed=3, concentration=0.2)
    t = kw.pop("temperature", 1.0)
    law = beam_sampling_law(probs_of(lm), [1], max_new_tokens=steps, temperature=t, **kw)
    eos = kw.pop("eos")

    def counts(temperature):
        outs = reference.beam_decode(lm, [[1]] * n, max_new_tokens=steps, temperature=temperature,
                                     eos_token_id=eos, seed=4, num_beams_out=kw["width"] * (steps + 1), **kw)
        return Counter(tuple(sorted(tuple(b) for b, _ in o.beams)) for o in outs)

    stat = goodness_of_fit(counts(t), law, n)
    planted = goodness_of_fit(counts(1.15 * t), law, n)
    report_power(f"beam_decode[{name}] vs oracle", stat, planted, "temperature x1.15", n=n)
    assert stat[0] < stat[2]
    assert planted[0] > planted[2], "the test cannot tell a temperature 15% off"
