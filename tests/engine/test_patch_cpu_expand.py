"""Ledger patch 10 (``cpu_expand_kernel``) against the real vLLM 0.26.0 on CPU.

* The patched stand-in expands per-request temperature (float32), top-k (int32) and top-p to per-token values, with
  the greedy sentinel replaced, as ``rejection_sampler.expand_batch_to_tokens`` expects; vLLM's original stand-in
  leaves a float buffer unwritten (the bug, vllm#55005: if this assertion fails, vLLM fixed it and the patch can go).
* End to end: vLLM's own ``draft_model`` speculation with a sampling draft (``draft_sample_method="probabilistic"``)
  at temperature 1 with top-k 30 has the law of plain vLLM sampling over the first three tokens (two-sample
  chi-square, 600 seeded requests each, threshold at p = 1e-6; minimum detectable effect TV 0.28), and its drafts are
  made and accepted. Without the patch the target logits are divided by uninitialised memory and the law is far off
  (measured with ``VLLM_DSBD_DISABLE=1``).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_utils import dsbd_llm, metric, peaky_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import chisq  # noqa: E402
from vllm_dsbd import plugin  # noqa: E402

PROMPT = [5, 6, 7]
N_LAW, LAW_TOKENS, TOP_K = 600, 3, 30


def _cpu_tl():
    plugin.register()
    import vllm._custom_ops  # noqa: F401  (loads the C++ ops the original stand-in calls)
    import vllm.utils.cpu_triton_utils as cpu_tl

    return cpu_tl


@pytest.mark.parametrize("dtype,values,replace_from,replace_to", [
    (torch.float32, [0.5, 0.0, 1.5], 0, 1),  # temperature: greedy (GREEDY_TEMPERATURE = 0) becomes 1
    (torch.int32, [7, 30, 2], 0, 0),  # top-k
    (torch.float32, [0.9, 1.0, 0.25], 0, 0),  # top-p
])
def test_expand_writes_the_callers_buffer(dtype, values, replace_from, replace_to):
    from vllm.v1.sample import rejection_sampler as rs

    cpu_tl = _cpu_tl()
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    x = torch.tensor(values, dtype=dtype)
    want = torch.tensor([values[0]] * 2 + [values[1]] + [values[2]] * 3, dtype=dtype)
    want[want == replace_from] = replace_to
    out = torch.full((6,), -7, dtype=dtype)
    cpu_tl.expand_kernel[(3,)](out, x, cu, replace_from, replace_to, MAX_NUM_TOKENS=rs.MAX_SPEC_LEN)
    assert torch.equal(out, want)
    if dtype == torch.float32:
        from vllm_dsbd.patches._patching import original

        buggy = torch.full((6,), -7.0)
        original(cpu_tl, "expand_kernel")[(3,)](buggy, x, cu, replace_from, replace_to,
                                                MAX_NUM_TOKENS=rs.MAX_SPEC_LEN)
        assert torch.equal(buggy, torch.full((6,), -7.0)), "vLLM's CPU expand now writes its output: drop patch 10"


def test_expand_empty_batch():
    cpu_tl = _cpu_tl()
    out = torch.empty(0)
    cpu_tl.expand_kernel[(0,)](out, torch.empty(0), torch.empty(0, dtype=torch.int32), 0, 1, MAX_NUM_TOKENS=16)
    assert out.numel() == 0


@pytest.fixture(scope="module")
def laws():
    target, draft = peaky_pair()
    params = [vllm.SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=LAW_TOKENS, ignore_eos=True,
                                  seed=20_000 + i) for i in range(N_LAW)]
    out = {}
    for name, spec in (("plain", None),
                       ("draft_model", {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                                        "draft_sample_method": "probabilistic"})):
        with dsbd_llm(target, max_model_len=128, speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": PROMPT}] * N_LAW, params, use_tqdm=False)
            counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
            out[name] = (counts, metric(llm, "vllm:spec_decode_num_drafts"),
                         metric(llm, "vllm:spec_decode_num_accepted_tokens"))
    return out


@pytest.mark.slow
def test_draft_model_sampling_has_the_plain_law(laws):
    plain, _, _ = laws["plain"]
    spec, drafts, accepted = laws["draft_model"]
    assert drafts and drafts > 0 and accepted and accepted > 0, (drafts, accepted)
    stat, df, thr = chisq.two_sample(spec, plain)
    chisq.report(f"first {LAW_TOKENS} tokens, vLLM draft_model (probabilistic) vs plain, T=1 top-k {TOP_K}",
                 stat, df, thr, n=N_LAW, two_sample=True)
    assert df >= 3, "the law test has too few bins to mean anything"
    assert stat < thr
