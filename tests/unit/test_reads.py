"""``engine/reads.py``: a step's host reads, one copy per round for all its kinds of work.

* :func:`reads.fetch` gives back every tensor exactly (bit for bit, every dtype, shape, non-contiguous and empty
  ones), with one device-to-host copy for all of them (counted by the simulated device);
* :func:`reads.gather` runs readers side by side: as many rounds (yields) as the reader with the most reads, each
  reader sent exactly its own tensors' copies, the results those of running each alone; ``MERGE = False`` runs
  them one after the other (a round per read) with the same results.
"""
from __future__ import annotations

import pytest
import torch

import sim_device
from vllm_dsbd.engine import reads

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh


def _tensors():
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 5, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = float("nan"), float("inf"), -float("inf")
    return [
        f32,
        torch.randn(4, generator=g, dtype=torch.float64),
        torch.randint(-2**62, 2**62, (2, 3), generator=g, dtype=torch.int64),  # beyond float64's exact integers
        torch.randint(0, 2, (7,), generator=g).bool(),
        torch.randint(-100, 100, (3,), generator=g, dtype=torch.int32),
        torch.randn(2, 2, generator=g).to(torch.bfloat16),
        torch.tensor(3, dtype=torch.int64),  # 0-d
        torch.zeros(0, 4),  # empty
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def test_fetch_is_exact_for_every_dtype_and_shape():
    ts = _tensors()
    got = reads.fetch(ts)
    assert len(got) == len(ts)
    for a, b in zip(ts, got):
        assert _same_bits(a, b), (a, b)
    # a planted error (one byte) would show
    bad = ts[2].clone()
    bad[0, 0] += 1
    assert not _same_bits(bad, got[2])


def test_fetch_copies_once_for_all_tensors():
    ts = [sim_device.tag(t.clone()) for t in _tensors()]
    mode = sim_device.SimulatedDevice()
    with mode:
        got = reads.fetch(ts)
    assert sum(mode.syncs.values()) == 1, mode.syncs
    assert mode.mismatches == []
    assert not any(sim_device.on_device(t) for t in got)
    assert all(_same_bits(a, b) for a, b in zip(ts, got))


def _reader(name: str, values: list[list[torch.Tensor]], log: list):
    """Reads ``values`` round after round; checks it is sent its own tensors; returns the sums it read."""
    total = []
    for k, ask in enumerate(values):
        host = yield ask
        log.append((name, k))
        assert len(host) == len(ask) and all(torch.equal(h, a) for h, a in zip(host, ask)), (name, k)
        total.append(sum(float(h.double().sum()) for h in host))
    return name, total


def _plan():
    a = [[torch.tensor([1.0, 2.0])], [torch.tensor([3]), torch.tensor([True, False])], [torch.ones(2, 2)]]
    b = [[torch.tensor([10, 20])]]
    c: list = []  # reads nothing
    return a, b, c


@pytest.mark.parametrize("merge", [True, False])
def test_gather_runs_readers_side_by_side(merge, monkeypatch):
    monkeypatch.setattr(reads, "MERGE", merge)
    a, b, c = _plan()
    rounds = []
    real_fetch = reads.fetch

    def counting_fetch(tensors):
        rounds.append(len(tensors))
        return real_fetch(tensors)

    monkeypatch.setattr(reads, "fetch", counting_fetch)
    log: list = []
    out = reads.run(reads.gather(_reader("a", a, log), None, _reader("b", b, log), _reader("c", c, log)))
    alone = [reads.run(_reader(n, v, [])) for n, v in (("a", a), ("b", b), ("c", c))]
    assert out == [alone[0], None, alone[1], alone[2]]
    if merge:
        # round 1: a's first read and b's only read together; then a's two others
        assert rounds[: 3] == [2, 2, 1], rounds
    else:
        assert rounds[: 4] == [1, 2, 1, 1], rounds
    assert sorted(log) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]


def test_gather_of_nothing_reads_nothing():
    g = reads.gather(None, None)
    with pytest.raises(StopIteration) as stop:
        next(g)
    assert stop.value.value == [None, None]
