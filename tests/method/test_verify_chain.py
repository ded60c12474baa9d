"""The chain fast path of ``sampler.verify`` (width 1, mode "sample": ``core/chain.py``) gives exactly the general
path's results (``verify_forest`` + ``iteration_outputs``): every field of every RowResult, on random steps that mix
peaked and flat targets, drafts from a noisy draft and drafts equal to the target's argmax, per-request depth 0..G and
truncated forests, temperatures (0 included), top-k / top-p, EOS hit at every depth, and drafts whose Q has more mass
than P everywhere (``verify_layer``'s fallback to P, where a residual draw can land on the draft and pass). The test
also checks that the cases exercised what they are meant to (accepts, rejects, full passes, EOS ends, fallbacks, the
fast path itself). The static chain path (``core/chain_static.py``: every row and layer under masks, no host
synchronisation; what a GPU runs) is compared on the same steps and must answer them all itself."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch


from vllm_dsbd.testing.chain_steps import Req, build_step  # noqa: E402

from vllm_dsbd.config import DSBDConfig  # noqa: E402
from vllm_dsbd.core import rng  # noqa: E402
from vllm_dsbd.engine import reads, sampler  # noqa: E402


def _random_req(rnd: random.Random, G: int, V: int) -> Req:
    depth = rnd.choice([0] + [rnd.randint(1, G)] * 3 + [G] * 3)
    return Req(depth=depth, nodes=rnd.choice([None, None, None, rnd.randint(0, G)]),
               temperature=rnd.choice([0.0, 0.5, 1.0, 1.0, 1.0, 1.7]),
               top_k=rnd.choice([0, 0, 0, 1, 5, V // 2]), top_p=rnd.choice([1.0, 1.0, 1.0, 0.9, 0.5]),
               eos=rnd.choice([-1, -1, rnd.randrange(V), -2]), eos_depth=rnd.randint(1, G),
               peak=rnd.choice([0.3, 1.0, 3.0, 8.0]), noise=rnd.choice([0.0, 0.1, 0.5, 2.0]),
               drafts=rnd.choice(["draft"] * 4 + ["argmax", "double_q"]))


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the chain cores' calls and the calls they answered (None, or a declined row: the general path
    decided)."""
    calls = Counter()
    core, static = sampler.verify_chains, sampler.verify_chains_static

    def spy(*args):
        out = core(*args)
        calls["called"] += 1
        calls["answered"] += out is not None
        return out

    def spy_static(*args):
        out = static(*args)
        calls["static called"] += 1
        calls["static answered"] += not bool(out.declined.any())
        return out

    monkeypatch.setattr(sampler, "verify_chains", spy)
    monkeypatch.setattr(sampler, "verify_chains_static", spy_static)
    return calls


def _compare(logits, plans, cfg, seen: Counter):
    # the chain paths themselves: an all-greedy chunk would otherwise take the greedy walk (sampler._greedy_forests,
    # compared with the general path in test_verify_forest_static.py)
    kw = dict(greedy_fast_path=False)
    fast = reads.run(sampler.verify(logits, plans, cfg, chain_static=False, **kw))
    static = reads.run(sampler.verify(logits, plans, cfg, chain_static=True, **kw))
    general = reads.run(sampler.verify(logits, plans, cfg, chain_fast_path=False, **kw))
    assert len(fast) == len(static) == len(general)
    for i, (a, c, b) in enumerate(zip(fast, static, general)):
        assert (a.tokens, a.path, a.passed, a.widths, a.rows) == (b.tokens, b.path, b.passed, b.widths, b.rows), i
        assert (c.tokens, c.path, c.passed, c.widths, c.rows) == (b.tokens, b.path, b.passed, b.widths, b.rows), i
        depth = plans[i].forest.forest.depth.item() if plans[i].forest is not None else 0
        seen["rows"] += 1
        seen["depth 0"] += depth == 0
        seen["accepted layers"] += b.passed
        seen["rejected"] += depth > 0 and b.passed < depth and plans[i].state.eos not in b.tokens
        seen["full passes"] += depth > 0 and b.passed == depth
        eos = b.tokens[-1] == plans[i].state.eos
        seen["eos ends"] += eos
        seen["eos on a passed node"] += eos and b.passed == len(b.tokens)  # the EOS node was accepted
        seen["greedy rows"] += plans[i].state.temperature == 0
        seen["truncated"] += plans[i].forest is not None and plans[i].num_nodes < plans[i].drafted_depth


@pytest.mark.parametrize("G,V", [(1, 11), (3, 50), (4, 400)])
def test_chain_fast_path_equals_general_path(G, V, fast_calls):
    rnd = random.Random(1000 * G + V)
    seen = Counter()
    steps = 60
    for step in range(steps):
        R = rnd.choice([1, 2, 3, 8, 17])
        logits, plans, cfg = build_step([_random_req(rnd, G, V) for _ in range(R)], G, V, seed=step)
        _compare(logits, plans, cfg, seen)
    # the fast path ran on every step, and the cases covered what they are meant to
    assert fast_calls["called"] == fast_calls["answered"] == steps
    assert fast_calls["static called"] == fast_calls["static answered"] == steps
    for what in ("depth 0", "rejected", "full passes", "eos ends", "eos on a passed node", "greedy rows",
                 "truncated"):
        assert seen[what] >= 3 or (what == "truncated" and G == 1), (what, seen)  # G = 1: nothing to cut
    assert seen["accepted layers"] >= seen["rows"] // 4, seen
    print(dict(seen))


