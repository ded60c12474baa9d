"""``core.verify_static.verify_layer_static`` against ``core.verify.verify_layer``: the same outputs, equal tensors, on
the exactness tests' layers (many rows at once, random per-row K and draft prefixes, rows without drafts, K = 0 rows,
a column without any draft) and one row at a time on long joints (a beam request's layer: bit for bit, the claim the
engine relies on); and it reads nothing on the host (simulated device: no synchronisation, no host tensor mixed in).
The exactness of ``verify_layer`` itself is ``test_verify_layer.py``'s chi-square tests; equal outputs carry it over."""
from __future__ import annotations

import pytest
import torch

import sim_device
from test_verify_layer import CASES, draft_draws
from vllm_dsbd.core.verify import verify_layer
from vllm_dsbd.core.verify_static import verify_layer_static

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh


def _compare(logp, drafts, valid, logq, k, seed, pos, extra: int = 0):
    ref_idx, ref_ok = verify_layer(logp, drafts, valid, logq, k, seed, pos)
    kmax = int(k.max()) + extra
    idx, ok = verify_layer_static(logp, drafts, valid, logq, k, seed, pos, kmax)
    w = ref_idx.shape[1]
    assert idx.shape[1] == max(kmax, 1) and not bool(ok[:, w:].any())
    assert torch.equal(ok[:, :w], ref_ok)
    assert torch.equal(torch.where(ref_ok, idx[:, :w], -1), torch.where(ref_ok, ref_idx, -1))
    return ref_idx, ref_ok


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("extra", [0, 2])
def test_equals_verify_layer_on_the_exactness_cases(case, extra):
    p, q, m, k = CASES[case]
    n = 4000
    g = torch.Generator().manual_seed(5)
    drafts = draft_draws(q, m, n, seed=11)
    # per row: how many drafts exist (a prefix, 0..m) and how many outputs are wanted (0..k)
    valid = torch.arange(m)[None, :] < torch.randint(0, m + 1, (n, 1), generator=g)
    valid[:, -1] &= False if m > 1 else True  # the last draft column has no draft at all when m > 1
    kk = torch.randint(0, k + 1, (n,), generator=g)
    logp = torch.log(p.float()).expand(n, -1).contiguous()
    logq = torch.log(q.float()).expand(n, -1).contiguous()
    idx, ok = _compare(logp, drafts, valid, logq, kk, torch.arange(n) + 3, torch.full((n,), 9), extra)
    assert int(ok.sum()) == int(kk.sum())  # every row got its K outputs (the comparison is not vacuous)
    accepted = (idx[:, :1] == torch.where(valid, drafts, -1)).any(1) & ok[:, 0]
    assert 0.2 < float(accepted.float().mean()) < 0.95  # drafts are accepted and rejected


@pytest.mark.parametrize("seed", range(12))
def test_one_row_on_a_long_joint_is_bit_for_bit(seed):
    """A beam request's layer: one row, W = 4 parents x V = 3000 tokens, its W drafts drawn from Q, K = W (or fewer
    when the dynamic width says so); T and Q from random logits, sharp or flat."""
    g = torch.Generator().manual_seed(seed)
    W, V = 4, 3000
    scale = 1.0 + 4.0 * (seed % 3)
    logp = torch.log_softmax(scale * torch.randn(1, W * V, generator=g), -1)
    # Q near P (accepting) or independent (rejecting), by seed
    noise = torch.randn(1, W * V, generator=g)
    logq = torch.log_softmax(scale * (noise if seed % 2 else torch.randn(1, W * V, generator=g) * 0.1 + logp), -1)
    drafts = torch.multinomial(logq.exp()[0].double(), W, replacement=False, generator=g)[None]
    k = torch.tensor([W - seed % 3])
    _compare(logp, drafts, torch.ones(1, W, dtype=torch.bool), logq, k, torch.tensor([seed]), torch.tensor([40]))
    idx, ok = verify_layer(logp, drafts, torch.ones(1, W, dtype=torch.bool), logq, k, torch.tensor([seed]),
                           torch.tensor([40]))
    sidx, sok = verify_layer_static(logp, drafts, torch.ones(1, W, dtype=torch.bool), logq, k, torch.tensor([seed]),
                                    torch.tensor([40]), W)
    assert torch.equal(sidx[:, : idx.shape[1]], idx) and torch.equal(sok[:, : ok.shape[1]], ok)


def test_reads_nothing_on_the_host():
    p, q, m, k = CASES["random"]
    n = 64
    drafts = draft_draws(q, m, n, seed=3)
    args = [torch.log(p.float()).expand(n, -1).contiguous(), drafts, torch.ones(n, m, dtype=torch.bool),
            torch.log(q.float()).expand(n, -1).contiguous(), torch.full((n,), k), torch.arange(n),
            torch.full((n,), 2)]
    mode = sim_device.SimulatedDevice()
    with mode:
        idx, ok = verify_layer_static(*sim_device.tag(args), kmax=k)
    assert sim_device.on_device(idx) and sim_device.on_device(ok)
    assert mode.mismatches == [] and sum(mode.syncs.values()) == 0, (mode.mismatches[:3], mode.syncs)
    ref = sim_device.SimulatedDevice()  # the same check sees verify_layer's reads (it is not vacuous)
    with ref:
        verify_layer(*sim_device.tag(args))
    assert sum(ref.syncs.values()) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (check.sh runs it)")
@pytest.mark.parametrize("case", list(CASES))
def test_equals_verify_layer_on_cuda(case):
    p, q, m, k = CASES[case]
    n = 4000
    drafts = draft_draws(q, m, n, seed=11)
    args = [torch.log(p.float()).expand(n, -1).contiguous(), drafts, torch.ones(n, m, dtype=torch.bool),
            torch.log(q.float()).expand(n, -1).contiguous(), torch.full((n,), k), torch.arange(n) + 3,
            torch.full((n,), 9)]
    _compare(*[a.cuda() for a in args], extra=1)
