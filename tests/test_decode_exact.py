"""Full decoding: DSBD's output law equals target beam sampling (full width, fixed width), plain sampling (single
beam, W = 1); with dynamic width, a layer's outputs are exact given the width the policy chose."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from chisq import goodness_of_fit, ordered_without_replacement_law, report, two_sample
from vllm_dsbd.core import BatchParams, Forest, beam_step, reference, verify_forest
from vllm_dsbd.core import rng
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table

N = 4000


def pair(vocab, order=2, mix=0.6, seed=0, zeros=0.0, concentration=0.5):
    g = torch.Generator().manual_seed(seed)
    t = random_table(vocab, order, concentration=concentration, zeros=zeros, generator=g)
    return NGramLM(t), NGramLM(draft_of(t, mix, generator=g))


def beam_sets(outs):
    sets = Counter(tuple(sorted(tuple(b[0]) for b in o.beams)) for o in outs)
    best = Counter(tuple(o.beams[0][0]) for o in outs)
    return sets, best


CONFIGS = {
    "W2-G2-eos": dict(vocab=5, width=2, depth=2, max_new_tokens=3, eos=4, kw={}),
    "W3-G3": dict(vocab=4, width=3, depth=3, max_new_tokens=3, eos=None, kw={}),
    "W2-G2-topk-topp": dict(vocab=6, width=2, depth=2, max_new_tokens=3, eos=5, kw=dict(top_k=5, top_p=0.85)),
    "W2-G3-T0.7-trigram": dict(vocab=4, width=2, depth=3, max_new_tokens=4, eos=3, kw=dict(temperature=0.7),
                               order=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_mode_equals_beam_sampling(name):
    c = CONFIGS[name]
    target, draft = pair(c["vocab"], c.get("order", 2), seed=len(name))
    prompts = [[0, 1]] * N
    common = dict(width=c["width"], max_new_tokens=c["max_new_tokens"], eos_token_id=c["eos"], **c["kw"])
    ds = reference.dsbd_decode(target, draft, prompts, depth=c["depth"], mode="full", seed=1, **common)
    bs = reference.beam_decode(target, prompts, seed=2, **common)
    passed = sum(o.stats.layers_passed for o in ds)
    assert passed > N // 2, "drafts were hardly accepted: the comparison would not exercise verification"
    (ds_sets, ds_best), (bs_sets, bs_best) = beam_sets(ds), beam_sets(bs)
    s1 = two_sample(ds_sets, bs_sets)
    s2 = two_sample(ds_best, bs_best)
    report(f"full[{name}] beam sets", *s1)
    report(f"full[{name}] best beam", *s2)
    assert s1[0] < s1[2] and s2[0] < s2[2]
    # fewer target passes than beam sampling: the drafts did their job
    assert sum(o.stats.target_calls for o in ds) < sum(o.stats.target_calls for o in bs)


def sampling_law(target: NGramLM, prompt, n, eos):
    """Exact law of plain sampling from the target for up to n tokens, stopping at EOS."""
    out = {}
    def rec(seq, mass):
        if len(seq) == n or (seq and seq[-1] == eos):
            out[tuple(seq)] = mass
            return
        p = target.probs(prompt + seq)
        for x in range(target.vocab):
            if p[x] > 0:
                rec(seq + [x], mass * float(p[x]))
    rec([], 1.0)
    return out


@pytest.mark.parametrize("depth", [1, 3])
def test_single_mode_width_one_equals_sampling(depth):
    target, draft = pair(5, seed=11, mix=0.5)
    n_tok, eos = 4, 4
    outs = reference.dsbd_decode(target, draft, [[2]] * N * 2, width=1, depth=depth, max_new_tokens=n_tok,
                                 eos_token_id=eos, mode="single", seed=3)
    assert sum(o.stats.layers_passed for o in outs) > N // 2
    counts = Counter(tuple(o.beams[0][0]) for o in outs)
    stat, df, thr = goodness_of_fit(counts, sampling_law(target, [2], n_tok, eos), N * 2)
    report(f"single W=1 depth={depth} vs sampling", stat, df, thr)
    assert stat < thr


@pytest.mark.parametrize("tau", [0.3, 0.6, 0.9])
def test_dynamic_width_layer_exact_given_width(tau):
    """N copies of one request: same roots, so the same P_1 and Q_1 in every row; the policy must pick the same
    width everywhere (it never sees the coins), and the layer's outputs must be that many draws from P_1."""
    V, W, n = 6, 3, 40_000
    g = torch.Generator().manual_seed(21)
    tl = torch.log(random_table(V, 1, generator=g)).float()  # target next-token law at the root
    dl = torch.log(draft_of(random_table(V, 1, generator=g), 0.0, generator=g) * 0.3
                   + 0.7 * tl.exp().double()).float()
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
    assert widths.unique().numel() == 1, "the width must not depend on the coin flips"
    k = int(widths[0])
    print(f"tau={tau}: width {k}")
    outs = res.layers.parent[:, 0, :k] * V + res.layers.token[:, 0, :k]
    counts = Counter(map(tuple, outs.tolist()))
    p = torch.zeros(W * V, dtype=torch.float64)
    p[:V] = tl.double().exp()
    stat, df, thr = goodness_of_fit(counts, ordered_without_replacement_law((p / p.sum()).tolist(), k), n)
    report(f"dynamic width tau={tau} K={k}", stat, df, thr)
    assert stat < thr


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


@pytest.mark.parametrize("rule", ["exact", "authors"])
def test_adversarial_full_decode_and_power(monkeypatch, rule):
    """Adversarial draft: DSBD's law of beam sets equals beam sampling's with the exact rule, and the same test fails
    with the authors' layer rule swapped in (so the full-decoding test can tell right from wrong)."""
    import vllm_dsbd.core.verify as verify_mod
    g = torch.Generator().manual_seed(77)
    t = random_table(5, 2, concentration=0.5, generator=g)
    bad = torch.flip(t, dims=[-1])  # draft mass where the target has little
    target, draft = NGramLM(t), NGramLM(0.2 * t + 0.8 * bad)
    prompts = [[0, 1]] * N
    common = dict(width=2, max_new_tokens=3)
    bs = reference.beam_decode(target, prompts, seed=2, **common)
    if rule == "authors":
        monkeypatch.setattr(verify_mod, "verify_layer", authors_verify_layer)
    ds = reference.dsbd_decode(target, draft, prompts, depth=2, mode="full", seed=1, **common)
    assert sum(o.stats.layers_passed for o in ds) > 0
    (ds_sets, _), (bs_sets, _) = beam_sets(ds), beam_sets(bs)
    s = two_sample(ds_sets, bs_sets)
    report(f"full decode, adversarial draft, {rule} rule", *s)
    assert (s[0] < s[2]) if rule == "exact" else (s[0] > s[2])
