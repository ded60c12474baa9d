"""Core building blocks against brute force: the joint with top-k / top-p, the forest layout, the width model;
seeded runs repeat; bad arguments raise ValueError naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_dsbd.core import BatchParams, Forest, beam_step, forest_layout, joint_logprobs, reference
from vllm_dsbd.core import rng
from vllm_dsbd.core.params import HostFacts
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table
from vllm_dsbd.core.width import acceptance_count_law


def brute_joint(logits, scores, live, t, k, p):
    """Per request, plain numpy: the joint over live beams, temperature, top-k then top-p, normalised."""
    S, V = logits.shape
    lp = logits / t - np.log(np.exp(logits / t).sum(-1, keepdims=True))
    j = np.full(S * V, -np.inf)
    for b in range(S):
        if live[b]:
            j[b * V:(b + 1) * V] = scores[b] + lp[b]
    if k:
        kth = np.sort(j)[::-1][k - 1]
        j[j < kth] = -np.inf
    if p < 1:
        order = np.argsort(-j, kind="stable")
        pr = np.exp(j[order] - np.logaddexp.reduce(j[order]))
        keep, acc = [], 0.0
        for idx, q in zip(order, pr):
            if acc < p or not keep:
                keep.append(idx)
            acc += q
        thr = min(j[i] for i in keep)
        j[j < thr] = -np.inf
    return j - np.logaddexp.reduce(j)


@pytest.mark.parametrize("k,p,t", [(0, 1.0, 1.0), (3, 1.0, 1.0), (0, 0.7, 1.0), (5, 0.8, 0.6), (1, 1.0, 2.0)])
def test_joint_matches_brute_force(k, p, t):
    g = torch.Generator().manual_seed(k * 10 + int(p * 10))
    R, S, V = 6, 3, 7
    logits = torch.randn(R, S, V, generator=g) * 2
    scores = torch.randn(R, S, generator=g)
    live = torch.rand(R, S, generator=g) > 0.3
    live[:, 0] = True
    params = BatchParams.make(R, temperature=t, top_k=k, top_p=p)
    logp, _ = joint_logprobs(logits, scores, live, params)
    for r in range(R):
        ref = brute_joint(logits[r].double().numpy(), scores[r].double().numpy(), live[r].numpy(), t, k, p)
        got = logp[r].double().numpy()
        assert np.array_equal(np.isinf(ref), np.isinf(got)), f"support differs in row {r}"
        np.testing.assert_allclose(got[np.isfinite(got)], ref[np.isfinite(ref)], atol=1e-5)


def test_gumbel_top_k_first_draw_law():
    """beam_step's first draw follows P (a sanity check of the Gumbel keys; the layer tests check the rest)."""
    n, V = 50_000, 4
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    params = BatchParams.make(n, temperature=1.0, width=2, seed=torch.arange(n))
    st = beam_step(torch.log(p).expand(n, 1, V).clone(), torch.zeros(n, 1), torch.ones(n, 1, dtype=torch.bool),
                   params, torch.zeros(n, dtype=torch.long), rng.Stream.TARGET_DRAW)
    freq = torch.bincount(st.token[:, 0], minlength=V).double() / n
    assert torch.allclose(freq, p.double(), atol=0.01)
    assert bool((st.token[:, 0] != st.token[:, 1]).all())


def test_forest_layout_against_brute_force():
    g = torch.Generator().manual_seed(3)
    R, G, W, V = 3, 3, 3, 5
    params = BatchParams.make(R, temperature=1.0, width=W, seed=[1, 2, 3], depth=[3, 2, 1])
    live = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    scores = torch.where(live, 0.0, float("-inf"))
    steps, par_scores, par_live = [], scores, live
    for d in range(G):
        st = beam_step(torch.randn(R, W, V, generator=g), par_scores, par_live, params,
                       torch.full((R,), d), rng.Stream.DRAFT_DRAW)
        steps.append(st)
        par_scores, par_live = st.score, st.valid
    forest = Forest.from_steps(steps, params.depth, W)
    ctx = torch.tensor([10, 4, 7])
    lay = forest_layout(forest, ctx)
    for r in range(R):
        nodes = [(d, j) for d in range(int(params.depth[r])) for j in range(W) if forest.valid[r, d, j]]
        assert int(lay.num_nodes[r]) == len(nodes)
        for n, (d, j) in enumerate(nodes):
            assert int(lay.depth[r, n]) == d + 1 and int(lay.slot[r, n]) == j
            assert int(lay.position[r, n]) == int(ctx[r]) + d
            assert int(lay.token[r, n]) == int(forest.token[r, d, j])
            # walk up by hand
            chain, dd, jj = [], d, j
            while dd >= 0:
                chain.append(nodes.index((dd, jj)))
                root = int(forest.parent[r, dd, jj])
                jj, dd = root, dd - 1
            assert lay.path(r, n) == chain[::-1]
            assert int(lay.root[r, n]) == root
            expect = torch.zeros(lay.ancestors.shape[2], dtype=torch.bool)
            expect[chain] = True
            assert torch.equal(lay.ancestors[r, n], expect)


