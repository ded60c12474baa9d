"""The static verification of wide forests in mode "sample" (``core.verify_static.verify_forest_static`` through
``sampler.verify(..., forest_static=True)``: every row and layer under masks, no host synchronisation; what a GPU
runs at widths >= 2) gives exactly the general path's results (``verify_forest`` + ``iteration_outputs`` on row
subsets): every field of every RowResult, on random steps of width 2 to 4 that mix peaked and flat targets, drafts
from a close and from a distant draft, per-request depth 0..G and truncated forests, temperatures (0 included),
top-k / top-p, dynamic width on and off, and EOS drafted at every depth. The test also checks that the cases
exercised what they are meant to (accepts of later drafts after rejections, full passes, EOS ends, greedy rows,
truncation), and that the static path reads the device once (simulated device)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

import sim_device
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core import rng
from vllm_dsbd.core.forest import Forest, compact_index
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.engine import reads, sampler
from vllm_dsbd.engine.state import PendingForest, RequestState

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh


@dataclass
class Req:
    depth: int
    nodes: int | None = None  # forest nodes scheduled (None: all)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos: int = -1  # -2: the token of the first draft at depth eos_depth
    eos_depth: int = 1
    peak: float = 3.0
    noise: float = 0.3


def build_wide_step(reqs: list[Req], G: int, W: int, V: int, seed: int = 0, dynamic: bool = False):
    """(logits [rows, V], [RowPlan], DSBDConfig) of one width-W engine step: each request's forest drawn by the
    draft's beam sampling (W pairs without replacement from the draft joint over its live draft beams, EOS not
    continued), the draft's logits at a node being the target's there plus noise."""
    gen = torch.Generator().manual_seed(seed)
    plans, rows, first = [], [], 0
    for i, rq in enumerate(reqs):
        L = 5 + int(torch.randint(0, 50, (1,), generator=gen))
        rseed = int(torch.randint(0, 2**62, (1,), generator=gen))
        params = BatchParams.make(1, temperature=rq.temperature, top_k=rq.top_k, top_p=rq.top_p, width=W,
                                  seed=rseed, eos=-1, depth=rq.depth, single=True, max_k=1)
        tgt = {(0, 0): torch.randn(V, generator=gen) * rq.peak}  # target logits after node (depth, slot)
        steps, live, scores, eos = [], torch.zeros(1, W, dtype=torch.bool), torch.zeros(1, W), rq.eos
        live[0, 0] = True
        for d in range(rq.depth):
            par = torch.stack([tgt.get((d, j), torch.zeros(V)) for j in range(W)])
            draft = par + rq.noise * torch.randn(W, V, generator=gen)
            st = beam_step(draft[None], scores, live, params, torch.tensor([L + d]), rng.Stream.DRAFT_DRAW)
            steps.append(st)
            if eos == -2 and d + 1 == min(rq.eos_depth, rq.depth):
                eos = int(st.token[0, 0])
            for j in range(W):
                tgt[(d + 1, j)] = par[int(st.parent[0, j])] * 0.5 + torch.randn(V, generator=gen) * rq.peak
            live = st.valid & (st.token != eos)
            scores = torch.where(live, st.score, 0.0)
        eos = max(eos, -1)
        state = RequestState(req_id=f"r{i}", seed=rseed, width=W, temperature=rq.temperature, top_k=rq.top_k,
                             top_p=rq.top_p, eos=eos, max_tokens=None)
        plan = sampler.RowPlan(state=state, first_row=first, context_len=L)
        n = 0
        if rq.depth:
            forest = Forest.from_steps(steps, torch.tensor([rq.depth]), W)
            pad = G - rq.depth
            forest = Forest(parent=torch.nn.functional.pad(forest.parent, (0, 0, 0, pad)),
                            token=torch.nn.functional.pad(forest.token, (0, 0, 0, pad)),
                            valid=torch.nn.functional.pad(forest.valid, (0, 0, 0, pad)),
                            score=torch.nn.functional.pad(forest.score, (0, 0, 0, pad), value=float("-inf")),
                            q_joint=torch.nn.functional.pad(forest.q_joint, (0, 0, 0, pad), value=float("-inf")),
                            depth=forest.depth)
            total = int(forest.valid.sum())
            n = total if rq.nodes is None else min(rq.nodes, total)
        if n:
            cut = sampler.truncate(forest, L, n)
            comp = compact_index(cut.valid)[0]
            order = sorted((int(comp[d, j]), d, j) for d in range(G) for j in range(W) if bool(cut.valid[0, d, j]))
            toks = [int(cut.token[0, d, j]) for _, d, j in order]
            pars = [-1 if d == 0 else int(comp[d - 1, int(cut.parent[0, d, j])]) for _, d, j in order]
            plan.forest = PendingForest(forest=cut, tokens=toks, parents=pars, depths=[d + 1 for _, d, _ in order],
                                        root_pos=L - 1)
            plan.num_nodes, plan.drafted_depth = n, rq.depth
            plan.drafted_nodes = total  # (for the test's coverage count)
            rows.append(tgt[(0, 0)])
            rows.extend(tgt[(d + 1, j)] for _, d, j in order)
        else:
            rows.append(tgt[(0, 0)])
        first += n + 1
        plans.append(plan)
    cfg = DSBDConfig(width=W, depth=G, dynamic_width=dynamic)
    return torch.stack(rows), plans, cfg


def _random_req(rnd: random.Random, G: int, V: int) -> Req:
    depth = rnd.choice([0] + [rnd.randint(1, G)] * 3 + [G] * 3)
    return Req(depth=depth, nodes=rnd.choice([None, None, None, rnd.randint(0, 3 * G)]),
               temperature=rnd.choice([0.0, 0.5, 1.0, 1.0, 1.0, 1.7]),
               top_k=rnd.choice([0, 0, 0, 1, 5, V // 2]), top_p=rnd.choice([1.0, 1.0, 1.0, 0.9, 0.5]),
               eos=rnd.choice([-1, -1, rnd.randrange(V), -2]), eos_depth=rnd.randint(1, G),
               peak=rnd.choice([0.3, 1.0, 3.0, 8.0]), noise=rnd.choice([0.0, 0.1, 0.5, 2.0]))


def _compare(logits, plans, cfg, seen: Counter, greedy: bool = False):
    """The static path (``greedy``: the all-greedy walk, ``sampler._greedy_forests``) against the general path."""
    static = reads.run(sampler.verify(logits, plans, cfg, forest_static=not greedy, greedy_fast_path=greedy))
    general = reads.run(sampler.verify(logits, plans, cfg, forest_static=False, greedy_fast_path=False))
    assert len(static) == len(general)
    for i, (a, b) in enumerate(zip(static, general)):
        assert (a.tokens, a.path, a.passed, a.widths, a.rows) == (b.tokens, b.path, b.passed, b.widths, b.rows), i
        plan = plans[i]
        depth = int(plan.forest.forest.depth) if plan.forest is not None else 0
        seen["rows"] += 1
        seen["depth 0"] += depth == 0
        seen["accepted layers"] += b.passed
        seen["rejected"] += depth > 0 and b.passed < depth and plan.state.eos not in b.tokens
        seen["full passes"] += depth > 0 and b.passed == depth
        seen["eos ends"] += b.tokens[-1] == plan.state.eos
        seen["greedy rows"] += plan.state.temperature == 0
        seen["truncated"] += plan.forest is not None and plan.num_nodes < plan.drafted_nodes
        # a passed layer whose node is not the layer's first draft: a later draft accepted after a rejection
        if plan.forest is not None:
            f = plan.forest.forest
            for d, c in enumerate(a.path):
                seen["later draft accepted"] += c != int(compact_index(f.valid)[0, d, 0])


@pytest.fixture
def static_calls(monkeypatch):
    calls = Counter()
    core = sampler.verify_forest_static

    def spy(*args):
        calls["called"] += 1
        return core(*args)

    monkeypatch.setattr(sampler, "verify_forest_static", spy)
    return calls


@pytest.mark.parametrize("G,W,V", [(1, 2, 11), (3, 2, 50), (3, 4, 40), (2, 3, 400)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_static_forest_path_equals_general_path(G, W, V, dynamic, static_calls):
    rnd = random.Random(1000 * G + 100 * W + V + dynamic)
    seen = Counter()
    steps, with_forest = 40, 0
    for step in range(steps):
        R = rnd.choice([1, 2, 3, 8, 17])
        logits, plans, cfg = build_wide_step([_random_req(rnd, G, V) for _ in range(R)], G, W, V, seed=step,
                                             dynamic=dynamic)
        _compare(logits, plans, cfg, seen)
        with_forest += any(p.forest is not None for p in plans)  # a step without any is narrowed (chain path)
    assert static_calls["called"] == with_forest >= steps // 2
    for what in ("depth 0", "rejected", "full passes", "eos ends", "greedy rows", "truncated",
                 "later draft accepted"):
        assert seen[what] >= 3, (what, seen)
    assert seen["accepted layers"] >= seen["rows"] // 4, seen
    print(dict(seen))


@pytest.mark.parametrize("G,W,V", [(3, 2, 50), (2, 4, 400)])
def test_an_all_greedy_step_skips_the_sampling_layer_with_the_same_results(G, W, V, monkeypatch):
    """A step whose requests are all at temperature 0 (a host fact) does not run the sampling rows' layer
    (``verify_layer_static``: every row's k is 0 there) and gives the general path's results: greedy forests of every
    depth, EOS drafted, truncated, accepted in full and rejected."""
    from vllm_dsbd.core import verify_static

    calls = Counter()
    layer = verify_static.verify_layer_static
    monkeypatch.setattr(verify_static, "verify_layer_static", lambda *a: (calls.update(["layer"]), layer(*a))[1])
    rnd = random.Random(7 * G + W + V)
    seen = Counter()
    for step in range(20):
        reqs = [dataclasses.replace(_random_req(rnd, G, V), temperature=0.0) for _ in range(rnd.choice([1, 3, 8]))]
        logits, plans, cfg = build_wide_step(reqs, G, W, V, seed=step)
        _compare(logits, plans, cfg, seen)
    assert calls["layer"] == 0
    for what in ("rejected", "full passes", "eos ends", "truncated"):
        assert seen[what] >= 2, (what, seen)
    assert seen["greedy rows"] == seen["rows"]
    # a sampling request in the step runs the layer again
    logits, plans, cfg = build_wide_step([Req(depth=G, temperature=0.0), Req(depth=G)], G, W, V, seed=99)
    _compare(logits, plans, cfg, seen)
    assert calls["layer"] == G + 1


@pytest.mark.parametrize("G,W,V", [(1, 2, 11), (3, 2, 50), (3, 4, 40), (4, 1, 30), (2, 3, 400)])
def test_an_all_greedy_chunk_walks_its_forests_on_the_host_with_the_same_results(G, W, V, monkeypatch):
    """A chunk whose requests are all at temperature 0 takes ``sampler._greedy_forests`` (the top-1 of every root and
    scheduled node row in one read, the walk on the host) and gives the general path's results, field for field:
    forests of every depth (chains too), EOS drafted at every depth, truncated forests, full passes and rejections; it
    declines a NaN row. The walk is what ran (spied), and it reads the device once."""
    calls = Counter()
    walk = sampler._greedy_forests

    def spy(*a):
        out = yield from walk(*a)
        calls["walked" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(sampler, "_greedy_forests", spy)
    rnd = random.Random(31 * G + 7 * W + V)
    seen = Counter()
    steps = 30
    for step in range(steps):
        reqs = [dataclasses.replace(_random_req(rnd, G, V), temperature=0.0) for _ in range(rnd.choice([1, 3, 8]))]
        logits, plans, cfg = build_wide_step(reqs, G, W, V, seed=step)
        _compare(logits, plans, cfg, seen, greedy=True)
    assert calls["walked"] >= steps // 2 and calls["declined"] == 0, calls
    for what in ("rejected", "full passes", "eos ends", "truncated"):
        assert seen[what] >= 2, (what, seen)
    if W > 1:
        assert seen["later draft accepted"] >= 1, seen
    logits, plans, cfg = build_wide_step([Req(depth=G, temperature=0.0)] * 2, G, W, V, seed=5)
    logits[plans[1].first_row + 1] = float("nan")  # a node row: the walk declines (to the general path)
    assert reads.run(walk(logits, plans)) is None
    for p in plans:
        f = p.forest.forest
        p.forest.forest = Forest(*(sim_device.tag(x.clone()) for x in (f.parent, f.token, f.valid, f.score,
                                                                         f.q_joint, f.depth)))
    logits, _, _ = build_wide_step([Req(depth=G, temperature=0.0)] * 2, G, W, V, seed=5)
    mode = sim_device.SimulatedDevice()
    with mode:
        reads.run(sampler.verify(sim_device.tag(logits.clone()), plans, cfg))
    assert mode.mismatches == [] and sum(mode.syncs.values()) == 1, (mode.mismatches[:3], mode.syncs)


def test_uniform_sampling_steps():
    """Every row a sampling row, all layers drafted (the common case), one-request steps included, and a
    vocabulary above the CPU's reduction grain (one row over 32768 entries)."""
    seen = Counter()
    for step, (R, G, W, V) in enumerate([(16, 3, 2, 400), (1, 3, 4, 400), (1, 2, 2, 20000), (3, 2, 2, 20000)]):
        logits, plans, cfg = build_wide_step([Req(depth=G, noise=[0.0, 0.3, 1.0][i % 3]) for i in range(R)],
                                             G, W, V, seed=step)
        _compare(logits, plans, cfg, seen)
    assert seen["full passes"] and seen["rejected"], seen


def test_reads_the_device_once():
    logits, plans, cfg = build_wide_step([Req(depth=3, temperature=t) for t in (1.0, 0.0, 0.7, 1.0)], 3, 2, 60,
                                         seed=4)
    for p in plans:
        f = p.forest.forest
        p.forest.forest = Forest(*(sim_device.tag(x.clone()) for x in (f.parent, f.token, f.valid, f.score,
                                                                         f.q_joint, f.depth)))
        p.forest.depth = int(f.depth)
    mode = sim_device.SimulatedDevice()
    with mode:
        out = reads.run(sampler.verify(sim_device.tag(logits.clone()), plans, cfg, forest_static=True))
    assert mode.mismatches == [], mode.mismatches[:3]
    assert sum(mode.syncs.values()) == 1 and next(iter(mode.syncs)).startswith("engine/reads.py"), mode.syncs
    ref = reads.run(sampler.verify(logits, plans, cfg, forest_static=False))
    assert [(a.tokens, a.path) for a in out] == [(b.tokens, b.path) for b in ref]


def test_nan_logits_decline_to_the_general_path():
    logits, plans, cfg = build_wide_step([Req(depth=2), Req(depth=2)], 2, 2, 20, seed=1)
    logits[plans[1].first_row] = float("nan")
    for static in (False, True):
        with pytest.raises(AssertionError):
            reads.run(sampler.verify(logits, plans, cfg, forest_static=static))


def _to(plans, dev):
    for p in plans:
        if p.forest is not None:
            f = p.forest.forest
            p.forest.forest = Forest(*(x.to(dev) for x in (f.parent, f.token, f.valid, f.score, f.q_joint, f.depth)))
    return plans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the static path on a GPU needs one (check.sh runs it)")
def test_on_cuda_the_default_is_the_static_path_and_equals_the_general_path(static_calls):
    rnd = random.Random(7)
    seen = Counter()
    for step in range(30):
        G, W, V = rnd.choice([(3, 2, 400), (2, 4, 1000)])
        logits, plans, cfg = build_wide_step([_random_req(rnd, G, V) for _ in range(rnd.choice([1, 4, 16]))], G, W, V,
                                             seed=step)
        plans = _to(plans, "cuda")
        static = reads.run(sampler.verify(logits.cuda(), plans, cfg))  # the default on a device
        general = reads.run(sampler.verify(logits.cuda(), plans, cfg, forest_static=False))
        for a, b in zip(static, general):
            assert (a.tokens, a.path, a.passed, a.widths) == (b.tokens, b.path, b.passed, b.widths)
            seen["accepted layers"] += b.passed
    assert static_calls["called"] == 30 and seen["accepted layers"] > 0


def test_static_verify_setting(monkeypatch):
    """``VLLM_DSBD_STATIC_VERIFY``: auto = static on a device only; 1 / 0 force; anything else is refused."""
    cpu, dev = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(sampler.STATIC_ENV, raising=False)
    assert not sampler.static_default(cpu) and sampler.static_default(dev)
    for value, want in (("1", True), ("on", True), ("0", False), ("false", False), ("auto", None)):
        monkeypatch.setenv(sampler.STATIC_ENV, value)
        assert sampler.static_default(cpu) == (False if want is None else want)
        assert sampler.static_default(dev) == (True if want is None else want)
    monkeypatch.setenv(sampler.STATIC_ENV, "sometimes")
    with pytest.raises(ValueError, match="VLLM_DSBD_STATIC_VERIFY must be auto, 1 or 0"):
        sampler.static_default(cpu)
    # forced on the CPU, a step takes the static forest path
    monkeypatch.setenv(sampler.STATIC_ENV, "1")
    calls = Counter()
    core = sampler.verify_forest_static
    monkeypatch.setattr(sampler, "verify_forest_static", lambda *a: calls.update(["static"]) or core(*a))
    logits, plans, cfg = build_wide_step([Req(depth=2), Req(depth=1)], 2, 2, 30, seed=3)
    forced = reads.run(sampler.verify(logits, plans, cfg))
    monkeypatch.setenv(sampler.STATIC_ENV, "0")
    subsets = reads.run(sampler.verify(logits, plans, cfg))
    assert calls["static"] == 1 and [r.tokens for r in forced] == [r.tokens for r in subsets]


@pytest.mark.parametrize("G,W,V", [(1, 2, 11), (3, 4, 40), (2, 3, 400)])
@pytest.mark.parametrize("static", [False, True])
def test_a_step_without_forests_narrows_to_one_slot(G, W, V, static):
    """A chunk in which no request has a forest (the cost model drafted nothing) is verified at one parent slot and
    one layer (``sampler._verify_chunk``'s ``narrow_bare``; at width 1 it takes the chain path): the same tokens as
    at the engine's full [G + 1, W, V] shapes, static paths (a GPU's) and general ones, over temperatures (0
    included), top-k / top-p and EOS; and the draws are not all the same token (a path that ignored the noise would
    pass the equality with itself only)."""
    rnd = random.Random(7 * G + W + V + static)
    tokens = Counter()
    for step in range(12):
        reqs = [dataclasses.replace(_random_req(rnd, G, V), depth=0) for _ in range(rnd.choice([1, 3, 8]))]
        logits, plans, cfg = build_wide_step(reqs, G, W, V, seed=step)
        narrow = reads.run(sampler.verify(logits, plans, cfg, forest_static=static, chain_static=static))
        full = reads.run(sampler.verify(logits, plans, cfg, forest_static=static, chain_static=static,
                                        narrow_bare=False))
        assert [(a.tokens, a.path, a.passed, a.widths, a.rows) for a in narrow] == \
            [(b.tokens, b.path, b.passed, b.widths, b.rows) for b in full]
        tokens.update(r.tokens[0] for r, p in zip(narrow, plans) if p.state.temperature > 0)
    assert len(tokens) >= 5, tokens


@pytest.mark.parametrize("G,W,V", [(1, 1, 11), (3, 4, 40), (2, 3, 400)])
def test_an_all_greedy_step_without_forests_takes_the_root_top1(G, W, V):
    """A chunk without forests whose requests are all greedy (the greedy walk, ``sampler._greedy_forests``: one top-1
    per root row) gives the tokens of the full [G + 1, W, V] shapes without the walk, EOS and top-k / top-p settings
    included; a NaN row declines to the general path, which fails as at the full shapes."""
    rnd = random.Random(G + 10 * W + V)
    for step in range(8):
        reqs = [dataclasses.replace(_random_req(rnd, G, V), depth=0, temperature=0.0)
                for _ in range(rnd.choice([1, 3, 8]))]
        logits, plans, cfg = build_wide_step(reqs, G, W, V, seed=step)
        if step == 7:  # the general path has no output for a NaN row, at both shapes (it asserts one)
            logits[plans[0].first_row] = float("nan")
            for narrow in (True, False):
                with pytest.raises(AssertionError, match="exactly one beam"):
                    reads.run(sampler.verify(logits, plans, cfg, narrow_bare=narrow))
            continue
        fast = reads.run(sampler.verify(logits, plans, cfg))
        full = reads.run(sampler.verify(logits, plans, cfg, narrow_bare=False, greedy_fast_path=False))
        assert [(a.tokens, a.path, a.passed, a.widths, a.rows) for a in fast] == \
            [(b.tokens, b.path, b.passed, b.widths, b.rows) for b in full]
