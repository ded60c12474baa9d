"""Plain forests from the draft-free sources, drafted on the host (``source_drafter.host_layers``: no read of the
device), are the forests the device path (``core.beam_step`` on the sources' rows, one read per depth) draws: the same
nodes, parents, depths and scores, the same joint (log Q), on random recycle tables and lookup texts with several
widths, depths, cost-model widths, EOS tokens, temperatures (0 included), top-k and top-p. Planted host variants are
told apart by the same comparison: rows not renormalised (a row's log-sum-exp taken as its largest estimate), and
noise keyed by the node's position instead of the forest's (``rng.forest_position``)."""
from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core.sources import SourceIndex
from vllm_dsbd.engine import reads, source_drafter
from vllm_dsbd.engine.drafter import DraftJob
from vllm_dsbd.engine.source_drafter import SourceDrafter, on_host
from vllm_dsbd.engine.state import RequestState

V = 40


def _batch(seed: int, W: int, R: int = 6, sampled: bool = False):
    rnd = random.Random(seed)
    jobs = []
    for r in range(R):
        t = rnd.choice([0.0, 0.5, 1.0, 1.0, 1.7]) if sampled else 0.0
        st = RequestState(req_id=f"r{r}", seed=rnd.randrange(2**62), width=rnd.choice([1, W, W]), temperature=t,
                          top_k=rnd.choice([0, 0, 1, 3, 6]) if sampled else 0,
                          top_p=rnd.choice([1.0, 1.0, 0.9, 0.5]) if sampled else 1.0,
                          eos=rnd.choice([-1, -1, rnd.randrange(V)]), max_tokens=None)
        src = SourceIndex(recycle=True, lookup=rnd.random() < 0.5)
        for a in range(V):  # most contexts have a row of 1-8 candidates with distinct random log-probabilities
            for b in range(V):
                if rnd.random() < 0.9:
                    n = rnd.randint(1, 8)
                    src.add_row([a, b], rnd.sample(range(V), n), [rnd.uniform(-6.0, 0.0) for _ in range(n)])
        st.sources = src
        tokens = [rnd.randrange(V) for _ in range(rnd.randint(3, 30))]
        jobs.append(DraftJob(state=st, row=r, tokens=tokens, start=0, root_pos=len(tokens) - 1,
                             depth=rnd.randint(1, 4), width=rnd.choice([None, None, 1])))
    return jobs


def _drafter(W: int) -> SourceDrafter:
    runner = SimpleNamespace(device=torch.device("cpu"), model_config=SimpleNamespace(get_vocab_size=lambda: V))
    return SourceDrafter(runner, DSBDConfig(draft=False, width=W, depth=4, verify_budget=None,
                                            sources=("recycle", "lookup")))


def _same(host, dev) -> list[str]:
    """What differs between two lists of pending forests (empty: the same forests)."""
    diff = []
    for k, (a, b) in enumerate(zip(host, dev)):
        if (a is None) != (b is None):
            diff.append(f"{k}: forest on one side only")
            continue
        if a is None:
            continue
        for name in ("tokens", "parents", "depths", "depth", "root_pos"):
            if getattr(a, name) != getattr(b, name):
                diff.append(f"{k}: {name} {getattr(a, name)} != {getattr(b, name)}")
        fa, fb = a.forest, b.forest
        for name in ("parent", "token", "valid", "depth"):
            x, y = getattr(fa, name), getattr(fb, name)
            if name in ("parent", "token"):
                x, y = x[fa.valid], y[fb.valid]
            if x.shape != y.shape or not torch.equal(x, y):
                diff.append(f"{k}: forest.{name}")
        if torch.equal(fa.valid, fb.valid) and not torch.allclose(fa.score[fa.valid], fb.score[fb.valid], atol=1e-4):
            diff.append(f"{k}: scores")
        qa, qb = fa.q_joint, fb.q_joint
        if qa.shape != qb.shape or not torch.equal(torch.isfinite(qa), torch.isfinite(qb)) or not torch.allclose(
                qa[torch.isfinite(qa)], qb[torch.isfinite(qb)], atol=1e-4):
            diff.append(f"{k}: joint")
    return diff


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("sampled", [False, True])
def test_host_forests_are_beam_steps_draws(seed: int, W: int, sampled: bool):
    jobs = _batch(seed, W, sampled=sampled)
    assert all(on_host(j) for j in jobs)
    drafter = _drafter(W)
    host = reads.run(drafter.propose_forests(jobs))
    dev = reads.run(drafter._device_forests(jobs))
    assert _same(host, dev) == []
    assert sum(len(f.tokens) for f in host if f is not None) > len(jobs)  # forests were drafted, some deep
    assert any(f is not None and f.depth >= 2 for f in host)
    if sampled and W > 1:  # sampling requests drew, some more than one node at a depth
        assert any(f is not None and j.state.temperature > 0 and len(f.tokens) > f.depth for j, f in zip(jobs, host))


