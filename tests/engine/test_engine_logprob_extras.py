"""``prompt_logprobs`` and ``logprob_token_ids`` on a DSBD engine equal plain vLLM's (``engine/runner.py``
``_dsbd_logprobs``; vLLM's own runner computes prompt logprobs from the prompt rows).

Real vLLM 0.26.0 on CPU, float32, the tiny pair (a random 3-layer target, its first 2 layers as the draft), width 4,
depth 3, greedy. One batch of five prompts, at most 3 running, a 70-token prompt prefilled in chunks of 32 while the
others draft forests (so prompt rows and forest rows share steps): the prompt logprobs (top 3 and the prompt token,
with ranks), the output tokens, and the logprobs of 5 named ids (plus the emitted token, with its rank) at every output
position equal plain vLLM's; and a mixed batch (one request with ids, one with ``logprobs=2``) returns what plain vLLM
returns for both. At temperature 0.8 (seeded; DSBD's tokens differ from plain vLLM's there), the emitted tokens'
logprobs equal plain vLLM's prompt logprobs of the same text fed back as a prompt (a teacher-forced recomputation).
vLLM's spec counters show drafts made and accepted. A beam request with either is refused, naming it.
"""
from __future__ import annotations

import math

import pytest

from engine_utils import dsbd_llm, metric  # the CPU engine environment, before vllm
import vllm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

TOKENS = 12
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], list(range(100, 170)), [7], [250, 3, 77, 12, 9]]
IDS = [3, 17, 42, 99, 250]
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=32, enable_chunked_prefill=True)


def _prompt_lps(out) -> list[dict]:
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.prompt_logprobs[1:]]


def _lps(out) -> list[dict]:
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.outputs[0].logprobs]


def _run(llm) -> dict:
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = llm.generate(inputs, vllm.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True,
                                                      prompt_logprobs=3, logprob_token_ids=IDS), use_tqdm=False)
    mixed = llm.generate(inputs[:2], [
        vllm.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprob_token_ids=IDS),
        vllm.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)], use_tqdm=False)
    sampled = llm.generate(inputs[:2], [vllm.SamplingParams(temperature=0.8, max_tokens=TOKENS, ignore_eos=True,
                                                            seed=7 + i, logprobs=0) for i in range(2)],
                           use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in greedy],
            "prompt": [_prompt_lps(o) for o in greedy], "ids": [_lps(o) for o in greedy],
            "mixed": [_lps(o) for o in mixed],
            "sampled": [(PROMPTS[i] + list(o.outputs[0].token_ids), _lps(o)) for i, o in enumerate(sampled)]}


def _teacher_forced(llm, sampled) -> list[list[float]]:
    """Plain vLLM's log-probability of each sampled token, from its prompt logprobs over prompt + output."""
    outs = llm.generate([{"prompt_token_ids": seq} for seq, _ in sampled],
                        vllm.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[o.prompt_logprobs[k][seq[k]].logprob for k in range(len(seq) - TOKENS, len(seq))]
            for o, (seq, _) in zip(outs, sampled)]


@pytest.fixture(scope="module")
def dsbd(tiny_pair):
    with dsbd_llm(tiny_pair[0], **ENGINE,
                  speculative_config={"method": "dsbd", "model": str(tiny_pair[1]), "num_speculative_tokens": 3,
                                      "width": 4, "verify_budget": None}) as llm:
        out = _run(llm)
        out["spec"] = {k: metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")}
        with pytest.raises(ValueError, match=r"^prompt_logprobs, logprob_token_ids: not supported on a beam request"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], vllm.SamplingParams(
                temperature=0, max_tokens=100, ignore_eos=True, prompt_logprobs=1, logprob_token_ids=[3],
                extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}))
        return out


@pytest.fixture(scope="module")
def plain(tiny_pair, dsbd):  # after the DSBD engine: one engine at a time
    with dsbd_llm(tiny_pair[0], **ENGINE) as llm:
        out = _run(llm)
        out["forced"] = _teacher_forced(llm, dsbd["sampled"])
        return out


def _close(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[t][1] == y[t][1] and (x[t][0] == y[t][0] or abs(x[t][0] - y[t][0]) < 1e-4)
                                     for t in x) for x, y in zip(a, b))


def test_drafts_were_made(dsbd):
    spec = dsbd["spec"]
    print(f"draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_prompt_logprobs_equal_plain_vllm(plain, dsbd):
    assert dsbd["tokens"] == plain["tokens"]
    for i, (a, b) in enumerate(zip(dsbd["prompt"], plain["prompt"])):
        assert len(a) == len(PROMPTS[i]) - 1 and all(len(d) >= 3 for d in a)
        assert _close(a, b), i


def test_logprob_token_ids_equal_plain_vllm(plain, dsbd):
    for i, (a, b) in enumerate(zip(dsbd["ids"], plain["ids"])):
        assert len(a) == TOKENS and all(set(IDS) <= d.keys() for d in a)
        assert _close(a, b), i
    for i, (a, b) in enumerate(zip(dsbd["mixed"], plain["mixed"])):
        assert _close(a, b), ("mixed", i)


def test_sampled_logprobs_equal_teacher_forced(plain, dsbd):
    forced = plain["forced"]
    for (seq, lps), ref in zip(dsbd["sampled"], forced):
        got = [d[t][0] for d, t in zip(lps, seq[-TOKENS:])]
        assert all(math.isfinite(x) for x in got)
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-4, (got, ref)
