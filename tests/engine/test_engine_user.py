"""What a user meets on a DSBD engine: its start-up line, the counters, beam requests' refusals. Real vLLM 0.26.0
on CPU, one DSBD engine (the tiny random Llama pair, width 4, depth 3, pinned draft shape). Checked:

* the start-up line: the runner's ``DSBD engine: ...`` record says the depth, the width, the forest nodes verified
  per target pass, the mode and what it means, and where vLLM's ``num_spec_tokens=63`` comes from (the leaves of a
  beam request of ``max_beam_width`` 64 beams, more than a full forest step's 15; the config vLLM built has 63);
* vLLM's spec-decode counters count plain requests only: plain requests batched with a beam request move
  ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` / ``_accepted_tokens_per_pos``
  by exactly DSBD's plain counts (``vllm:dsbd_iterations``, ``vllm:dsbd_draft_nodes``, the ``vllm:dsbd_layers_passed``
  histogram); a beam search alone (W = 4, 16 tokens, EOS ignored: 16 beam steps) moves them by 0 and moves
  ``vllm:dsbd_beam_steps`` by 16 and ``vllm:dsbd_beam_target_passes`` by 16 - layers passed;
* a ``dsbd_beam`` request with ``stop``, ``stop_token_ids`` or ``logprobs`` is a ``ValueError`` naming the parameter
  (never ignored), and the engine keeps serving. ``LLM.beam_search``'s ``BeamSearchParams`` has no stop or logprobs
  setting to ignore;
* ``LLM.beam_search`` with ``ignore_eos`` (what ``vllm bench throughput``'s beam path sends) equals plain vLLM's on a
  prompt where vLLM's offline loop ranks an EOS candidate by its length-normalised score (``rank_by_score``): the
  DSBD engine's request ranked by cumulative log-probability (vLLM's server loop's rule, ``rank_by_score`` off) gives
  other beams there, so the prompt tells the two rules apart; every returned beam's logprobs carry, per token, the 2W
  candidates vLLM's loop saw there (tokens, ranks, log-probabilities), as plain vLLM's.
"""
from __future__ import annotations

import logging

import pytest

from engine_utils import LogRecords, dsbd_llm, metric, tiny_pair  # the CPU engine environment first
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)
from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402

from vllm_dsbd.patches.beam_search_route import beam_request_params  # noqa: E402

WIDTH, DEPTH = 4, 3
STEPS = 16  # beam steps of the beam search (max_tokens, EOS ignored)
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [83, 60, 71, 9, 14]]
# vllm bench throughput's random dataset, prompt 7 (seed 0, 16 tokens): vLLM's offline loop keeps an EOS candidate
# ranked below where its cumulative log-probability would put it
EOS_RANK_PROMPT = [1, *range(17, 32)]
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
DSBD = ("vllm:dsbd_iterations", "vllm:dsbd_draft_nodes", "vllm:dsbd_beam_steps", "vllm:dsbd_beam_target_passes",
        "vllm:dsbd_beam_layers_passed", "vllm:dsbd_beam_requests")


def _counts(llm) -> dict:
    out = {name: metric(llm, name) or 0 for name in SPEC + DSBD}
    per_pos = metric(llm, "vllm:spec_decode_num_accepted_tokens_per_pos")
    out["per_pos"] = list(per_pos.values) if per_pos is not None else [0] * DEPTH
    hist = metric(llm, "vllm:dsbd_layers_passed")
    out["layers_sum"] = hist.sum if hist is not None else 0
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k])
            for k, v in after.items()}