def test_acceptance_count_model_by_enumeration():
    """The width model's law of the number of acceptances against a direct simulation of the model process."""
    g = torch.Generator().manual_seed(5)
    p = random_table(6, 1, generator=g).float()[None]
    q = (0.7 * random_table(6, 1, generator=g)).float()[None]  # sub-distribution: 30% of the draft mass invalid
    law = acceptance_count_law(p, q, 3)[3, 0]
    n = 200_000
    # simulate: draft i ~ q (w.p. mass(q), else an invalid draft that is always rejected)
    counts = torch.zeros(4)
    r = p.double().expand(n, -1).clone()
    acc_n = torch.zeros(n, dtype=torch.long)
    qq = torch.cat([q.double()[0], torch.tensor([1 - q.sum().item()], dtype=torch.float64)])
    for _ in range(3):
        z = torch.multinomial(qq.expand(n, -1), 1, replacement=True, generator=g)[:, 0]
        valid = z < 6
        zc = z.clamp(max=5)
        ratio = torch.where(valid, r.gather(1, zc[:, None])[:, 0] / q.double()[0][zc], 0.0)
        acc = torch.rand(n, generator=g, dtype=torch.float64) < ratio
        res = (r - q.double()).clamp(min=0)
        res = res / res.sum(1, keepdim=True)
        r = torch.where(acc[:, None], p.double().expand(n, -1), res)
        acc_n += acc
    counts = torch.bincount(acc_n, minlength=4).double() / n
    assert torch.allclose(counts, law, atol=0.01), (counts, law)


def small_pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = random_table(6, 2, generator=g)
    return NGramLM(t), NGramLM(draft_of(t, 0.6, generator=g))


@pytest.mark.parametrize("mode", ["full", "single"])
def test_seeded_runs_repeat(mode):
    target, draft = small_pair()
    kw = dict(width=3, depth=3, max_new_tokens=12, eos_token_id=5, mode=mode, dynamic_width=True,
              width_threshold=0.6)
    a = reference.dsbd_decode(target, draft, [[1], [2], [3]], seed=7, **kw)
    b = reference.dsbd_decode(target, draft, [[1], [2], [3]], seed=7, **kw)
    c = reference.dsbd_decode(target, draft, [[1], [2], [3]], seed=8, **kw)
    assert [o.beams for o in a] == [o.beams for o in b]
    assert [o.stats for o in a] == [o.stats for o in b]
    assert [o.beams for o in a] != [o.beams for o in c]


BAD = [
    (dict(width=0), "width"), (dict(width=2.0), "width"), (dict(depth=0), "depth"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(eos_token_id=-2), "eos_token_id"), (dict(mode="beam"), "mode"),
    (dict(width_threshold=0.0), "width_threshold"), (dict(min_width=3, width=2), "min_width"),
    (dict(seed="x"), "seed"),
]


@pytest.mark.parametrize("bad,name", BAD, ids=[n + "-" + str(i) for i, (_, n) in enumerate(BAD)])
def test_bad_arguments_name_the_argument(bad, name):
    target, draft = small_pair()
    kw = dict(width=2, depth=2, max_new_tokens=4) | bad
    with pytest.raises(ValueError, match=name):
        reference.dsbd_decode(target, draft, [1, 2], **kw)


@pytest.mark.parametrize("prompt", [[], [[]], "abc", [1, -1]])
def test_bad_prompts(prompt):
    target, draft = small_pair()
    with pytest.raises(ValueError, match="prompt_ids"):
        reference.beam_decode(target, prompt, width=2, max_new_tokens=3)


