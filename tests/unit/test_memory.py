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

from mem_peak import peak_bytes
from test_verify_forest_static import _random_req, build_wide_step
from vllm_dsbd.engine import chunks, reads, sampler

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
