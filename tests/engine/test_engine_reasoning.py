"""Structured outputs under vLLM's reasoning gate (``--reasoning-parser``) on a DSBD engine equal plain vLLM's.

vLLM 0.26 with a reasoning parser (and ``enable_in_reasoning`` off) neither masks nor advances a structured request's
grammar until the reasoning end marker: the model thinks freely, emits ``</think>``, and the grammar starts with the
next token. DSBD's worker gates every forest row alike (``engine/grammar.py``, ``ReasoningGate``; patches
``reasoning_gate`` and ``grammar_forests``).

Model: the tiny random Llama pair (target 3 layers, draft its first 2) with two tokens of its tokenizer renamed
``<think>`` (399) and ``</think>`` (395, a token the target's greedy text emits now and then), weights unchanged; the
``deepseek_r1`` parser. Real vLLM 0.26.0 on CPU, float32, xgrammar without whitespace. Greedy (T = 0), DSBD width 4,
depth 3: every request's tokens equal plain vLLM's for choice, regex and JSON-schema constraints on prompts whose
reasoning ends after 2 and 5 free tokens, ends in the prompt (grammar from the first token), or is opened in the
prompt (``<think>``), in one batch; the outputs do think (free tokens, then ``</think>``, then text valid under the
constraint); and the batch drafted forests (vLLM's draft and accepted counters grow). Power: with the worker's grammar
acting from the first output token (the planted variant, DSBD before the gate), every request that thinks first gets
other tokens. Beam search with structured
outputs (``LLM.beam_search``: vLLM's loop applies the grammar from the first token, reasoning parser or not, and so
do DSBD's beams) equals vLLM's.
"""
from __future__ import annotations

import json
import re

import pytest

from engine_utils import dsbd_llm, metric, tiny_pair, with_think_tokens  # the CPU engine environment, before vllm
import vllm  # noqa: E402

from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams as SO  # noqa: E402

pytestmark = pytest.mark.slow

START, END = 399, 395  # <think>, </think>
WIDTH, DEPTH, MAX_TOKENS = 4, 3, 40
SO_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True, "reasoning_parser": "deepseek_r1"}
CHOICES = ["yes please", "no thanks", "maybe later"]
REGEX = r"[a-c]{2,5}x"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
CONSTRAINTS = {"choice": SO(choice=CHOICES), "regex": SO(regex=REGEX), "json": SO(json=SCHEMA)}
# (name, prompt): where the greedy text's reasoning ends
PROMPTS = [("ends after 2", [40, 41]), ("ends after 5", [200, 201, 202]), ("ended in the prompt", [11, 12, 13, END]),
           ("opened in the prompt", [START, 10, 20, 30]), ("free", [5, 6, 7, 8])]
BEAM_PROMPTS = [[40, 41], [11, 12, 13, END]]


def _valid(name: str, text: str) -> bool:
    if name == "choice":
        return text in CHOICES
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == {"ok", "tag"}


def _batch():
    cases = [(c, p, pr) for c in CONSTRAINTS for p, pr in PROMPTS]
    params = [vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[c])
              for c, _, _ in cases]
    return cases, [{"prompt_token_ids": pr} for _, _, pr in cases], params


def _counters(llm) -> dict:
    return {k: metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")}


def _run(llm, counted: bool) -> dict:
    cases, prompts, params = _batch()
    before = _counters(llm) if counted else None
    outs = llm.generate(prompts, params, use_tqdm=False)
    out = {"outs": [list(o.outputs[0].token_ids) for o in outs]}
    if counted:
        after = _counters(llm)
        out["spec"] = {k: after[k] - before[k] for k in after}
    beams = llm.beam_search([{"prompt_token_ids": p} for p in BEAM_PROMPTS],
                            BeamSearchParams(beam_width=2, max_tokens=6, structured_outputs=SO(regex=REGEX)))
    out["beams"] = [[list(s.tokens) for s in b.sequences] for b in beams]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tiny_pair()
    tmp = tmp_path_factory.mktemp("think")
    return (with_think_tokens(target, tmp / "target", START, END),
            with_think_tokens(draft, tmp / "draft", START, END))


@pytest.fixture(scope="module")
def plain(models):
    with dsbd_llm(models[0], max_num_seqs=16, structured_outputs_config=SO_CONFIG) as llm:
        return _run(llm, counted=False)


@pytest.fixture(scope="module")
def dsbd(models, plain):  # after plain: one engine at a time
    target, draft = models
    with dsbd_llm(target, max_num_seqs=16, structured_outputs_config=SO_CONFIG,
                  speculative_config={"method": "dsbd", "model": str(draft), "width": WIDTH,
                                      "num_speculative_tokens": DEPTH, "verify_budget": None}) as llm:
        out = _run(llm, counted=True)
        # planted: the worker's grammar acts from the first output token (no gate), as before the gate was built
        from vllm_dsbd.engine import grammar

        call = grammar.Compiler.__call__
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grammar.Compiler, "__call__", lambda self, req_id, sp, reasoning=None, prompt=(): call(
                self, req_id, sp))
            cases, prompts, params = _batch()
            out["planted"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        return out


def test_reasoning_gate_equals_plain_vllm(models, plain, dsbd):
    from vllm_dsbd.testing.models import load_tokenizer

    tok = load_tokenizer(models[0])
    cases, _, _ = _batch()
    thought = 0
    for (name, where, _), got, want in zip(cases, dsbd["outs"], plain["outs"]):
        grammar_part = got[got.index(END) + 1:] if END in got else got
        text = tok.decode(grammar_part, skip_special_tokens=True)
        print(f"{name:6s} {where:22s} reasoning {got.index(END) if END in got else '-'} tokens, then {text!r}")
        assert got == want, (name, where)
        if where.startswith("ends after"):
            assert END in got and got.index(END) == int(where.split()[-1]), (name, where, got)
            assert _valid(name, text), (name, where, text)
            thought += 1
        if where == "ended in the prompt":
            assert END not in got and _valid(name, text), (name, text)
    assert thought == 2 * len(CONSTRAINTS)
    # power: the worker's grammar from the first token gives other tokens wherever the model thinks first
    differ = [where for (_, where, _), got, want in zip(cases, dsbd["planted"], plain["outs"]) if got != want]
    assert len(differ) == 4 * len(CONSTRAINTS), differ
    spec = dsbd["spec"]
    print(f"draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_beam_search_structured_equals_plain_vllm(plain, dsbd):
    assert dsbd["beams"] == plain["beams"]
