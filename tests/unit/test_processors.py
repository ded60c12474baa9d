"""DSBD's per-node logits rules (``vllm_dsbd/engine/processors.py``: ``allowed_token_ids``, ``bad_words``,
``min_tokens``, ``logit_bias``, ``min_p``) against vLLM 0.26's own operations on a plain decode row.

Every target row and every draft slot must get, bit for bit, what vLLM's sampler gives a row whose output is that row's
history (output + the node's path from the root): vLLM's ``_apply_bad_words_single_batch`` and ``MinPLogitsProcessor``
(its ``apply``, the request's ``min_p`` in place), the whitelist, the min-tokens ban and the bias as vLLM's input batch
and builtin processors write them, in vLLM's order, with the penalties between (``penalties.penalize_target``). Small
vocabulary and short random paths, so that bad words' prefixes match some node histories and not others.
"""
from __future__ import annotations

import random

import pytest
import torch

from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
from vllm.sampling_params import SamplingParams

from vllm_dsbd.core import rng
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.engine import processors
from vllm_dsbd.engine.penalties import RequestPenalties, TargetRows, node_paths, penalize_target
from vllm_dsbd.engine.processors import DraftRows, DraftRules, RequestRules, node_histories

V = 13
RULES = [
    RequestRules(allowed=(0, 1, 2, 3, 5, 7, 8, 11), bad_words=(), min_tokens=0, stop_ids=(), bias=((2, 1.5),),
                 min_p=0.2, temperature=0.7),
    RequestRules(allowed=None, bad_words=((4,), (1, 2), (3, 1, 6), (2, 1, 2, 3, 10)), min_tokens=5, stop_ids=(0, 9), bias=(),
                 min_p=0.0, temperature=0.0),
    RequestRules(allowed=None, bad_words=((2, 3),), min_tokens=3, stop_ids=(12,), bias=((5, -2.0), (6, 3.0)),
                 min_p=0.5, temperature=1.3),
]
PENS = [RequestPenalties(0.5, 0.25, 1.3), None, RequestPenalties(-0.3, 0.0, 1.1)]


def _min_p(row: torch.Tensor, min_p: float, temperature: float) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor.apply on one tempered row (the mask it leaves, on the untempered row)."""
    proc = object.__new__(MinPLogitsProcessor)
    proc.min_p_count, proc.min_p = 1, torch.tensor([[min_p]], dtype=torch.float32)
    tempered = proc.apply(row[None].clone().div_(torch.tensor([temperature], dtype=torch.float32)[:, None]))[0]
    return row.masked_fill(torch.isinf(tempered), float("-inf"))


def _vllm_row(row: torch.Tensor, prompt: list[int], output: list[int], rules: RequestRules,
              pen: RequestPenalties | None) -> torch.Tensor:
    """vLLM's sampler on one row of a plain request with ``output`` so far, up to top-k (temperature left out)."""
    x = row.clone()
    if rules.allowed is not None:
        mask = torch.ones(V, dtype=torch.bool)
        mask[list(rules.allowed)] = False
        x.masked_fill_(mask, float("-inf"))
    _apply_bad_words_single_batch(x, [list(w) for w in rules.bad_words], list(output))
    if rules.min_tokens and len(output) < rules.min_tokens:
        x[list(rules.stop_ids)] = float("-inf")
    for t, b in rules.bias:
        x[t] += b
    if pen is not None:
        x = penalize_target(x[None], [TargetRows(0, [], [], prompt, output, pen)])[0]
    if rules.min_p and rules.temperature > 0:
        x = _min_p(x, rules.min_p, rules.temperature)
    return x


def test_rules_of_sampling_params():
    assert RequestRules.of(SamplingParams(temperature=0.5)) is None
    assert RequestRules.of(SamplingParams(temperature=0.0, min_p=0.3)) is None  # greedy: vLLM applies no min_p
    sp = SamplingParams(temperature=0.5, min_p=0.3, min_tokens=2, stop_token_ids=[7], logit_bias={3: 1.0},
                        allowed_token_ids=[1, 2, 3])
    r = RequestRules.of(sp)
    assert (r.min_p, r.min_tokens, r.stop_ids, r.bias, r.allowed) == (0.3, 2, (7,), ((3, 1.0),), (1, 2, 3))


