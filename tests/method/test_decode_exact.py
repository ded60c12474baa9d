"""Full decoding: DSBD's output law equals target beam sampling (full width, fixed width) and plain sampling (single
beam, W = 1); with dynamic width, a layer's outputs are exact given the width the policy chose.

The law a decoder is compared with comes from ``beam_oracle`` (exact enumeration, no code shared with the core), never
from the core's own beam sampling. Every test also runs a planted wrong variant of the verification layer
(``planted.py``: the with-replacement acceptance rule, or a dropped residual where the layer has a single draft) through
the same decoder, sample size and statistic, and asserts that the statistic rejects it; full decoding also a subtle one
(an acceptance ratio 10% too strict) at up to 16,000 runs, where it is seen. Each line printed gives the test's
minimum detectable effect (TV 0.05-0.1; ``chisq.mde_tv``).

The drafts are over-confident (a noisy copy of the target sampled cold; the adversarial case: a nearly deterministic
draft): they agree with the target on what is likely, so layers pass often, and their first draw takes much of their
mass, which is where drawing without replacement matters (Q_j and Q differ most) and where the with-replacement rule
goes wrong most visibly. (With the former mixed drafts, the same statistics could not see it at this sample size.)
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import vllm_dsbd.core.verify as verify_mod
from beam_oracle import beam_sampling_law, sampling_law
from chisq import goodness_of_fit, ordered_without_replacement_law, report_power
from planted import planted_verify_layer
from vllm_dsbd.core import BatchParams, Forest, beam_step, reference, verify_forest
from vllm_dsbd.core import rng
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table

N = 4000
PROMPT = [0, 1]


def cold(table: torch.Tensor, gamma: float) -> torch.Tensor:
    """The table sampled at temperature 1 / gamma (an over-confident draft)."""
    x = table ** gamma
    return x / x.sum(-1, keepdim=True)


def pair(vocab, order=2, seed=0, mix=0.8, gamma=4.0, concentration=0.5):
    """A random target table and a cold draft of a noisy copy of it (``draft_of(target, mix)`` at T = 1 / gamma)."""
    g = torch.Generator().manual_seed(seed)
    t = random_table(vocab, order, concentration=concentration, generator=g)
    return NGramLM(t), NGramLM(cold(draft_of(t, mix, generator=g), gamma))


def next_probs(model: NGramLM):
    """The model as the oracle sees it: context -> the table's next-token probabilities."""
    return lambda context: model.probs(context).tolist()


def outcome(out) -> tuple:
    """Every candidate of a run at the end (finished and live beams), as the oracle's outcome: a sorted tuple."""
    return tuple(sorted(tuple(tokens) for tokens, _ in out.beams))


def full_decode(target, draft, c, n, seed=1):
    outs = reference.dsbd_decode(target, draft, [PROMPT] * n, width=c["width"], depth=c["depth"],
                                 max_new_tokens=c["max_new_tokens"], eos_token_id=c["eos"], mode="full", seed=seed,
                                 num_beams_out=c["width"] * (c["max_new_tokens"] + 1), **c["kw"])
    # a run has at most W candidates per step: all of them came back, not just the best
    assert all(len(o.beams) <= c["width"] * c["max_new_tokens"] for o in outs)
    return outs


def oracle_law(target, c):
    return beam_sampling_law(next_probs(target), PROMPT, width=c["width"], max_new_tokens=c["max_new_tokens"],
                             eos=c["eos"], **c["kw"])


CONFIGS = {
    "W2-G2-eos": dict(vocab=5, width=2, depth=2, max_new_tokens=3, eos=4, kw={}),
    "W3-G3": dict(vocab=4, width=3, depth=3, max_new_tokens=3, eos=None, kw={}),
    "W2-G2-topk-topp": dict(vocab=6, width=2, depth=2, max_new_tokens=3, eos=5, kw=dict(top_k=5, top_p=0.85)),
    "W2-G3-T0.7-trigram": dict(vocab=4, width=2, depth=3, max_new_tokens=4, eos=3, kw=dict(temperature=0.7),
                               order=3),
}


