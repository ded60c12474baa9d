"""core.rng: the documented formula, distinct keys give unrelated numbers, 64-bit keys, and the noise's far tail.

Planted variants, each rejected by the test that names it: ``_xor_uniform`` (the index meets the key before it is
mixed, as the hash before 2026-11-25 did: keys k and k ^ d give permuted arrays), ``_uniform23`` (the 23-bit uniforms
used until 2026-11-27, docs/deviations.md D21: Gumbel noise stops at 16.64), 32-bit keys and draft draws keyed by the
node's position (used until 2026-12-06: a forest reused an earlier forest's numbers, docs/deviations.md D10). All keys are fixed, so the
tests are deterministic; each threshold sits where the correct generator fails with probability below ~1e-7.
"""
from __future__ import annotations

import math

import pytest
import torch

from vllm_dsbd.core import rng

N = 4096  # indices per key (one uniform per index)
DIFFS = [1, 2, 3, 7, 100, 4095]  # key differences inside the index range
M64 = (1 << 64) - 1

# 64 fixed keys as the engine makes them: request_key over seeds and positions
KEYS = rng.request_key(torch.arange(64, dtype=torch.int64) * 1_000_003, torch.arange(64, dtype=torch.int64) + 17,
                       rng.Stream.DRAFT_DRAW)

# thresholds: |r| * sqrt(n) is N(0, 1) for independent streams; chi-square of the 10 x 10 joint histogram against the
# uniform product (n / 100 a cell) has 99 degrees of freedom (mean 99, sd 14); P(chi2_99 > 200) ~ 1e-8
Z_MAX = 6.0
CHI2_MAX = 200.0

# the largest Gumbel noise 23-bit uniforms can give: -log(-log(1 - 2**-24))
CAP23 = -math.log(-math.log1p(-(2.0**-24)))


def _xor_uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Planted: fmix64((key ^ index) * INDEX_MUL), the index not mixed before it meets the key."""
    h = rng._fmix64_((key ^ index) * rng._i64(rng.INDEX_MUL))
    return ((h >> 11) & ((1 << 53) - 1)).to(torch.float64).add_(0.5).mul_(2.0**-53)


def _noise23(bits: torch.Tensor) -> torch.Tensor:
    """Planted: the noise of 23 of the same bits, as before 2026-11-27: u = ((bits >> 41) + 0.5) * 2**-23."""
    u = ((bits >> 41) & 0x7FFFFF).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return rng.gumbel_of_(u.double())


def _py_fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * rng.FMIX_C1) & M64
    h ^= h >> 33
    h = (h * rng.FMIX_C2) & M64
    return h ^ (h >> 33)


def _shared_fraction(uniform, k1: int, k2: int) -> float:
    """Fraction of the N uniforms of key k1 that also occur (anywhere) among the N uniforms of key k2."""
    idx = torch.arange(N, dtype=torch.int64)
    a = uniform(torch.tensor([k1]), idx)
    b = uniform(torch.tensor([k2]), idx)
    return float(torch.isin(a, b).double().mean())


def _independence(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(|r| * sqrt(n), chi-square of the 10 x 10 joint histogram) of paired uniforms a, b (1-D, same length)."""
    a, b = a.double().flatten(), b.double().flatten()
    n = a.numel()
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    cell = (a * 10).long().clamp(max=9) * 10 + (b * 10).long().clamp(max=9)
    hist = torch.bincount(cell, minlength=100).double()
    e = n / 100
    return abs(r) * n**0.5, float(((hist - e) ** 2 / e).sum())


def _check_independent(uniform, d: int) -> list[str]:
    """The failures of the independence check for key difference d (empty: passes): for the 64 fixed keys k and
    their partners k ^ d, u(k, i) beside u(k ^ d, i) and beside u(k ^ d, i ^ d)."""
    idx = torch.arange(N, dtype=torch.int64)[None, :]
    k1 = KEYS[:, None]
    a = uniform(k1, idx)
    bad = []
    for name, b in (("i", uniform(k1 ^ d, idx)), ("i^d", uniform(k1 ^ d, idx ^ d))):
        z, chi = _independence(a, b)
        if z > Z_MAX or chi > CHI2_MAX:
            bad.append(f"d={d} alignment {name}: |r| sqrt(n)={z:.2f}, chi2={chi:.1f}")
    return bad


