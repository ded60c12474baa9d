"""Mode "sample" (what a plain request gets on a DSBD engine, docs/design.md §1): one sequence; each verified layer checks
the up to W drafts of a multi-draft forest and emits ONE token (K = 1), so the output is exactly target sampling at
temperature > 0 and plain greedy decoding at temperature 0, whatever W and the draft.

The oracle is the table itself (products of its conditional probabilities, by enumeration; no core code). Power: the
same statistic, sample size and threshold reject the paper's single-output-beam mode at fixed width (layers keep up to
W beams, so the emitted sequence is not a target sample) and a target temperature off by 15%.
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from chisq import goodness_of_fit, report
from vllm_dsbd.core import reference
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table

V, EOS, N_TOK, PROMPT, N = 5, 4, 3, [2], 8000


def _pair(seed=5, mix=0.5, jitter=0.0):
    g = torch.Generator().manual_seed(seed)
    t = random_table(V, 2, concentration=0.5, generator=g)
    return NGramLM(t, jitter=jitter), NGramLM(draft_of(t, mix, generator=g), jitter=jitter)


def sequence_law(table: torch.Tensor, temperature: float = 1.0) -> dict:
    """Exact law of the generated tokens (up to N_TOK, ending early at EOS) of ancestral sampling from a bigram
    table at ``temperature``, by enumeration."""
    def cond(prev):
        p = table[prev].double() ** (1.0 / temperature)
        return p / p.sum()

    law: dict = {}
    for n in range(1, N_TOK + 1):
        for seq in itertools.product(range(V), repeat=n):
            if any(x == EOS for x in seq[:-1]) or (n < N_TOK and seq[-1] != EOS):
                continue
            mass, prev = 1.0, PROMPT[-1]
            for x in seq:
                mass *= float(cond(prev)[x])
                prev = x
            law[seq] = law.get(seq, 0.0) + mass
    return law


def _decode(target, draft, width, mode="sample", dynamic=False, seed=1):
    return reference.dsbd_decode(target, draft, [PROMPT] * N, width=width, depth=2, max_new_tokens=N_TOK,
                                 eos_token_id=EOS, mode=mode, dynamic_width=dynamic, seed=seed)


@pytest.mark.parametrize("width", [2, 4])
def test_sample_mode_is_target_sampling(width):
    target, draft = _pair()
    outs = _decode(target, draft, width)
    counts = Counter(tuple(o.beams[0][0]) for o in outs)
    law = sequence_law(target.table)
    stat, df, thr = goodness_of_fit(counts, law, N)
    report(f"sample mode W={width} vs target sampling", stat, df, thr)
    assert stat < thr
    # not vacuous: drafts were checked at every width and layers passed
    assert sum(o.stats.layers_passed for o in outs) > N // 2
    assert all(w == 1 for o in outs for w in o.stats.widths)
    # power, same sample size and threshold: a 15% hotter target, and the paper's single-output-beam mode
    stat_t, _, _ = goodness_of_fit(counts, sequence_law(target.table, 1.15), N)
    single = Counter(tuple(o.beams[0][0]) for o in _decode(target, draft, width, mode="single"))
    stat_s, df_s, thr_s = goodness_of_fit(single, law, N)
    report(f"  planted: temperature 1.15 chi2={stat_t:.1f}; single-output-beam mode W={width}", stat_s, df_s, thr_s)
    assert stat_t > thr and stat_s > thr_s


def test_multi_draft_accepts_more_than_one_draft():
    """W drafts per depth are checked against one output: acceptance grows with W (counts, same seeds)."""
    target, draft = _pair()
    per_iter = {}
    for w in (1, 4):
        outs = _decode(target, draft, w)
        tokens = sum(len(o.beams[0][0]) for o in outs)
        per_iter[w] = tokens / sum(o.stats.iterations for o in outs)
    print(f"sample mode tokens per iteration: W=1 {per_iter[1]:.3f}, W=4 {per_iter[4]:.3f}")
    assert per_iter[4] > per_iter[1] + 0.1


@pytest.mark.parametrize("width", [1, 2, 4])
def test_sample_mode_temperature_zero_is_greedy(width):
    target, draft = _pair(seed=9, mix=0.3, jitter=1e-3)
    prompts = [[p] for p in range(V)]
    outs = reference.dsbd_decode(target, draft, prompts, width=width, depth=3, max_new_tokens=12,
                                 temperature=0.0, eos_token_id=EOS, mode="sample", seed=0)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        while len(seq) - 1 < 12:  # greedy by hand from the model's logits
            x = int(target(torch.tensor([seq])).argmax(-1))
            seq.append(x)
            if x == EOS:
                break
        assert out.beams[0][0] == seq[1:], (width, prompt)