# the runs of the exact rule and of the subtle planted one (an acceptance ratio 10% too strict) per config, sized so
# that the subtle one is rejected with a margin (chi2 / threshold measured at 8,000 runs: eos 427 / 336, topk-topp
# 141 / 77, trigram 724 / 171); in W3-G3 it is not seen at 8,000 (372 / 377) nor affordably beyond: None. A residual 10%
# too heavy on even tokens is not seen in any of these (layers pass often here): ``test_verify_layer.py`` rejects it.
SUBTLE_N = {"W2-G2-eos": 16_000, "W3-G3": None, "W2-G2-topk-topp": 8000, "W2-G3-T0.7-trigram": N}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_mode_equals_beam_sampling(monkeypatch, name):
    c, n = CONFIGS[name], SUBTLE_N[name] or N
    target, draft = pair(c["vocab"], c.get("order", 2), seed=len(name))
    law = oracle_law(target, c)
    ds = full_decode(target, draft, c, n)
    passed = sum(o.stats.layers_passed for o in ds)
    assert passed > n // 2, "drafts were hardly accepted: the comparison would not exercise verification"
    # fewer target passes than beam sampling (one per step; a run's steps = its longest candidate): drafts did work
    assert sum(o.stats.target_calls for o in ds) < sum(max(map(len, outcome(o))) for o in ds)
    stat = goodness_of_fit(Counter(map(outcome, ds)), law, n)
    variants = [("with_replacement", N)] + ([("accept_bias", n)] if SUBTLE_N[name] else [])
    layers = {v: planted_verify_layer(v) for v, _ in variants}
    for variant, m in variants:
        monkeypatch.setattr(verify_mod, "verify_layer", layers[variant])
        planted = goodness_of_fit(Counter(map(outcome, full_decode(target, draft, c, m))), law, m)
        report_power(f"full[{name}] beam sets vs exact law", stat, planted, f"{variant} (N={m})", n=n)
        assert planted[0] > planted[2], f"the test cannot tell the {variant} rule from the exact one"
    assert stat[0] < stat[2]


@pytest.mark.parametrize("depth", [1, 3])
def test_single_mode_width_one_equals_sampling(monkeypatch, depth):
    """W = 1: speculative sampling, one draft per layer (so the with-replacement rule is the exact one here); the
    planted variant is a dropped residual."""
    target, draft = pair(5, seed=11, mix=0.5, gamma=3.0)
    n_tok, eos, n = 4, 4, 2 * N
    law = sampling_law(next_probs(target), [2], n_tok, eos)

    def run():
        outs = reference.dsbd_decode(target, draft, [[2]] * n, width=1, depth=depth, max_new_tokens=n_tok,
                                     eos_token_id=eos, mode="single", seed=3)
        return outs, goodness_of_fit(Counter(tuple(o.beams[0][0]) for o in outs), law, n)

    outs, stat = run()
    assert sum(o.stats.layers_passed for o in outs) > n // 2
    monkeypatch.setattr(verify_mod, "verify_layer", planted_verify_layer("dropped_residual"))
    _, planted = run()
    report_power(f"single W=1 depth={depth} vs sampling", stat, planted, "dropped_residual", n=n)
    assert stat[0] < stat[2]
    assert planted[0] > planted[2], "the test cannot tell a dropped residual from the exact layer"


def dynamic_layer(tau, tl, dl, n, W):
    """One verified layer with the width policy on: n copies of one request (same roots, so the same P_1 and Q_1 in
    every row). Returns (the widths the policy chose per row, the outputs as joint indices [n, K])."""
    V = tl.shape[0]
    params = BatchParams.make(n, temperature=1.0, width=W, seed=torch.arange(n), depth=1, dynamic=True, tau=tau)
    live = torch.zeros(n, W, dtype=torch.bool)
    live[:, 0] = True
    scores = torch.where(live, 0.0, float("-inf"))
    st = beam_step(dl.expand(n, W, V).clone(), scores, live, params, torch.zeros(n, dtype=torch.long),
                   rng.Stream.DRAFT_DRAW)
    forest = Forest.from_steps([st], params.depth, W)
    tgt = torch.stack([tl.expand(n, W, V), tl.expand(n, W, V)], 1).clone()  # layer 0 and the bonus layer
    res = verify_forest(forest, tgt, scores, live, params, torch.zeros(n, dtype=torch.long))
    widths = res.layers.width[:, 0]
    k = int(widths.max())
    return widths, res.layers.parent[:, 0, :k] * V + res.layers.token[:, 0, :k]


@pytest.mark.parametrize("tau,width", [(0.2, 3), (0.5, 2), (0.8, 1)])
def test_dynamic_width_layer_exact_given_width(monkeypatch, tau, width):
    """The policy must pick one width in every row (it never sees the coins), the width this case is for (one case
    per width 1..W), and the layer's outputs must be that many draws without replacement from P_1."""
    V, W, n = 6, 3, 40_000
    g = torch.Generator().manual_seed(21)
    tp = random_table(V, 1, generator=g)  # target next-token law at the root
    tl = torch.log(tp).float()
    dl = torch.log(cold(draft_of(tp, 0.5, generator=g), 3.0)).float()  # a cold, noisy draft
    widths, outs = dynamic_layer(tau, tl, dl, n, W)
    assert widths.unique().tolist() == [width], "the width must not depend on the coin flips"
    p = torch.zeros(W * V, dtype=torch.float64)
    p[:V] = tp  # the root is slot 0
    law = ordered_without_replacement_law(p.tolist(), width)
    stat = goodness_of_fit(Counter(map(tuple, outs.tolist())), law, n)
    monkeypatch.setattr(verify_mod, "verify_layer", planted_verify_layer("with_replacement"))
    bad_widths, bad = dynamic_layer(tau, tl, dl, n, W)
    assert bad_widths.unique().tolist() == [width]
    planted = goodness_of_fit(Counter(map(tuple, bad.tolist())), law, n)
    report_power(f"dynamic width tau={tau} K={width}", stat, planted, "with_replacement", n=n)
    assert stat[0] < stat[2]
    assert planted[0] > planted[2], "the test cannot tell the with-replacement rule from the exact one"


