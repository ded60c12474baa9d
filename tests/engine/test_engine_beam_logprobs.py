"""Per-token logprobs of beam requests (patches ``beam_outputs`` and ``beam_search_route``), real vLLM
0.26.0 on CPU.

Two engines on the tiny random Llama pair: plain vLLM, whose own ``LLM.beam_search`` loop (one-token requests with
``logprobs`` 2W) is the reference, then DSBD (width 4, depth 2: beams with draft forests). Checked, per prompt:

* ``LLM.beam_search`` on DSBD: every sequence's tokens and per-token logprob dicts (token ids, ranks, values to 1e-4)
  equal vLLM's loop's;
* a ``dsbd_beam`` request (``rank_by_score``, the ranking of ``LLM.beam_search``) with ``logprobs`` k = 3 and 2W: its
  output is vLLM's best sequence, and per token its logprobs are the chosen token (its rank and value in vLLM's dict)
  and the k best of vLLM's dict (ranks 1..k), vLLM's sampler shape; ``cumulative_logprob`` the best beam's;
* refused with a message naming ``logprobs``: above 2W, above 0 at temperature > 0, streamed (DELTA).
"""
from __future__ import annotations

import pytest

from engine_utils import dsbd_llm, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)
from vllm.sampling_params import BeamSearchParams, RequestOutputKind  # noqa: E402

from vllm_dsbd.config import DSBDConfig  # noqa: E402
from vllm_dsbd.requests import BeamParams, check_request  # noqa: E402

WIDTH, DEPTH, STEPS = 4, 2, 6
PROMPTS = [[5, 6, 7, 8], [83, 60, 71, 9, 14]]


def _seqs(outs):
    return [[(s.tokens, s.cum_logprob, [{t: (lp.rank, lp.logprob) for t, lp in d.items()} for d in s.logprobs])
             for s in o.sequences] for o in outs]


@pytest.fixture(scope="module")
def run():
    target, draft = tiny_pair()
    bsp = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with dsbd_llm(target, speculative_config=None, max_logprobs=2 * WIDTH) as llm:
        plain = _seqs(llm.beam_search(prompts, bsp))
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH}
    with dsbd_llm(target, speculative_config=spec, max_logprobs=2 * WIDTH + 1) as llm:
        tok = llm.get_tokenizer()
        eos = tok.eos_token_id

        def beam(prompt, logprobs=None, temperature=0.0, **extra):
            bp = {"width": WIDTH, "max_tokens": STEPS, "eos_token_id": eos, "rank_by_score": True, **extra}
            sp = vllm.SamplingParams(temperature=temperature, max_tokens=BeamParams.parse(bp, WIDTH).engine_tokens(),
                                     logprobs=logprobs, extra_args={"dsbd_beam": bp})
            (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            return o

        out = {"dsbd": _seqs(llm.beam_search(prompts, bsp)), "lp": {}}
        for k in (3, 2 * WIDTH):
            out["lp"][k] = [beam(p, logprobs=k).outputs[0] for p in PROMPTS]
        bad = []
        for kw in ({"logprobs": 2 * WIDTH + 1}, {"logprobs": 1, "temperature": 0.5}):
            with pytest.raises(ValueError) as e:
                beam(PROMPTS[0], **kw)
            bad.append(str(e.value))
        bp = {"width": WIDTH, "max_tokens": STEPS, "eos_token_id": eos}
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=BeamParams.parse(bp, WIDTH).engine_tokens(), logprobs=1,
                                 output_kind=RequestOutputKind.DELTA, extra_args={"dsbd_beam": bp})
        with pytest.raises(ValueError) as e:  # LLM.generate streams nothing: the server's stream is DELTA
            check_request(sp, DSBDConfig.from_vllm_config(llm.llm_engine.vllm_config))
        bad.append(str(e.value))
        out["bad"] = bad
    return plain, out


def _close_dicts(got, want):
    assert [list(d) for d in got] == [list(d) for d in want]
    for g, w in zip(got, want):
        for t in w:
            assert g[t][0] == w[t][0] and abs(g[t][1] - w[t][1]) < 1e-4, (t, g[t], w[t])


def test_beam_search_logprobs_equal_vllm_loop(run):
    plain, out = run
    for got, want in zip(out["dsbd"], plain):
        assert [s[0] for s in got] == [s[0] for s in want]
        for (_, gc, gd), (_, wc, wd) in zip(got, want):
            assert abs(gc - wc) < 1e-4
            _close_dicts(gd, wd)


@pytest.mark.parametrize("k", [3, 2 * WIDTH])
def test_dsbd_beam_logprobs_are_vllm_shape(run, k):
    plain, out = run
    for c, want, prompt in zip(out["lp"][k], plain, PROMPTS):
        tokens, cum, dicts = want[0]
        assert list(c.token_ids) == tokens[len(prompt):]
        assert abs(c.cumulative_logprob - cum) < 1e-4
        assert len(c.logprobs) == len(c.token_ids)
        for t, d, w in zip(c.token_ids, c.logprobs, dicts):
            expect = {t: w[t], **{i: v for i, v in w.items() if v[0] <= k}}
            assert list(d) == list(expect), (d, expect)
            for i, lp in d.items():
                assert lp.rank == expect[i][0] and abs(lp.logprob - expect[i][1]) < 1e-4
            assert all(lp.decoded_token is not None for lp in d.values())


def test_logprobs_refusals(run):
    above, sampled, delta = run[1]["bad"]
    assert above.startswith("logprobs:") and f"at most {2 * WIDTH}" in above
    assert sampled.startswith("logprobs:") and "temperature > 0" in sampled
    assert delta.startswith("logprobs:") and "DELTA" in delta