@pytest.fixture(scope="module")
def run():
    target, draft = tiny_pair()
    records = LogRecords()
    log = logging.getLogger("vllm.vllm_dsbd.engine")
    log.addHandler(records)
    try:
        with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens":
                                                  DEPTH, "width": WIDTH, "verify_budget": None}) as llm:
            log.removeHandler(records)
            out = {"log": records.messages,
                   "num_spec_tokens": llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens}
            cfg = llm.llm_engine.vllm_config
            eos = llm.get_tokenizer().eos_token_id
            bp = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True)
            beam_sp = beam_request_params(bp, eos, len(PROMPTS[0]), cfg.model_config.max_model_len, WIDTH,
                                          temperature=0.0)
            # plain requests (T = 0 and a seeded T = 1) with a beam request in the same batch
            c0 = _counts(llm)
            plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                     SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)]
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [plain[0], beam_sp, plain[1]],
                                use_tqdm=False)
            out["mixed"] = _delta(_counts(llm), c0)
            out["mixed_beams"] = len(outs[1].kv_transfer_params["dsbd_beam"])
            # a beam search alone
            c1 = _counts(llm)
            res = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], bp)
            out["beam"] = _delta(_counts(llm), c1)
            out["beam_lens"] = [len(s.tokens) - len(PROMPTS[0]) for s in res[0].sequences]
            # the dsbd_beam route: stop conditions on its SamplingParams and logprobs above 2W refused, never ignored
            out["refused"] = {}
            for name, value in (("stop", ["\n"]), ("stop_token_ids", [7]), ("logprobs", 2 * WIDTH + 1)):
                sp = beam_request_params(bp, eos, len(PROMPTS[0]), cfg.model_config.max_model_len, WIDTH)
                setattr(sp, name, value)
                try:
                    llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
                    out["refused"][name] = None
                except ValueError as err:
                    out["refused"][name] = str(err)
            out["after"] = llm.generate([{"prompt_token_ids": PROMPTS[1]}], plain[0], use_tqdm=False)[0]
            # ignore_eos: LLM.beam_search ranks as vLLM's offline loop; the server loop's rule for comparison
            res = llm.beam_search([{"prompt_token_ids": EOS_RANK_PROMPT}], bp)[0]
            out["eos_rank"], out["alternatives"] = _beams(res), _alternatives(res)
            sp = beam_request_params(bp, eos, len(EOS_RANK_PROMPT), cfg.model_config.max_model_len, WIDTH,
                                     temperature=0.0, rank_by_score=False)
            by_cum = llm.generate([{"prompt_token_ids": EOS_RANK_PROMPT}], sp, use_tqdm=False)[0]
            out["eos_rank_by_cum"] = [(b["token_ids"], b["cum_logprob"])
                                      for b in by_cum.kv_transfer_params["dsbd_beam"]]
    finally:
        log.removeHandler(records)
    return out


def _beams(out) -> list[tuple[list[int], float]]:
    return [(list(q.tokens[len(EOS_RANK_PROMPT):]), q.cum_logprob) for q in out.sequences]


def _alternatives(out) -> list[list[dict]]:
    """Per beam, per token: {token: (rank, log-probability)} of the candidates the beam search saw there."""
    return [[{t: (lp.rank, lp.logprob) for t, lp in d.items()} for d in q.logprobs] for q in out.sequences]


@pytest.fixture(scope="module")
def plain_eos_rank(run):  # after the DSBD engine is shut down: one engine at a time
    target, _ = tiny_pair()
    with dsbd_llm(target) as llm:
        bp = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True)
        res = llm.beam_search([{"prompt_token_ids": EOS_RANK_PROMPT}], bp)[0]
        return _beams(res), llm.get_tokenizer().eos_token_id, _alternatives(res)


def test_startup_line_says_what_was_set_and_means(run):
    lines = [m for m in run["log"] if m.startswith("DSBD engine: ")]
    assert len(lines) == 1, run["log"]
    line = lines[0]
    print(line)
    assert run["num_spec_tokens"] == max(WIDTH * DEPTH + WIDTH - 1, 64 - 1) == 63  # the 64-beam request's leaves
    for part in (f"draft depth {DEPTH} (num_speculative_tokens / --spec-tokens as given)",
                 f"width {WIDTH} (draft nodes per depth)", f"up to {WIDTH * DEPTH} forest nodes verified per target "
                 f"pass", f"up to {DEPTH + 1} tokens emitted per pass", "mode sample: every request is sampled "
                 "exactly from the target", "'dynamic_width' has no effect in this mode", "pinned",
                 "vLLM's num_spec_tokens=63 is the scheduler's slots per request, max_beam_width-1: the leaves of a "
                 "beam request of up to 64 beams (its forest in the slots left), more than a full forest step's 15"):
        assert part in line, (part, line)