def test_mixed_batch_equals_requests_alone():
    """Ragged batch: every request its own width, depth, mode, temperature, top-k/p, dynamic width, EOS and length;
    decoding them together gives each exactly what it gives alone (randomness is keyed per request)."""
    g = torch.Generator().manual_seed(9)
    t = random_table(9, 2, concentration=0.4, generator=g)
    target, draft = NGramLM(t, jitter=0.05), NGramLM(draft_of(t, 0.7, generator=g))
    S = reference.Settings
    settings = [
        S(width=1, depth=3, max_new_tokens=10, temperature=1.0, eos=8, single=True),
        S(width=4, depth=2, max_new_tokens=7, temperature=0.0, eos=8),
        S(width=3, depth=3, max_new_tokens=9, temperature=0.8, top_k=12, top_p=0.9, eos=8, dynamic=True, tau=0.5),
        S(width=2, depth=1, max_new_tokens=5, temperature=1.3, single=True, dynamic=True, tau=0.7),
        S(width=4, depth=3, max_new_tokens=11, temperature=1.0),
        S(width=2, depth=2, max_new_tokens=8, temperature=0.0, single=True, eos=8),
    ]
    prompts = [[1], [2, 3, 4], [5, 6], [7], [0, 0, 0, 0, 1], [3]]
    seeds = [11, 12, 13, 14, 15, 16]
    together = reference.dsbd_decode_mixed(target, draft, prompts, settings, seeds)
    for i in range(len(prompts)):
        alone = reference.dsbd_decode_mixed(target, draft, [prompts[i]], [settings[i]], [seeds[i]])[0]
        assert [b[0] for b in together[i].beams] == [b[0] for b in alone.beams], f"request {i}"
        assert [round(b[1], 4) for b in together[i].beams] == [round(b[1], 4) for b in alone.beams]
        assert together[i].stats.widths == alone.stats.widths
        assert together[i].stats.layers_passed == alone.stats.layers_passed
    assert sum(o.stats.layers_passed for o in together) > 0


@pytest.mark.parametrize("seed", range(6))
def test_host_facts_are_the_settings_values(seed):
    """``BatchParams.facts`` (the core's branches read them instead of device tensors) equal the values the tensors
    give, for random mixes of deterministic and sampling rows; ``with_`` keeps them unless it changes a setting they
    read, ``to`` keeps them, ``select`` recomputes them for the subset."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 9, (1,), generator=g))
    temp = torch.where(torch.rand(R, generator=g) < 0.4, 0.0, torch.rand(R, generator=g) + 0.1)
    top_k = torch.where(torch.rand(R, generator=g) < 0.5, 0, torch.randint(1, 50, (R,), generator=g))
    top_p = torch.where(torch.rand(R, generator=g) < 0.5, 1.0, torch.rand(R, generator=g))
    width = torch.randint(1, 5, (R,), generator=g)
    eos = torch.where(torch.rand(R, generator=g) < 0.5, -1, 7)
    single = torch.rand(R, generator=g) < 0.5
    p = BatchParams.make(R, temperature=temp, top_k=top_k, top_p=top_p, width=width, eos=eos, single=single)

    def expected(q):
        det = q.temperature == 0
        return (int(q.width.max()), bool(det.any()), bool(det.all()),
                int(torch.where(~det, q.top_k, 0).max()), bool((~det & (q.top_p < 1)).any()),
                bool((det & (q.eos >= 0) & ~q.single).any()))

    f = p.facts
    assert (f.width_max, f.any_deterministic, f.all_deterministic, f.top_k_max, f.any_top_p,
            f.any_eos_rule) == expected(p)
    assert p.with_(depth=torch.ones(R, dtype=torch.int64)).facts is f  # carried: depth is not read
    assert p.to("cpu").facts is f
    wider = p.with_(width=width + 3)
    assert wider.facts.width_max == int(width.max()) + 3  # recomputed: width is read
    sub = p.select(torch.arange(R) % 2 == 0)
    sf = sub.facts
    assert (sf.width_max, sf.any_deterministic, sf.all_deterministic, sf.top_k_max, sf.any_top_p,
            sf.any_eos_rule) == expected(sub)
    # from the host values (``engine.state.batch_params``): the same facts, float32 edges included (a top-p just
    # under 1 that float32 rounds to 1)
    top_p = torch.where(torch.rand(R, generator=g) < 0.3, 1.0 - 1e-9, top_p.double()).tolist()
    q = BatchParams.make(R, temperature=temp, top_k=top_k, top_p=top_p, width=width, eos=eos, single=single)
    assert HostFacts.of_values(temp.tolist(), top_k.tolist(), top_p, width.tolist(), eos.tolist(),
                               single.tolist()) == HostFacts.of(q)
    assert HostFacts.of_values([], [], [], [], [], []) == HostFacts.of(BatchParams.make(0))
    p8 = p.to("meta")  # another device: one copy per dtype, row views, the same values and facts
    assert p8.facts is f and all(getattr(p8, n).dtype == getattr(p, n).dtype and getattr(p8, n).shape == (R,)
                                 for n in ("temperature", "seed", "single", "tau"))
