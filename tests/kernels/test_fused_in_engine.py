"""The fused verification kernel where the engine's static paths use it on CUDA (``engine/fused.py``): the same
results as the torch layer, through the engine's own entry points. On CPU the kernel runs under Triton's
interpreter (``conftest.py`` sets it), forced with ``fused=True``; on a GPU compiled (``check.sh``'s kernel_tests).

* ``sampler.verify`` on the static forest path (plain requests, mode "sample", widths 2-4): every RowResult field
  equal with and without the kernel on random steps (T = 0 rows included: the kernel skips them, beam_step makes
  them), and the kernel really ran;
* ``beam_sampling.verify`` (beam requests, T > 0): the same outputs and widths on random layers of several requests
  with different beam counts, draft counts, top-k and the dynamic width;
* the setting: ``VLLM_DSBD_FUSED_VERIFY`` auto (on CUDA only) / 0, anything else refused.
The kernel's own equality with the torch core is ``test_kernel_verify.py``'s; the law is the core's tests'.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from test_verify_forest_static import _random_req, _to, build_wide_step
from vllm_dsbd.engine import fused, reads, sampler
from vllm_dsbd.engine.beams import sampling as beam_sampling
from vllm_dsbd.engine.beams.trie import BeamRequest, beam_params
from vllm_dsbd.requests import BeamParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel compiled on a GPU
pytestmark = [pytest.mark.gpu,  # also run compiled on a GPU by benchmarks/gpu/check.sh
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Triton's interpreter on numpy
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = Counter()
    real = fused.fused_layer

    def spy(*args):
        calls["kernel"] += 1
        return real(*args)

    monkeypatch.setattr(sampler, "fused_layer", spy)
    monkeypatch.setattr(beam_sampling, "fused_layer", spy)
    return calls


def test_static_forest_path_with_the_kernel_equals_the_torch_layer(kernel_calls, monkeypatch):
    rnd = random.Random(5)
    seen = Counter()
    general = sampler.verify_forest  # the row-subset path: a static step that declines would fall back to it
    monkeypatch.setattr(sampler, "verify_forest", lambda *a: seen.update(["declined"]) or general(*a))
    for step in range(8):
        G, W, V = rnd.choice([(2, 2, 40), (3, 4, 24)])
        reqs = [_random_req(rnd, G, V) for _ in range(rnd.choice([1, 3, 6]))]
        logits, plans, cfg = build_wide_step(reqs, G, W, V, seed=step)
        logits, plans = logits.to(DEVICE), _to(plans, DEVICE)
        a = reads.run(sampler.verify(logits, plans, cfg, forest_static=True, fused=True))
        b = reads.run(sampler.verify(logits, plans, cfg, forest_static=True, fused=False))
        for x, y in zip(a, b):
            assert (x.tokens, x.path, x.passed, x.widths) == (y.tokens, y.path, y.passed, y.widths)
            seen["accepted layers"] += y.passed
    assert kernel_calls["kernel"] > 8 and seen["accepted layers"] > 0 and not seen["declined"], (kernel_calls, seen)


def _layers(rnd: random.Random, V: int):
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    reqs, layers = [], []
    for _ in range(4):
        W = rnd.choice([2, 3, 4])
        S = rnd.randint(1, W)
        req = BeamRequest(BeamParams(width=W, max_tokens=8, dynamic_width=rnd.random() < 0.5), 5, temperature=
                          rnd.choice([0.7, 1.0, 1.5]), seed=rnd.randrange(1000), top_k=rnd.choice([0, 0, 7]))
        logits = torch.randn(S, V, generator=g) * 3
        scores = [float(-rnd.random()) for _ in range(S)]
        if S > 1 and rnd.random() < 0.3:
            scores[-1] = float("-inf")  # a dead slot
        logq = torch.log_softmax(logits.flatten() + torch.randn(S * V, generator=g), -1)
        m = rnd.randint(0, W)
        drafts = torch.multinomial(logq.exp(), m, replacement=False, generator=g).tolist() if m else []
        layers.append(beam_sampling.Layer(logits=logits.to(DEVICE), scores=scores, drafts=drafts,
                                          logq=logq.to(DEVICE) if m else None, position=rnd.randrange(5, 50),
                                          dynamic=req.params.dynamic_width))
        reqs.append(req)
    return layers, beam_params(reqs, DEVICE)


def test_beam_layers_with_the_kernel_equal_the_torch_layer(kernel_calls):
    rnd = random.Random(11)
    seen = Counter()
    for _ in range(10):
        layers, params = _layers(rnd, 30)
        a, ka = reads.run(beam_sampling.verify(layers, params, fused=True))
        b, kb = reads.run(beam_sampling.verify(layers, params, fused=False))
        assert ka == kb
        for x, y, ly in zip(a, b, layers):
            assert [(p.beam, p.token, p.logprob, p.score) for p in x] == [(p.beam, p.token, p.logprob, p.score)
                                                                         for p in y]
            seen["drafts output"] += sum(p.beam * 30 + p.token in ly.drafts for p in y)
            seen["outputs"] += len(y)
    assert kernel_calls["kernel"] == 10 and 0 < seen["drafts output"] < seen["outputs"], seen


def test_fused_setting(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(fused.FUSED_ENV, raising=False)
    assert fused.fused_default(cuda) and not fused.fused_default(cpu)
    monkeypatch.setenv(fused.FUSED_ENV, "0")
    assert not fused.fused_default(cuda)
    monkeypatch.setenv(fused.FUSED_ENV, "maybe")
    with pytest.raises(ValueError, match="VLLM_DSBD_FUSED_VERIFY must be auto or 0, got 'maybe'"):
        fused.fused_default(cuda)