def test_spec_decode_counters_count_plain_requests_only(run):
    m = run["mixed"]
    print("plain + beam batch:", m)
    assert run["mixed_beams"] == WIDTH
    assert m["vllm:dsbd_beam_requests"] == 1 and m["vllm:dsbd_beam_steps"] == STEPS
    assert m["vllm:spec_decode_num_drafts"] == m["vllm:dsbd_iterations"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == m["vllm:dsbd_draft_nodes"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["layers_sum"]
    assert len(m["per_pos"]) == DEPTH and m["per_pos"][0] <= m["vllm:spec_decode_num_drafts"]
    assert sum(m["per_pos"]) == m["vllm:spec_decode_num_accepted_tokens"]


def test_beam_search_alone_moves_only_beam_counters(run):
    b = run["beam"]
    print("beam search alone:", b)
    assert run["beam_lens"] == [STEPS] * WIDTH
    assert b["vllm:dsbd_beam_requests"] == 1
    assert b["vllm:dsbd_beam_steps"] == STEPS
    assert b["vllm:dsbd_beam_target_passes"] == STEPS - b["vllm:dsbd_beam_layers_passed"]
    for name in SPEC + ("vllm:dsbd_iterations", "vllm:dsbd_draft_nodes", "layers_sum"):
        assert b[name] == 0, (name, b)
    assert b["per_pos"] == [0] * DEPTH


def test_beam_request_stop_and_logprobs_refused(run):
    assert run["refused"]["stop"].startswith("stop: not supported on a beam request"), run["refused"]
    assert run["refused"]["stop_token_ids"].startswith("stop_token_ids: not supported on a beam request")
    assert run["refused"]["logprobs"].startswith(f"logprobs: a beam request of width {WIDTH} returns at most "
                                                 f"{2 * WIDTH}"), run["refused"]
    assert len(run["after"].outputs[0].token_ids) == 24  # the engine keeps serving
    fields = set(BeamSearchParams.__struct_fields__)
    assert not fields & {"stop", "stop_token_ids", "logprobs", "top_logprobs"}, fields


def test_beam_search_with_ignore_eos_ranks_as_vllm(run, plain_eos_rank):
    expected, eos, _ = plain_eos_rank
    got = run["eos_rank"]
    print("vLLM:", expected, "\nDSBD:", got, "\nby cumulative log-probability:", run["eos_rank_by_cum"])
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, expected))
    # the prompt tells the rules apart: ranked by cumulative log-probability, EOS tokens stay on the beams
    assert [t for t, _ in run["eos_rank_by_cum"]] != [t for t, _ in expected]
    assert any(eos in t for t, _ in run["eos_rank_by_cum"])


def test_beam_search_logprobs_carry_the_alternatives_as_vllm(run, plain_eos_rank):
    """Every returned beam's logprobs: at each token the 2W candidates vLLM's loop saw there (tokens, ranks 1..2W,
    log-probabilities to 1e-4), not the chosen token alone."""
    expected, got = plain_eos_rank[2], run["alternatives"]
    assert len(got) == len(expected) == WIDTH
    for beam_got, beam_exp in zip(got, expected):
        assert len(beam_got) == len(beam_exp) == STEPS
        for pos_got, pos_exp in zip(beam_got, beam_exp):
            assert len(pos_exp) == 2 * WIDTH and set(pos_got) == set(pos_exp), (pos_got, pos_exp)
            for t, (rank, lp) in pos_exp.items():
                assert pos_got[t][0] == rank and abs(pos_got[t][1] - lp) < 1e-4, (t, pos_got[t], rank, lp)
