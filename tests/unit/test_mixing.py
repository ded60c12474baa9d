"""``engine/mixing.py``: the mixed rows are the log of the 0.5/0.5 mixture of the draft's softmax and the sources'
(computed here independently, in float64), rows without candidates the draft's log-softmax; a planted mixture that
leaves the sources' estimates unnormalised is not what ``mix`` gives; a node's context through a beam trie and a forest
is its path's last tokens."""
import math
from types import SimpleNamespace

import torch

from vllm_dsbd.engine import mixing


def _reference(logits: torch.Tensor, props, lam=mixing.LAMBDA, normalise=True) -> torch.Tensor:
    out = []
    for row, p in zip(logits.double(), props):
        q = torch.softmax(row, -1)
        if p:
            s = torch.zeros_like(q)
            for t, v in p.items():
                s[t] = math.exp(v)
            q = (1 - lam) * q + lam * (s / s.sum() if normalise else s)
        out.append(torch.log(q))
    return torch.stack(out)


def test_mix_is_the_mixture():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 37, generator=g) * 3
    props = [None, {3: -0.1, 30: -2.0}, {}, {36: -5.0}, {0: -0.7, 1: -0.7, 2: -9.0, 99: -1.0}]  # 99: outside V
    got = mixing.mix(logits, props).double()
    torch.testing.assert_close(got, _reference(logits, [{t: v for t, v in (p or {}).items() if t < 37} for p in props]),
                               atol=1e-5, rtol=0)
    assert torch.allclose(got.exp().sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-5)
    bad = _reference(logits, [{t: v for t, v in (p or {}).items() if t < 37} for p in props], normalise=False)
    assert (got - bad).abs().max() > 0.05  # the unnormalised variant is another law


def test_mix_keeps_a_head_row_outside_its_vocabulary():
    logits = torch.full((1, 10), -math.inf)
    logits[0, :4] = torch.tensor([1.0, 0.0, -1.0, 2.0])  # a head's row: -inf outside its draft vocabulary
    got = mixing.mix(logits, [{7: -0.5}])
    assert torch.isfinite(got[0, 7]) and abs(got[0, 7].exp().item() - mixing.LAMBDA) < 1e-6
    assert torch.isinf(got[0, 8])


def test_text_tail_follows_forest_then_trie_then_linear():
    # trie: node 0 (token 10, parent -1), node 1 (token 11, parent 0); forest nodes 2 (token 20, parent 1) and
    # 3 (token 21, parent 2); linear context ... 7, 8, 9
    beam = SimpleNamespace(tokens=[10, 11], parents=[-1, 0])
    linear = [5, 6, 7, 8, 9]
    assert mixing.text_tail(beam, linear, [20, 21], [1, 2], 3, n=4) == [10, 11, 20, 21]
    assert mixing.text_tail(beam, linear, [20, 21], [1, 2], 3, n=6) == [8, 9, 10, 11, 20, 21]
    assert mixing.text_tail(beam, linear, [20, 21], [1, 2], 1, n=3) == [9, 10, 11]
    assert mixing.text_tail(beam, linear, [20, 21], [1, 2], 3, n=2) == [20, 21]
    assert mixing.beam_tail(beam, [8, 9], 1, 6) == [8, 9, 10, 11]  # a linear tail shorter than asked: all of it


def test_plain_tail_indexes_new_text_only():
    from vllm_dsbd.core.sources import SourceIndex

    import numpy as np

    src = SourceIndex(recycle=False, lookup=True)
    ids = np.array([1, 2, 3, 4, 1, 2, 0, 0])
    assert mixing.plain_tail(src, ids, 6, [3]) == [4, 1, 2, 3]
    assert src.indexed == 7 and src.propose([1, 2]) and 3 in src.propose([1, 2])
    ref = SourceIndex(recycle=False, lookup=True)
    ref.index_text([1, 2, 3, 4, 1, 2, 3, 9])
    ids2 = np.array([1, 2, 3, 4, 1, 2, 3, 0])
    mixing.plain_tail(src, ids2, 7, [9])  # the next step: one more token
    for ctx in ([3], [2, 3], [1, 2, 3], [4, 1, 2, 3]):
        assert src.propose(ctx).keys() == ref.propose(ctx).keys(), ctx
