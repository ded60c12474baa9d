"""DSBD's per-step working memory bounded by chunking (``engine/chunks.py``): plain requests' verification
(``sampler.verify``) over a large batch holds at most ``budget`` float32 elements at once, measured by torch's CPU
allocator records (``mem_peak.peak_bytes``), and gives the results it gives unchunked.

* a step of 24 requests (G = 3, W = 4, V = 800; T = 0 and T > 0 rows, top-k / top-p, truncated forests, EOS), on the
  static and the row-subset paths: with budgets of 1 and 6 requests' worth (24 and 4 chunks), every RowResult field
  equal to the unchunked run's, and the peak <= the budget in bytes; the unchunked run's peak is over the larger
  budget (the bound has power);
* ``verify_chunk``: the arithmetic, at least one request per chunk.
"""
from __future__ import annotations

import random

import pytest
import torch

from mem_peak import peak_bytes
from test_verify_forest_static import _random_req, build_wide_step
from vllm_dsbd.core.forest import compact_index
from vllm_dsbd.engine import chunks, penalties, reads, sampler

G, W, V, R = 3, 4, 800, 24


@pytest.fixture(scope="module")
def step():
    rnd = random.Random(3)
    return build_wide_step([_random_req(rnd, G, V) for _ in range(R)], G, W, V, seed=11)


@pytest.mark.parametrize("static", [True, False], ids=["static", "row-subsets"])
def test_chunked_verification_stays_under_its_budget(step, static):
    logits, plans, cfg = step
    per_request = chunks.verify_blocks(G) * W * V  # elements

    def run(b):
        return reads.run(sampler.verify(logits, plans, cfg, chain_static=static, forest_static=static, budget=b))

    whole, whole_peak = peak_bytes(run, 1 << 40)
    assert sum(r.passed for r in whole) > 0 and any(p.state.temperature == 0 for p in plans)
    for n in (1, 6):
        budget = n * per_request
        assert chunks.verify_chunk(G, W, V, budget) == n
        chunked, peak = peak_bytes(run, budget)
        print(f"\n{'static' if static else 'row subsets'}: peak {peak / 2**20:.2f} MiB in chunks of {n} (budget "
              f"{4 * budget / 2**20:.2f} MiB), {whole_peak / 2**20:.2f} MiB in one")
        assert [(a.tokens, a.path, a.passed, a.widths, a.rows) for a in chunked] == \
            [(b.tokens, b.path, b.passed, b.widths, b.rows) for b in whole]
        assert peak <= 4 * budget
    assert whole_peak > 4 * 6 * per_request  # unchunked, the same step is over the budget


def test_verify_chunk_arithmetic():
    assert chunks.verify_blocks(3) == 4 + 3 + chunks.LAYER_BLOCKS
    assert chunks.verify_blocks(0) == chunks.verify_blocks(1)  # no draft model: one layer of rows
    assert chunks.verify_chunk(3, 4, 1000, 10 * chunks.verify_blocks(3) * 4000 + 1) == 10
    assert chunks.verify_chunk(3, 4, 128_000, 1) == 1  # at least one request
    assert chunks.verify_chunk(3, 4, 128_000) == chunks.VERIFY_BUDGET // (chunks.verify_blocks(3) * 4 * 128_000)


# ---- penalties: the penalized rows chunk by chunk, sparse -------------------------------------------------------

def _targets(plans, seed: int) -> list[penalties.TargetRows]:
    """Penalties on every request (three settings in turn) with random histories: prompt 60, output 40 tokens."""
    rnd = random.Random(seed)
    pens = [penalties.RequestPenalties(0.5, 0.25, 1.3), penalties.RequestPenalties(0.0, 0.7, 0.8),
            penalties.RequestPenalties(-0.4, 0.0, 1.1)]
    out = []
    for k, p in enumerate(plans):
        tokens, parents = [], []
        if p.forest is not None:
            f = p.forest.forest
            comp = compact_index(f.valid)[0]
            nodes = sorted((int(comp[d, j]), d, j) for d in range(G) for j in range(W) if bool(f.valid[0, d, j]))
            tokens = [int(f.token[0, d, j]) for _, d, j in nodes]
            parents = [-1 if d == 0 else int(comp[d - 1, int(f.parent[0, d, j])]) for _, d, j in nodes]
        out.append(penalties.TargetRows(p.first_row, tokens, parents, [rnd.randrange(V) for _ in range(60)],
                                        [rnd.randrange(V) for _ in range(40)], pens[k % 3]))
    return out


def test_sparse_penalties_equal_dense(step):
    """``penalize_rows_`` (sparse, in batches: every budget down to one request per batch) gives the dense
    reference's rows bit for bit, and leaves the other rows alone."""
    logits, plans, _ = step
    targets = _targets(plans, 5)[::2]  # every other request penalized
    want = penalties.penalize_target(logits, targets)
    assert not torch.equal(want, logits)
    for budget in (None, 3000, 1):
        assert torch.equal(penalties.penalize_rows_(logits.clone(), targets, budget), want)


