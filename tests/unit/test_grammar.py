"""``engine/grammar.py``: the masks of a forest's rows are those of vLLM's matcher after each row's own path.

A tiny character vocabulary compiled by xgrammar (the backend vLLM uses by default), wrapped in vLLM's own
``XgrammarGrammar``. The reference for each row is a fresh matcher advanced along output + the row's path (no
rollback); :func:`apply_bitmask_` against ``xgr.apply_token_bitmask_inplace``.
"""
from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from vllm_dsbd.engine.grammar import DraftGrammar, RequestGrammar, apply_bitmask_, mask_target_  # noqa: E402
from vllm_dsbd.engine.penalties import TargetRows, node_paths  # noqa: E402

VOCAB = ["<eos>", "a", "b", "c", "x", "ab", "ba", "cx", "red", "re", "d", "blue", "bl", "ue", "q"] + \
    [f"<pad{i}>" for i in range(23)]  # 38 tokens: two bitmask words
V = len(VOCAB)
REGEX = r"[a-c]{2,5}x"


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_regex(REGEX)


def _grammar(compiled) -> XgrammarGrammar:
    return XgrammarGrammar(matcher=xgr.GrammarMatcher(compiled, max_rollback_tokens=16), vocab_size=V, ctx=compiled)


def _reference(compiled, history) -> torch.Tensor:
    """The bitmask after ``history`` from a fresh matcher (all ones where it is terminated or rejects)."""
    g = _grammar(compiled)
    bm = xgr.allocate_token_bitmask(1, V)
    if all(g.matcher.accept_token(t) for t in history) and not g.matcher.is_terminated():
        g.matcher.fill_next_token_bitmask(bm, 0)
    else:
        bm.fill_(-1)
    return bm[0]


def _request(compiled) -> RequestGrammar:
    return RequestGrammar("r", _grammar(compiled), lambda n: xgr.allocate_token_bitmask(n, V), V)


# a forest in compact depth-major order after output "a": depth 1 b, c, x(invalid), ab; depth 2 under them
OUTPUT = [1]
TOKENS = [2, 3, 4, 5, 4, 1, 7, 2, 0]
PARENTS = [-1, -1, -1, -1, 0, 0, 1, 3, 4]


def test_forest_rows_take_their_own_paths_masks(compiled):
    req = _request(compiled)
    paths = [[]] + node_paths(TOKENS, PARENTS)
    got = req.bitmasks(OUTPUT, paths)
    for i, path in enumerate(paths):
        assert torch.equal(got[i], _reference(compiled, OUTPUT + path)), (i, path)
    # the matcher is back at the output's state (rolled back after every path), and advances with the output
    assert torch.equal(req.bitmasks(OUTPUT, [[]])[0], _reference(compiled, OUTPUT))
    assert torch.equal(req.bitmasks(OUTPUT + [2, 3], [[4]])[0], _reference(compiled, OUTPUT + [2, 3, 4]))
    # a node after a rejected token and after EOS: unmasked (vLLM's terminated row)
    assert (got[3] == -1).all() and (got[9] == -1).all()
    # a different history (not an extension): the matcher starts over
    assert torch.equal(req.bitmasks([3], [[1]])[0], _reference(compiled, [3, 1]))


def test_apply_bitmask_equals_xgrammar(compiled):
    req = _request(compiled)
    paths = [[]] + node_paths(TOKENS, PARENTS)
    bm = req.bitmasks(OUTPUT, paths)
    logits = torch.randn(len(paths), V + 5)  # wider than the bitmask's tokens: the extra columns are kept
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bm)
    assert torch.equal(apply_bitmask_(logits.clone(), bm), want)


def test_mask_target_masks_each_request_row(compiled):
    req = _request(compiled)
    logits = torch.zeros(2 + 1 + len(TOKENS), V)
    rows = TargetRows(first_row=2, tokens=TOKENS, parents=PARENTS, prompt=[9], output=OUTPUT, penalties=None,
                      grammar=req)
    mask_target_(logits, [rows])
    assert (logits[:2] == 0).all()  # another request's rows
    for i, path in enumerate([[]] + node_paths(TOKENS, PARENTS)):
        want = torch.zeros(1, V)
        apply_bitmask_(want, _reference(compiled, OUTPUT + path)[None])
        assert torch.equal(logits[2 + i], want[0]), i


def test_draft_grammar_follows_the_draws(compiled):
    req = _request(compiled)
    W = 3
    gram = DraftGrammar([1], [OUTPUT], [req], W)
    full = torch.zeros(2, W, V)
    out = gram.apply(full)
    assert (out[0] == 0).all()  # a request without a grammar
    root = torch.zeros(1, V)
    apply_bitmask_(root, _reference(compiled, OUTPUT)[None])
    assert all(torch.equal(out[1, s], root[0]) for s in range(W))
    fork = gram.fork()
    # step 1: request 1 draws b, c (slots 0, 1 from root slot 0); step 2: slot 0 <- (1, a), slot 1 <- (0, x)
    gram.advance(torch.tensor([[0, 0], [0, 0]]), torch.tensor([[1, 1], [2, 3]]))
    gram.advance(torch.tensor([[0, 0], [1, 0]]), torch.tensor([[1, 1], [1, 4]]))
    assert gram.paths == [[(3, 1), (2, 4), ()]]
    out = gram.apply(full)
    for s, path in enumerate([[3, 1], [2, 4]]):
        want = torch.zeros(1, V)
        apply_bitmask_(want, _reference(compiled, OUTPUT + path)[None])
        assert torch.equal(out[1, s], want[0]), s
    assert fork.paths == [[(), (), ()]]  # a fork keeps its own paths
