"""core.rng: the documented formula, and distinct keys give unrelated numbers.

The hash before 2026-11-25, u(key, i) = F((key ^ i) * 0x01000193), gave keys k and k ^ d the same numbers at indices
i and i ^ d: for d below the index range one key's array is the other's, permuted. Each check below is run on a
planted copy of that formula (``_old_uniform``) and must reject it: 100% shared values, correlation 1 and a chi-square
in the millions on the (i, i ^ d) alignment. All keys are fixed, so the tests are deterministic; the thresholds sit
about 6 standard deviations out, where independent streams never reach.
"""
from __future__ import annotations

import pytest
import torch

from vllm_dsbd.core import rng

N = 4096  # indices per key (one uniform per index)
DIFFS = [1, 2, 3, 7, 100, 4095]  # key differences inside the index range
M32 = 0xFFFFFFFF

# 64 fixed keys as the engine makes them: request_key over seeds and positions
KEYS = rng.request_key(torch.arange(64, dtype=torch.int64) * 1_000_003, torch.arange(64, dtype=torch.int64) + 17,
                       rng.Stream.DRAFT_DRAW)

# thresholds: |r| * sqrt(n) is N(0, 1) for independent streams; chi-square of the 10 x 10 joint histogram against the
# uniform product (n / 100 a cell) has 99 degrees of freedom (mean 99, sd 14); P(chi2_99 > 200) ~ 1e-8
Z_MAX = 6.0
CHI2_MAX = 200.0


def _old_uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The planted variant: the hash before 2026-11-25, fmix32((key ^ index) * 0x01000193), same 23-bit uniforms."""
    h = rng._fmix32((((key ^ index) & M32) * 0x01000193) & M32)
    return ((h >> 9) & 0x7FFFFF).to(torch.float32).add_(0.5).mul_(2.0**-23)


def _py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


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


def _pairs(uniform, d: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """For the 64 fixed keys k and their partners k ^ d: u(k, i) beside u(k ^ d, i) and beside u(k ^ d, i ^ d)."""
    idx = torch.arange(N, dtype=torch.int64)[None, :]
    k1 = KEYS[:, None]
    k2 = k1 ^ d
    a = uniform(k1, idx)
    return [("i", a, uniform(k2, idx)), ("i^d", a, uniform(k2, idx ^ d))]


def _check_independent(uniform, d: int) -> list[str]:
    """The failures of the independence check for key difference d (empty: passes)."""
    bad = []
    for name, a, b in _pairs(uniform, d):
        z, chi = _independence(a, b)
        if z > Z_MAX or chi > CHI2_MAX:
            bad.append(f"d={d} alignment {name}: |r| sqrt(n)={z:.2f}, chi2={chi:.1f}")
    return bad


def test_uniform_is_the_documented_formula():
    """rng.uniform (int32 torch arithmetic) equals the docstring's formula in plain Python integers, bit for bit,
    over keys and indices at the edges of 32 bits (an index's low 32 bits are used)."""
    keys = [0, 1, 0x7FFFFFFF, 0x80000000, M32, 0x12345678, int(KEYS[0])]
    idx = [0, 1, 2, 4095, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**35 + 123]
    got = rng.uniform(torch.tensor(keys)[:, None], torch.tensor(idx)[None, :])
    for a, k in enumerate(keys):
        kk = _py_fmix32(k ^ 0x3C6EF372)
        for b, i in enumerate(idx):
            h = _py_fmix32(kk ^ _py_fmix32(((i & M32) * 0x01000193 + 0x6A09E667) & M32))
            want = ((h >> 9) + 0.5) * 2.0**-23
            assert float(got[a, b]) == want, (k, i)
    assert bool(((got > 0) & (got < 1)).all())


@pytest.mark.parametrize("d", DIFFS)
def test_keys_differing_in_low_bits_share_no_numbers(d):
    """Keys k and k ^ d: (almost) none of the 4,096 uniforms of one occur among the other's. Independent 23-bit
    arrays share about N / 2**23 = 0.05% by chance; the threshold is 1%. The old hash shares all of them."""
    for k in [int(KEYS[0]), int(KEYS[1]), 0, M32]:
        assert _shared_fraction(rng.uniform, k, k ^ d) < 0.01, (k, d)
        assert _shared_fraction(_old_uniform, k, k ^ d) == 1.0, (k, d)  # the planted variant: a permutation


@pytest.mark.parametrize("d", DIFFS)
def test_keys_differing_in_low_bits_are_independent(d):
    """64 fixed key pairs (k, k ^ d), 262,144 paired uniforms per alignment: u(k, i) beside u(k ^ d, i), and beside
    u(k ^ d, i ^ d) (the old hash's identity). Pearson |r| sqrt(n) < 6 and the 10 x 10 joint histogram's chi-square
    (99 df) < 200. The old hash fails the same check on the i ^ d alignment (r = 1, chi-square = 9 n: all on the
    diagonal)."""
    assert _check_independent(rng.uniform, d) == []
    old = _check_independent(_old_uniform, d)
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
