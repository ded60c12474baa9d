"""Plain forests at temperature 0 from the draft-free sources, drafted on the host (``source_drafter.greedy_layers``:
no read of the device), are the forests the device path (``core.beam_step`` on the sources' rows, one read per depth)
draws: the same nodes, parents, depths and scores, the same joint, on random recycle tables and lookup texts with
several widths, depths, cost-model widths and EOS tokens. A planted host variant that does not renormalise each row (a
row's log-sum-exp taken as its largest estimate) is told apart by the same comparison."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core.sources import SourceIndex
from vllm_dsbd.engine import reads, source_drafter
from vllm_dsbd.engine.drafter import DraftJob
from vllm_dsbd.engine.source_drafter import SourceDrafter, host_greedy
from vllm_dsbd.engine.state import RequestState

V = 40


def _batch(seed: int, W: int, R: int = 6):
    rnd = random.Random(seed)
    jobs = []
    for r in range(R):
        st = RequestState(req_id=f"r{r}", seed=r, width=rnd.choice([1, W, W]), temperature=0.0, top_k=0, top_p=1.0,
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
                x, y = x[fa.valid], y[fb.valid] if fb.valid.shape == fa.valid.shape else y
            if x.shape != y.shape or not torch.equal(x, y):
                diff.append(f"{k}: forest.{name}")
        if fa.valid.shape == fb.valid.shape and not torch.allclose(fa.score[fa.valid], fb.score[fb.valid], atol=1e-4):
            diff.append(f"{k}: scores")
        qa, qb = fa.q_joint, fb.q_joint
        if qa.shape != qb.shape or not torch.equal(torch.isfinite(qa), torch.isfinite(qb)) or not torch.allclose(
                qa[torch.isfinite(qa)], qb[torch.isfinite(qb)], atol=1e-4):
            diff.append(f"{k}: joint")
    return diff


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("W", [1, 3])
def test_host_greedy_forests_are_beam_steps_draws(seed: int, W: int):
    jobs = _batch(seed, W)
    assert all(host_greedy(j) for j in jobs)
    drafter = _drafter(W)
    host = reads.run(drafter.propose_forests(jobs))
    dev = reads.run(drafter._device_forests(jobs))
    assert _same(host, dev) == []
    assert sum(len(f.tokens) for f in host if f is not None) > len(jobs)  # forests were drafted, some deep
    assert any(f is not None and f.depth >= 3 for f in host)


def test_propose_forests_reads_nothing_for_greedy_jobs_and_splits_mixed_batches():
    """Greedy jobs never yield (no read of the device); a sampling job in the batch goes to the device path, one read
    per depth, and the greedy jobs' forests stay the host's."""
    W = 2
    jobs = _batch(11, W)
    drafter = _drafter(W)
    gen = drafter.propose_forests(jobs)
    with pytest.raises(StopIteration):
        next(gen)
    jobs[2].state.temperature = 1.0
    assert not host_greedy(jobs[2])
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


def test_a_host_variant_without_renormalised_rows_is_told_apart(monkeypatch):
    """The planted variant: each row's log-sum-exp taken as its largest estimate (``fsum`` of the shifted exponentials
    read as 1), so rows with more or flatter candidates keep larger scores. The comparison above rejects it."""
    W = 3
    told = 0
    for seed in range(4):
        jobs = _batch(seed, W)
        drafter = _drafter(W)
        dev = reads.run(drafter._device_forests(jobs))
        with monkeypatch.context() as m:
            m.setattr(source_drafter.math, "fsum", lambda xs: 1.0)
            host = reads.run(drafter.propose_forests(jobs))
        told += bool(_same(host, dev))
    assert told >= 1
    assert math.fsum([0.5, 0.5]) == 1.0  # the patch was undone