@pytest.mark.parametrize("static", [True, False], ids=["static", "row-subsets"])
def test_penalized_verification_stays_under_its_budget(step, static):
    """With penalties on every request: ``sampler.verify(penalized=...)`` (the chunk's rows copied and penalized
    chunk by chunk) decides as verification on the dense reference's penalized logits, and its peak is under the
    budget of 2 requests (with ``penalties=True`` blocks); the unchunked variant (the dense penalized copy of every
    row and int64 counts [rows, V] first, as the engine did until 2026-11-27, then the same chunked verification) is
    over it."""
    logits, plans, cfg = step
    targets = _targets(plans, 6)
    budget = 2 * chunks.verify_blocks(G, penalties=True) * W * V
    assert chunks.verify_chunk(G, W, V, budget, penalties=True) == 2

    def chunked():
        return reads.run(sampler.verify(logits, plans, cfg, chain_static=static, forest_static=static, budget=budget,
                                        penalized=targets))

    def unchunked():
        dense = penalties.penalize_target(logits, targets)
        return reads.run(sampler.verify(dense, plans, cfg, chain_static=static, forest_static=static, budget=budget))

    got, peak = peak_bytes(chunked)
    want, peak_dense = peak_bytes(unchunked)
    print(f"\npenalties, {'static' if static else 'row subsets'}: peak {peak / 2**20:.2f} MiB chunked, "
          f"{peak_dense / 2**20:.2f} MiB unchunked (budget {4 * budget / 2**20:.2f} MiB)")
    assert [(a.tokens, a.path, a.passed, a.widths) for a in got] == [(b.tokens, b.path, b.passed, b.widths)
                                                                     for b in want]
    assert peak <= 4 * budget < peak_dense


# ---- over-drafted beams: the T = 0 draft step's top-N in chunks of requests ---------------------------------------

def _top_n_whole(rows: torch.Tensor, sc: torch.Tensor, eos: list[int], k: int):
    """The unchunked variant (the drafter until 2026-11-27): three float64 [R, N, V] at once."""
    joint = torch.log_softmax(rows.double(), dim=-1) + sc[:, :, None]
    for r, e in enumerate(eos):
        if e >= 0:
            joint[r, :, e] = -torch.inf
    return torch.topk(joint.flatten(1), k)


def test_beam_top_n_stays_under_its_budget():
    """16 requests of N = 12 over-drafted beams, V = 1,000 (some beams missing, some EOS banned): ``top_n`` in chunks
    of 3 requests gives the unchunked variant's values and indices, and its peak is under the budget (4 float32
    elements a pair per request of the chunk) plus the outputs; the unchunked variant is over it."""
    from vllm_dsbd.engine.beams.drafter import top_n

    gen = torch.Generator().manual_seed(2)
    R, N, Vb, k = 16, 12, 1000, 12
    rows = torch.randn(R, N, Vb, generator=gen) * 3
    sc = torch.randn(R, N, generator=gen, dtype=torch.float64).cumsum(1)
    sc[::5, 7:] = -torch.inf  # requests with fewer live beams
    eos = [3 if r % 3 == 0 else -1 for r in range(R)]
    budget = 3 * 4 * N * Vb
    (v, i), peak = peak_bytes(top_n, lambda a, b: rows[a:b], sc, eos, k, Vb, budget)
    (v0, i0), peak0 = peak_bytes(_top_n_whole, rows, sc, eos, k)
    print(f"\nbeam top-N: peak {peak / 2**20:.2f} MiB chunked, {peak0 / 2**20:.2f} MiB unchunked (budget "
          f"{4 * budget / 2**20:.2f} MiB)")
    assert torch.equal(v, v0) and torch.equal(i, i0)
    outputs = 2 * R * k * 16 + 4096  # the chunks' values and indices and their concatenation, EOS index tensors
    assert peak <= 4 * budget + outputs < peak0


# ---- the recycle source's harvest: in chunks of rows, only the [rows, K] results held across the read ----------

def test_harvest_stays_under_its_budget():
    """300 rows of V = 5,000 into three requests' tables: in chunks of 10 rows the harvest's peak is under its budget
    (HARVEST_BLOCKS float32 elements a (row, token)) plus the [rows, K] results, and the tables are the unchunked
    run's, key for key; unchunked (the harvest until 2026-12-06: one float copy of every row) it is over it."""
    from vllm_dsbd.core.sources import RECYCLE_K, SourceIndex
    from vllm_dsbd.engine.source_drafter import HARVEST_BLOCKS, harvest
    from vllm_dsbd.engine.state import RequestState

    Vh, n = 5000, 300
    logits = torch.randn(n + 7, Vh, generator=torch.Generator().manual_seed(4)) * 3

    def run(budget):
        states = [RequestState(req_id=f"r{k}", seed=k, width=1, temperature=1.0, top_k=0, top_p=1.0, eos=-1,
                               max_tokens=None, sources=SourceIndex(lookup=False)) for k in range(3)]
        rows = [(states[k % 3], k + 7, [k // 7, k]) for k in range(n)]
        _, peak = peak_bytes(reads.run, harvest(logits, rows, budget))
        return [st.sources._rows for st in states], peak

    budget = 10 * HARVEST_BLOCKS * Vh
    chunked, peak = run(budget)
    whole, whole_peak = run(1 << 40)
    print(f"\nharvest: peak {peak / 2**20:.2f} MiB in chunks of 10 rows (budget {4 * budget / 2**20:.2f} MiB), "
          f"{whole_peak / 2**20:.2f} MiB in one")
    assert chunked == whole and all(len(t) > 0 for t in whole)
    outputs = 3 * 2 * n * RECYCLE_K * 8 + 4096  # the chunks' results, their concatenation, index tensors
    assert peak <= 4 * budget + outputs < whole_peak