def test_uniform_is_the_documented_formula():
    """Keys, uniforms and noise (int64 / float64 torch arithmetic) equal the module docstring's formulas in plain
    Python integers, bit for bit, at the edges of 64 bits; uniforms are odd multiples of 2**-53 in (0, 1)."""
    seeds = [0, 1, 2**63 - 1, -(2**63), -1, 123456789]
    pos = [0, 1, 2**32, 2**63 - 1, 77, 5]
    got_k = rng.request_key(torch.tensor(seeds), torch.tensor(pos), rng.Stream.RESIDUAL)
    for a, (s, p) in enumerate(zip(seeds, pos)):
        h = _py_fmix64(_py_fmix64(_py_fmix64((s & M64) ^ rng.SEED_SALT) ^ p) ^ ((4 * rng.STREAM_MUL) & M64))
        assert int(got_k[a]) & M64 == h, (s, p)
    keys = [0, 1, 2**63 - 1, -(2**63), -1, int(KEYS[0])]
    idx = [0, 1, 4095, 2**31, 2**32 + 5, 2**62 + 3, -7]
    got = rng.uniform(torch.tensor(keys)[:, None], torch.tensor(idx)[None, :])
    for a, k in enumerate(keys):
        kk = _py_fmix64((k & M64) ^ rng.KEY_SALT)
        for b, i in enumerate(idx):
            h = _py_fmix64(kk ^ _py_fmix64(((i & M64) * rng.INDEX_MUL + rng.INDEX_ADD) & M64))
            assert float(got[a, b]) == (2 * (h >> 12) + 1) * 2.0**-53, (k, i)
    assert got.dtype == torch.float64 and bool(((got > 0) & (got < 1)).all())
    g = rng.gumbel(torch.tensor(keys), 4096)
    u = rng.uniform(torch.tensor(keys)[:, None], torch.arange(4096)[None, :])
    assert g.dtype == torch.float32 and torch.equal(g, (-torch.log(-torch.log(u))).float())


def test_gumbel_pieces_are_the_whole():
    """rng.gumbel computes a large call in pieces on the CPU: the same numbers as one pass (ragged edges)."""
    keys = KEYS[:7]
    n = rng._CPU_PIECE + 1234
    whole = rng.gumbel_of_(rng.uniform(keys[:, None], torch.arange(n)[None, :]))
    assert torch.equal(rng.gumbel(keys, n), whole)


@pytest.mark.parametrize("d", DIFFS)
def test_keys_differing_in_low_bits_share_no_numbers(d):
    """Keys k and k ^ d: none of the 4,096 uniforms of one occur among the other's (53-bit arrays share about
    N**2 / 2**52 = 4e-9 of them by chance; the threshold is 1%). The planted xor hash shares all of them."""
    for k in [int(KEYS[0]), int(KEYS[1]), 0, -1]:
        assert _shared_fraction(rng.uniform, k, k ^ d) < 0.01, (k, d)
        assert _shared_fraction(_xor_uniform, k, k ^ d) == 1.0, (k, d)


@pytest.mark.parametrize("d", DIFFS)
def test_keys_differing_in_low_bits_are_independent(d):
    """64 fixed key pairs (k, k ^ d), 262,144 paired uniforms per alignment: Pearson |r| sqrt(n) < 6 and the 10 x 10
    joint histogram's chi-square (99 df) < 200. The planted xor hash fails on the i ^ d alignment (r = 1)."""
    assert _check_independent(rng.uniform, d) == []
    old = _check_independent(_xor_uniform, d)
    assert any("alignment i^d" in s for s in old), old


def test_streams_of_one_position_are_independent():
    """The streams a decision uses together (draft draw, acceptance coin, residual draw, direct draws) at one (seed,
    position): aligned uniforms pass the same check, pairwise."""
    base = rng.key_base(torch.arange(64, dtype=torch.int64) * 7919, torch.full((64,), 1000, dtype=torch.int64))
    idx = torch.arange(N, dtype=torch.int64)[None, :]
    streams = [rng.Stream.DRAFT_DRAW, rng.Stream.ACCEPT, rng.Stream.RESIDUAL, rng.Stream.DIRECT]
    u = {s: rng.uniform(rng.stream_key(base, s)[:, None], idx) for s in streams}
    for x in range(len(streams)):
        for y in range(x + 1, len(streams)):
            z, chi = _independence(u[streams[x]], u[streams[y]])
            assert z < Z_MAX and chi < CHI2_MAX, (streams[x].name, streams[y].name, z, chi)


def test_keys_of_a_long_request_are_distinct():
    """Every key of one request's decisions, 5 streams x 65,536 positions (a 65k-token request): all distinct. With
    the same keys cut to 32 bits (the planted variant; the keys before 2026-11-27 had 32) about
    n**2 / 2**33 = 12.5 pairs collide: two decisions share a noise array. P(any collision at 64 bits) ~ 6e-9."""
    n_pos = 1 << 16
    base = rng.key_base(torch.full((n_pos,), 987654321, dtype=torch.int64), torch.arange(n_pos, dtype=torch.int64))
    keys = torch.cat([rng.stream_key(base, s) for s in rng.Stream])
    assert torch.unique(keys).numel() == keys.numel()
    cut = keys & 0xFFFFFFFF
    assert keys.numel() - torch.unique(cut).numel() >= 1  # the planted variant collides (13 pairs here)