def _target_wrong(planted=None) -> tuple[list[int], int]:
    """The rows where pre_target_ + penalties + post_target_ differ from vLLM's row on that row's history, and how
    many rows the rules changed; other requests' rows must stay as they were."""
    gen = random.Random(0)
    torch.manual_seed(0)
    N = 40
    logits = torch.randn(N, V) * 3
    reqs, first = [], 0
    for k, (rules, pen) in enumerate(zip(RULES, PENS)):
        n = [6, 0, 8][k] if k != 1 else 7
        parents = [-1] + [gen.randrange(c) if gen.random() < 0.7 else -1 for c in range(1, n)]
        reqs.append(TargetRows(first_row=first, tokens=[gen.choice([1, 2, 3, 4, 6]) for _ in range(n)],
                               parents=parents, prompt=[gen.randrange(V) for _ in range(4)],
                               output=[gen.choice([1, 2, 3]) for _ in range(k + 1)], penalties=pen, rules=rules))
        first += n + 1 + 2  # two rows of some other request between
    out = processors.post_target_(penalize_target(processors.pre_target_(logits.clone(), reqs), reqs), reqs)
    touched, wrong, changed = set(), [], 0
    for r in reqs:
        for j, hist in enumerate([[]] + node_paths(r.tokens, r.parents)):
            row = r.first_row + j
            touched.add(row)
            want = _vllm_row(logits[row], r.prompt, r.output + hist, r.rules, r.penalties)
            changed += not torch.equal(want, logits[row])
            if not torch.equal(out[row], want):
                wrong.append(row)
    for i in set(range(N)) - touched:
        assert torch.equal(out[i], logits[i])
    return wrong, changed


def test_target_rows_equal_vllm_per_history(monkeypatch):
    """Every row equal to vLLM's; power: node rows given the root's history (bad_words and min_tokens see the
    request's output only) make rows differ."""
    wrong, changed = _target_wrong()
    assert wrong == [] and changed >= 15
    monkeypatch.setattr(processors, "node_histories",
                        lambda output, tokens, parents: [list(output)] * (1 + len(tokens)))
    wrong, _ = _target_wrong()
    assert len(wrong) >= 2, wrong


def test_node_histories():
    assert node_histories([9], [5, 6, 7], [-1, -1, 1]) == [[9], [9, 5], [9, 6], [9, 6, 7]]


@pytest.mark.parametrize("with_penalties", [False, True])
def test_draft_slots_equal_vllm_per_history(with_penalties):
    """Four beam steps of width 3 over random logits: before each step, every slot of a request with rules is its
    history's vLLM row (the slot's path followed through the draws' parents), with the penalties between when the
    request has them; a request with neither is untouched."""
    from vllm_dsbd.engine.penalties import DraftPenalties

    torch.manual_seed(1)
    gen = random.Random(1)
    R, W = 4, 3
    sel = [0, 2, 3]
    rules = {0: RULES[0], 2: RULES[1], 3: RULES[2]}
    pens = {0: PENS[0], 3: PENS[2]} if with_penalties else {}
    prompts = {i: [gen.randrange(V) for _ in range(5)] for i in sel}
    outputs = {i: [gen.choice([1, 2, 3]) for _ in range(i + 1)] for i in sel}
    psel = sorted(pens)
    pen = DraftPenalties(psel, [prompts[i] for i in psel], [outputs[i] for i in psel], [pens[i] for i in psel], W, V,
                         "cpu") if psel else None
    rows = DraftRows(pen, DraftRules(sel, [outputs[i] for i in sel], [rules[i] for i in sel], W, V, "cpu"))
    params = BatchParams.make(R, temperature=1.0, width=W, seed=[1, 2, 3, 4], single=True)
    scores = torch.zeros(R, W)
    live = torch.zeros(R, W, dtype=torch.bool)
    live[:, 0] = True
    paths = [[[] for _ in range(W)] for _ in range(R)]
    for d in range(1, 5):
        full = torch.randn(R, W, V) * 3
        got = rows.apply(full)
        for i in range(R):
            for s in range(W):
                if i in rules:
                    want = _vllm_row(full[i, s], prompts[i], outputs[i] + paths[i][s], rules[i], pens.get(i))
                    assert torch.equal(got[i, s], want), (d, i, s)
                else:
                    assert torch.equal(got[i, s], full[i, s])
        st = beam_step(got, scores, live, params, torch.full((R,), 10 + d), rng.Stream.DRAFT_DRAW)
        rows.advance(st.parent, st.token)
        paths = [[paths[i][p] + [t] for p, t in zip(st.parent[i].tolist(), st.token[i].tolist())] for i in range(R)]
        scores, live = st.score, st.valid
    assert any(len(set(map(tuple, p))) > 1 for p in paths)