def test_propose_forests_reads_nothing_without_rows_to_process_and_splits_batches():
    """Jobs without rows to process never yield (no read of the device); a job with penalties (its ``history``) in the
    batch goes to the device path, one read per depth, and the other jobs' forests stay the host's."""
    W = 2
    jobs = _batch(11, W, sampled=True)
    drafter = _drafter(W)
    gen = drafter.propose_forests(jobs)
    with pytest.raises(StopIteration):
        next(gen)
    jobs[2] = dataclasses.replace(jobs[2], history=(list(jobs[2].tokens), []))
    assert not on_host(jobs[2])
    asks = []

    def counted(reader):
        try:
            ask = next(reader)
            while True:
                asks.append(ask)
                ask = reader.send(reads.fetch(ask))
        except StopIteration as stop:
            return stop.value

    mixed = counted(drafter.propose_forests(jobs))
    assert 1 <= len(asks) <= jobs[2].depth
    alone = reads.run(drafter.propose_forests([j for k, j in enumerate(jobs) if k != 2]))
    assert _same([f for k, f in enumerate(mixed) if k != 2], alone) == []
    assert mixed[2] is not None


@pytest.mark.parametrize("variant", ["rows not renormalised", "noise keyed by the node's position"])
def test_planted_host_variants_are_told_apart(monkeypatch, variant):
    """The planted variants: each row's log-sum-exp taken as its largest estimate (``fsum`` of the shifted
    exponentials read as 1), so rows with more or flatter candidates keep larger scores; and the noise keyed by
    ``root + d`` (the node's position, as draft draws were keyed until D10) instead of the forest's word. The
    comparison above rejects both."""
    W = 3
    told = 0
    for seed in range(4):
        jobs = _batch(seed, W, sampled=True)
        drafter = _drafter(W)
        dev = reads.run(drafter._device_forests(jobs))
        with monkeypatch.context() as m:
            if variant == "rows not renormalised":
                m.setattr(source_drafter.math, "fsum", lambda xs: 1.0)
            else:
                m.setattr(source_drafter.rng, "forest_position", lambda root, d: root + d)
            host = reads.run(drafter.propose_forests(jobs))
        told += bool(_same(host, dev))
    assert told >= 2
    assert math.fsum([0.5, 0.5]) == 1.0 and source_drafter.rng.forest_position(1, 1) == (1 << 16) + 1  # undone


def test_prompt_rows_of_the_requests_kept_only():
    """``prompt_rows`` lists every prompt row before the last of each request in prefill (its row in the pass and its
    last two tokens), and with ``keep`` only those of the requests it keeps (the runner keeps a request where forests
    of its kind pay, ``StepClock.recycles_prompt``): here the second request, a beam request, is left out."""
    import numpy as np

    cfg = DSBDConfig(draft=False, width=2, depth=4, verify_budget=None, sources=("recycle", "lookup"))
    states = [RequestState(f"r{i}", 0, 2, 0.0, 0, 1.0, -1, 8) for i in range(2)]
    states[1].beam = object()  # a beam request (only its presence is read)
    plan = [SimpleNamespace(state=st) for st in states]
    batch = SimpleNamespace(token_ids_cpu=np.array([[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]]),
                            num_prompt_tokens=np.array([4, 3]))
    qsl, computed, scheduled = [0, 4], [0, 0], [4, 3]
    rows = source_drafter.prompt_rows(plan, batch, qsl, computed, scheduled, cfg)
    assert [(st.req_id, r, ctx) for st, r, ctx in rows] == [
        ("r0", 0, [5]), ("r0", 1, [5, 6]), ("r0", 2, [6, 7]), ("r1", 4, [9]), ("r1", 5, [9, 10])]
    kept = source_drafter.prompt_rows(plan, batch, qsl, computed, scheduled, cfg, lambda st: st.beam is None)
    assert [(st.req_id, r) for st, r, _ in kept] == [("r0", 0), ("r0", 1), ("r0", 2)]
