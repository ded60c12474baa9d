"""Mode "sample" (what a plain request gets on a DSBD engine, docs/design/algorithm.md §1): one sequence; each
verified layer checks the up to W drafts of a multi-draft forest and emits ONE token (K = 1), so the output is exactly
target sampling at temperature > 0 and plain greedy decoding at temperature 0, whatever W and the draft.

The oracle is the table itself (products of its conditional probabilities, by enumeration; no core code). Power: the
same statistic, sample size and threshold reject the paper's single-output-beam mode at fixed width (layers keep up to
W beams, so the emitted sequence is not a target sample) and a target temperature off by 15%.

The multi-draft rule itself (each later draft's law Q_j is Q with the earlier draws removed, renormalised) is checked
with a cold draft far from the target (a mostly random table sampled at temperature 1/4: its first draw takes most of
its mass, so Q_j and Q differ most, and most drafts are rejected, so the residual matters), with and without top-k /
top-p: the same statistic must reject the with-replacement rule (Q_j taken as Q) and a dropped residual (T left as it
was after a rejection), each planted into the core's layer (``planted.py``). Oracle there: ``beam_oracle`` at width 1
(plain sampling with top-k / top-p, by enumeration).
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import vllm_dsbd.core.verify as verify_mod
from beam_oracle import beam_sampling_law
from chisq import goodness_of_fit, report, report_power
from planted import planted_verify_layer
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


# the cold-draft cases: (vocabulary, width, top-k, top-p, 1 / the draft's temperature); EOS is the last token. With
# top-p 0.85 the target keeps 3-4 of its top 5 tokens (top-p decides); the draft is a little less cold there
COLD = {"cold-W4": (5, 4, None, None, 4.0), "cold-W3-topk-topp": (7, 3, 5, 0.85, 2.5)}
N_COLD = 3000


def _cold_pair(vocab: int, gamma: float, seed: int = 3):
    """A random target table and a draft far from it: 20% target, 80% another random table, sampled at T = 1 / gamma
    (its most likely token takes 40-95% of its mass)."""
    g = torch.Generator().manual_seed(seed)
    t = random_table(vocab, 2, concentration=0.5, generator=g)
    d = draft_of(t, 0.2, generator=g) ** gamma
    return NGramLM(t), NGramLM(d / d.sum(-1, keepdim=True))


@pytest.mark.parametrize("name", list(COLD))
def test_multi_draft_rule_with_cold_draft_rejects_planted_variants(monkeypatch, name):
    """Mode "sample" (K = 1) with W drafts per depth from a cold draft, with and without top-k / top-p: the output law
    is the target's; the with-replacement rule and a dropped residual, planted into the core's layer, are rejected by
    the same statistic and sample size."""
    vocab, width, top_k, top_p, gamma = COLD[name]
    eos = vocab - 1
    target, draft = _cold_pair(vocab, gamma)
    law = {seqs[0]: p for seqs, p in beam_sampling_law(lambda ctx: target.probs(ctx).tolist(), PROMPT, width=1,
                                                       max_new_tokens=N_TOK, top_k=top_k, top_p=top_p,
                                                       eos=eos).items()}

    drafts = Counter()  # drafts per verified draft layer, counted on the way into the layer (exact rule only)

    def counting(logp, draft_idx, draft_valid, *rest):
        drafts.update(draft_valid.sum(1)[draft_valid.any(1)].tolist())
        return real(logp, draft_idx, draft_valid, *rest)

    def run():
        outs = reference.dsbd_decode(target, draft, [PROMPT] * N_COLD, width=width, depth=2, max_new_tokens=N_TOK,
                                     eos_token_id=eos, mode="sample", top_k=top_k, top_p=top_p, seed=7)
        return outs, goodness_of_fit(Counter(tuple(o.beams[0][0]) for o in outs), law, N_COLD)

    real = verify_mod.verify_layer
    layers = {v: planted_verify_layer(v) for v in ("with_replacement", "dropped_residual")}  # from the real source
    monkeypatch.setattr(verify_mod, "verify_layer", counting)
    outs, stat = run()
    # not vacuous: most drafted layers checked several drafts (the multi-draft rule ran), and layers passed
    passed = sum(o.stats.layers_passed for o in outs)
    iters = sum(o.stats.iterations for o in outs)
    print(f"{name}: {iters} iterations, {passed} layers passed, drafts per drafted layer {dict(sorted(drafts.items()))}")
    assert passed > N_COLD // 4
    assert sum(c for m, c in drafts.items() if m >= 2) > sum(drafts.values()) // 2
    planted = {}
    for variant, layer in layers.items():
        monkeypatch.setattr(verify_mod, "verify_layer", layer)
        planted[variant] = run()[1]
        report_power(f"sample mode {name} vs target sampling", stat, planted[variant], variant)
    assert stat[0] < stat[2]
    for variant, bad in planted.items():
        assert bad[0] > bad[2], f"the test cannot tell the {variant} rule from the exact one"


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