def test_chain_fast_path_uniform_steps(fast_calls):
    """Steps where every row is a sampling row (the fast path's common case: all rows in a layer's first verify),
    no top-k / top-p, an EOS id set but not hit, including one-request steps and a vocabulary above the reduction
    grain size (one row over 32768 entries is summed differently from several: the shapes must match)."""
    seen = Counter()
    for step, (R, G, V) in enumerate([(32, 3, 400), (1, 3, 400), (1, 2, 40000), (3, 2, 40000), (5, 3, 1000)]):
        reqs = [Req(depth=G, eos=V - 1 if i % 2 else -1, noise=[0.0, 0.3, 1.0][i % 3]) for i in range(R)]
        logits, plans, cfg = build_step(reqs, G, V, seed=step)
        _compare(logits, plans, cfg, seen)
    assert fast_calls["called"] == fast_calls["answered"] == 5
    assert fast_calls["static called"] == fast_calls["static answered"] == 5
    assert seen["full passes"] and seen["rejected"], seen


def test_chain_paths_all_greedy_steps(fast_calls):
    """Steps where every request is greedy (T = 0): the static path then draws nothing (``chain_static``: no row
    samples, the top-1 decides every layer); the same results as the other paths, drafts accepted and rejected, EOS
    hit, depth 0 rows among them."""
    rnd = random.Random(5)
    seen = Counter()
    for step in range(12):
        G, V = rnd.choice([(1, 11), (3, 50), (2, 400)])
        reqs = [dataclasses.replace(_random_req(rnd, G, V), temperature=0.0) for _ in range(rnd.choice([1, 3, 8]))]
        logits, plans, cfg = build_step(reqs, G, V, seed=step)
        _compare(logits, plans, cfg, seen)
    assert fast_calls["static called"] == fast_calls["static answered"] == 12
    assert seen["greedy rows"] == seen["rows"] and seen["rejected"] and seen["full passes"] and seen["depth 0"], seen


def test_double_q_fallback_passes_by_a_draw(fast_calls):
    """Q = 2 P: the residual max(P - Q, 0) has no mass, verify_layer draws from P instead, and that draw can be the
    draft itself (the layer then passes): both paths agree on such steps, which do occur here."""
    seen = Counter()
    landed = 0
    for step in range(20):
        reqs = [Req(depth=3, drafts="double_q", peak=8.0) for _ in range(8)]
        logits, plans, cfg = build_step(reqs, 3, 30, seed=step)
        _compare(logits, plans, cfg, seen)
        for plan, res in zip(plans, reads.run(sampler.verify(logits, plans, cfg, chain_static=False))):
            # the first layer's coin: accepted iff u * 2 P(z) < P(z), i.e. u < 1/2; a pass with u clearly above
            # means the draw from P landed on the draft
            st = plan.state
            key = rng.request_key(torch.tensor([st.seed]), torch.tensor([plan.context_len]), rng.Stream.ACCEPT)
            u = float(rng.uniform(key, torch.zeros(1, dtype=torch.int64)))
            landed += u > 0.51 and res.passed > 0
    assert fast_calls["answered"] == fast_calls["called"] == 40
    assert fast_calls["static answered"] == fast_calls["static called"] == 20
    assert landed > 0 and seen["rejected"] > 0, (landed, seen)


def test_nan_logits_decline_to_the_general_path(fast_calls):
    """A row whose logits are NaN has no finite target log-probability: the general path emits nothing there (and
    its single-beam assertion reports it); the fast path declines, so the caller sees the same."""
    logits, plans, cfg = build_step([Req(depth=2), Req(depth=2)], 2, 20, seed=1)
    logits[plans[1].first_row] = float("nan")
    with pytest.raises(AssertionError):
        reads.run(sampler.verify(logits, plans, cfg, chain_fast_path=False))
    with pytest.raises(AssertionError):
        reads.run(sampler.verify(logits, plans, cfg, chain_static=False))
    with pytest.raises(AssertionError):
        reads.run(sampler.verify(logits, plans, cfg, chain_static=True))
    assert fast_calls["called"] == 1 and fast_calls["answered"] == 0
    assert fast_calls["static called"] == 1 and fast_calls["static answered"] == 0


def test_other_configs_take_the_general_path(fast_calls):
    logits, plans, _ = build_step([Req(depth=2)], 2, 20, seed=2)
    reads.run(sampler.verify(logits, plans, DSBDConfig(width=1, depth=2, mode="single")))
    reads.run(sampler.verify(logits, plans, DSBDConfig(width=1, depth=2), chain_fast_path=False))
    assert fast_calls["called"] == fast_calls["static called"] == 0