def test_every_forest_draws_fresh_numbers():
    """``forest_position``: the draft draws of the forests of one request (roots 0..4095, depths 1..8, each root's
    forest after the last) have distinct keys, so no forest reuses numbers an earlier one drew with. The planted
    keying by node position (``root + depth``, the keying before 2026-12-06) gives the forest at root r + a the same
    numbers at depth d as the forest at root r at depth d + a: most keys repeat."""
    roots = torch.arange(4096, dtype=torch.int64)[:, None]
    depths = torch.arange(1, 9, dtype=torch.int64)[None, :]
    seed = torch.tensor([[123456789]], dtype=torch.int64)

    def keys(pos):
        return rng.request_key(seed.expand_as(pos).flatten(), pos.flatten(), rng.Stream.DRAFT_DRAW)

    fresh = keys(rng.forest_position(roots, depths))
    assert torch.unique(fresh).numel() == fresh.numel()
    assert rng.forest_position(7, 3) == int(rng.forest_position(torch.tensor(7), torch.tensor(3)))
    old = keys(roots + depths)
    assert fresh.numel() - torch.unique(old).numel() > fresh.numel() // 2  # the planted keying repeats

# ---- the far tail ----------------------------------------------------------------------------------------------
# A token of probability p wins a Gumbel-max draw against a competitor of mass ~1 only when its own noise exceeds
# about -log p (18.4 at p = 1e-8). So the law of the noise's upper tail, P(g > t) = 1 - exp(-e**-t), is what tokens
# of probability ~e**-t need; 23-bit uniforms have none of it above CAP23 = 16.64.

def _exceed_53(t: float) -> float:
    """P(g > t) for the 53-bit transform, exactly: g grows with u = (2n + 1) 2**-53, so {g > t} is {n >= n0}; n0 is
    found by bisection through rng.gumbel_of_ itself (float64 logs, float32 noise)."""
    def g(n: int) -> float:
        return float(rng.gumbel_of_(torch.tensor([(2 * n + 1) * 2.0**-53], dtype=torch.float64))[0])

    lo, hi = 0, (1 << 52) - 1  # g(hi) > t for t < 36.7
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if g(mid) <= t else (lo, mid)
    return ((1 << 52) - lo) / 2.0**52


def _exceed_23(t: float) -> float:
    """P(g > t) for the 23-bit transform, exactly (2**23 cells, noise as rng.gumbel_of_ computes it)."""
    u = (torch.arange(1 << 23, dtype=torch.float64) + 0.5) * 2.0**-23
    return float((rng.gumbel_of_(u) > t).double().mean())


@pytest.mark.parametrize("t", [2.0, 10.0, CAP23 + 0.01, 18.42, 25.0])
def test_noise_tail_law_is_exact(t):
    """The exact tail law of the noise transform (no sampling): P(g > t) within 1e-4 relative of the Gumbel law at
    t up to 25 (P = 1.4e-11; the 2**-52 grid and the float32 rounding of g add up to 2e-5 there). The planted 23-bit
    transform has P(g > t) = 0 above 16.64, where the law is 5.9e-8 (t = 16.65) and 1.0e-8 (t = 18.42)."""
    want = -math.expm1(-math.exp(-t))
    got = _exceed_53(t)
    assert abs(got / want - 1) < 1e-4, (t, got, want)
    if t > CAP23:
        assert _exceed_23(t) == 0.0


def test_noise_reaches_the_tail_in_the_samplers_noise():
    """The samplers' noise (rng.uniform's bits and transform, then rng.gumbel_of_; rng.gumbel is the same numbers:
    test_gumbel_pieces_are_the_whole) over 2**28 draws from 1,024 fixed keys: the count above t = CAP23 + 0.01 = 16.65
    is Poisson with mean 2**28 * 5.88e-8 = 15.8. Accepted: 1 <= count <= 45 (P(0) = 1.4e-7, P(> 45) ~ 1e-9). The
    planted 23-bit noise of the same bits counts 0 and is rejected (as it always is, whatever the keys)."""
    keys = rng.request_key(torch.arange(1024, dtype=torch.int64) * 7 + 3, torch.full((1024,), 4242), rng.Stream.DIRECT)
    idx = torch.arange(1 << 18)[None, :]
    count = count23 = 0
    for k in keys.split(1):
        bits = rng._bits(k[:, None], idx)
        count23 += int((_noise23(bits) > CAP23 + 0.01).sum())
        count += int((rng.gumbel_of_(rng.uniform_of_(bits)) > CAP23 + 0.01).sum())
    assert 1 <= count <= 45, count
    assert count23 == 0
