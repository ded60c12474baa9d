"""DSBD's per-node penalties (``vllm_dsbd/engine/penalties.py``) against vLLM 0.26's own ``apply_penalties``.

Every target row and every draft slot must get, bit for bit, what vLLM's sampler would give that row if the row's
history (prompt + output + the node's path from the root) were a plain request's: float32 equality with
``vllm.model_executor.layers.utils.apply_penalties`` called on that history, on random logits (positive and negative,
so both branches of the repetition penalty run) and a small vocabulary, so that histories repeat tokens.
"""
from __future__ import annotations

import random

import torch

from vllm.model_executor.layers.utils import apply_penalties as vllm_apply_penalties

from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core import rng
from vllm_dsbd.engine import penalties
from vllm_dsbd.engine.penalties import DraftPenalties, RequestPenalties, TargetRows, node_paths, penalize_target

V = 23
PENS = [RequestPenalties(0.5, 0.25, 1.3), RequestPenalties(0.0, 0.0, 0.7), RequestPenalties(-0.4, 0.6, 1.0)]


def _vllm_row(row: torch.Tensor, prompt: list[int], history: list[int], pen: RequestPenalties) -> torch.Tensor:
    """vLLM's penalties on one row whose prompt is ``prompt`` and whose output tokens are ``history``."""
    logits = row.clone()[None]
    p = torch.tensor([prompt or [V]], dtype=torch.int64)
    o = torch.tensor([history or [V]], dtype=torch.int64)
    return vllm_apply_penalties(logits, p, o, torch.tensor([pen.presence]), torch.tensor([pen.frequency]),
                                torch.tensor([pen.repetition]))[0]


def test_node_paths():
    # compact order: nodes 0, 1 at depth 1; 2 under 1, 3 under 0; 4 under 3
    assert node_paths([5, 6, 7, 8, 9], [-1, -1, 1, 0, 3]) == [[5], [6], [6, 7], [5, 8], [5, 8, 9]]


def _target_rows_wrong() -> list[int]:
    """The rows where ``penalize_target`` differs from vLLM's penalties on that row's history; asserts the setup
    reaches what it must (penalties change rows; other requests' rows are left alone)."""
    gen = random.Random(0)
    torch.manual_seed(0)
    N = 30
    logits = torch.randn(N, V) * 3
    reqs, first = [], 0
    for k, pen in enumerate(PENS):
        n = [4, 0, 6][k]  # request 1: a depth-0 row (root only)
        parents = [-1] + [gen.randrange(c) if gen.random() < 0.7 else -1 for c in range(1, n)]
        reqs.append(TargetRows(first_row=first, tokens=[gen.randrange(V) for _ in range(n)], parents=parents,
                               prompt=[gen.randrange(V) for _ in range(gen.randint(1, 8))],
                               output=[gen.randrange(V) for _ in range(k * 3)], penalties=pen))
        first += n + 1 + 2  # two rows of some other request between
    out = penalize_target(logits, reqs)
    touched, wrong = set(), []
    for r in reqs:
        paths = node_paths(r.tokens, r.parents)
        for j, hist in enumerate([[]] + paths):
            row = r.first_row + j
            touched.add(row)
            if not torch.equal(out[row], _vllm_row(logits[row], r.prompt, r.output + hist, r.penalties)):
                wrong.append(row)
    assert any(not torch.equal(out[i], logits[i]) for i in touched)  # the penalties changed something
    for i in set(range(N)) - touched:  # other requests' rows are left alone
        assert torch.equal(out[i], logits[i])
    return wrong


def test_target_rows_equal_vllm_per_history(monkeypatch):
    """Every row equal to vLLM's; power: a planted one-position history error (each node's row penalized by its path
    without the node's own token) makes rows differ."""
    assert _target_rows_wrong() == []
    real = penalties.node_paths
    monkeypatch.setattr(penalties, "node_paths", lambda tokens, parents: [p[:-1] for p in real(tokens, parents)])
    wrong = _target_rows_wrong()
    monkeypatch.undo()
    assert len(wrong) >= 5, wrong


def test_draft_slots_equal_vllm_per_history():
    """Three beam steps of width 3 over random logits: before each step, every slot of a penalized request is its
    history's vLLM row (the slot's path followed through the draws' parents); the others are untouched."""
    torch.manual_seed(1)
    gen = random.Random(1)
    R, W = 4, 3
    sel = [0, 2, 3]
    prompts = {i: [gen.randrange(V) for _ in range(5)] for i in sel}
    outputs = {i: [gen.randrange(V) for _ in range(i + 1)] for i in sel}
    pens = {0: PENS[0], 2: PENS[1], 3: PENS[2]}
    pen = DraftPenalties(sel, [prompts[i] for i in sel], [outputs[i] for i in sel], [pens[i] for i in sel], W, V,
                         "cpu")
    params = BatchParams.make(R, temperature=1.0, width=W, seed=[1, 2, 3, 4], single=True)
    scores = torch.zeros(R, W)
    live = torch.zeros(R, W, dtype=torch.bool)
    live[:, 0] = True
    paths = [[[] for _ in range(W)] for _ in range(R)]  # each slot's path, followed on the host
    for d in range(1, 4):
        full = torch.randn(R, W, V) * 3
        got = pen.apply(full)
        for i in range(R):
            for s in range(W):
                if i in pens:
                    want = _vllm_row(full[i, s], prompts[i], outputs[i] + paths[i][s], pens[i])
                    assert torch.equal(got[i, s], want), (d, i, s)
                else:
                    assert torch.equal(got[i, s], full[i, s])
        st = beam_step(got, scores, live, params, torch.full((R,), 10 + d), rng.Stream.DRAFT_DRAW)
        pen.advance(st.parent, st.token)
        paths = [[paths[i][p] + [t] for p, t in zip(st.parent[i].tolist(), st.token[i].tolist())] for i in range(R)]
        scores, live = st.score, st.valid
    assert any(len(set(map(tuple, p))) > 1 for p in paths)  # the slots' histories differ