def authors_verify_layer(logp, draft_idx, draft_valid, logq, k, key_seed, position):
    """The authors' layer rule with the core's signature (algorithm.md §5): unconditioned q in the acceptance ratio
    and the residual, reset to P after an accept with emitted pairs NOT removed, then one residual draw and plain
    draws without replacement from P (duplicates of accepted drafts possible)."""
    gen = torch.Generator().manual_seed((int(key_seed[0]) * 31 + int(position[0]) * 7 + key_seed.numel()) % 2**62)
    p, q = torch.exp(logp).double(), torch.exp(logq).double()
    n, m = draft_idx.shape
    kmax = max(int(k.max()), 1)
    r = p.clone()
    out = torch.full((n, kmax + 1), 0, dtype=torch.long)
    n_out = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    for j in range(m):
        z = draft_idx[:, j]
        live = draft_valid[:, j] & (n_out < k)
        ratio = r.gather(1, z[:, None])[:, 0] / q.gather(1, z[:, None])[:, 0].clamp(min=1e-30)
        acc = live & (torch.rand(n, generator=gen, dtype=torch.float64) < ratio)
        out[rows, torch.where(acc, n_out, kmax)] = z
        n_out += acc
        res = (r - q).clamp(min=0)
        res = res / res.sum(1, keepdim=True).clamp(min=1e-30)
        r = torch.where((live & ~acc)[:, None], res, torch.where(acc[:, None], p, r))
    need = n_out < k
    r = torch.where(r.sum(1, keepdim=True) > 0, r, p)
    y = torch.multinomial(r, 1, generator=gen)[:, 0]
    out[rows, torch.where(need, n_out, kmax)] = y
    n_out += need
    rest = torch.multinomial(p, kmax, replacement=False, generator=gen) if p.shape[1] >= kmax else out[:, :kmax]
    cols = torch.arange(kmax)[None, :]
    out = torch.where((cols >= n_out[:, None]) & (cols < k[:, None]), rest, out[:, :kmax])
    return out, cols < k[:, None]


def forced(t: torch.Tensor) -> torch.Tensor:
    """An adversarial, nearly deterministic draft: 0.85 on the target's favourite token, 0.12 on its third choice, 0.03
    spread evenly. The first draw takes most of the draft's mass, so the second is all but forced (Q_2 is nearly a
    point mass on the third choice while Q there is 0.12): the with-replacement rule then accepts it almost always,
    where the exact rule accepts it at the target's rate."""
    rank = t.argsort(-1, descending=True)
    one = lambda r: torch.nn.functional.one_hot(rank[..., r], t.shape[-1]).double()  # noqa: E731
    return 0.85 * one(0) + 0.12 * one(2) + 0.03 / t.shape[-1]


def test_adversarial_full_decode_and_power(monkeypatch):
    """Adversarial draft: DSBD's law of beam sets equals the exact beam-sampling law with the exact rule; the same
    test rejects the with-replacement rule and the authors' layer rule swapped in."""
    c = dict(width=2, depth=2, max_new_tokens=3, eos=None, kw={})
    g = torch.Generator().manual_seed(77)
    t = random_table(5, 2, concentration=0.5, generator=g)
    target, draft = NGramLM(t), NGramLM(forced(t))
    law = oracle_law(target, c)
    ds = full_decode(target, draft, c, N)
    assert sum(o.stats.layers_passed for o in ds) > N // 2
    stat = goodness_of_fit(Counter(map(outcome, ds)), law, N)
    results = {}
    for variant, layer in [("with_replacement", planted_verify_layer("with_replacement")),
                           ("authors", authors_verify_layer)]:
        monkeypatch.setattr(verify_mod, "verify_layer", layer)
        results[variant] = goodness_of_fit(Counter(map(outcome, full_decode(target, draft, c, N))), law, N)
        report_power("full decode, adversarial draft", stat, results[variant], variant, n=N)
    assert stat[0] < stat[2]
    for variant, planted in results.items():
        assert planted[0] > planted[2], f"the test cannot tell the {variant} rule from the exact one"
