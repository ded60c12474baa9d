"""``engine/beams/`` without vLLM: the settings a beam request may give (also as a JSON string), one full-width step
at T = 0 over a hand-made forest (which layers pass, which nodes are kept and where they move, what goes back to vLLM),
the settled prefix vLLM outputs for the request after each step, how ``rank_by_score`` ranks an EOS kept with
``ignore_eos``, and the candidates (2W best tokens of the row) every finished beam's token carries; the front end's
bounds from the model (``RequestLimits``: token ids in the vocabulary, the length penalty, stop strings without a
tokenizer, ``allowed_token_ids``, ``repetition_penalty``)."""
from __future__ import annotations

import pytest
import torch

from vllm_dsbd.engine.beams.trie import BeamForest, BeamRequest, RowTop
from vllm_dsbd.engine.beams.step import step_one
from vllm_dsbd.engine.cost import Subforest, passed_by_width
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.requests import BeamParams, RequestLimits, check_request

V, P = 8, 5
LIMITS = RequestLimits(vocab=400, max_len=256)


@pytest.mark.parametrize("extra, match", [
    ({"eos_token_id": 400}, r"\['eos_token_id'\] must be an integer in \[0, 399\], got 400"),
    ({"eos_token_id": 10**12}, r"\['eos_token_id'\] must be an integer in \[0, 399\]"),
    ({"stop_token_ids": [7, 400]}, r"\['stop_token_ids'\] must be a list of token ids \(integers in \[0, 399\]"),
    ({"length_penalty": 1e308}, r"\['length_penalty'\] = 1e\+308: \|length_penalty\| must be at most 126\.14"),
    ({"length_penalty": -127.0}, r"\['length_penalty'\] = -127.0: \|length_penalty\| must be at most"),
])
def test_beam_values_bounded_by_the_model(extra, match):
    beam = {"width": 2, "max_tokens": 4, **extra}
    with pytest.raises(ValueError, match=match):
        BeamParams.parse(beam, 4, limits=LIMITS)
    BeamParams.parse(beam, 4)  # no limits: the worker's parse (the front end refused it already)


def test_front_end_limits_in_check_request():
    from vllm import SamplingParams

    cfg = DSBDConfig(width=4)
    ok = {"width": 2, "max_tokens": 4, "eos_token_id": 399, "stop_token_ids": [399], "length_penalty": -126.0}
    assert check_request(SamplingParams(max_tokens=14, extra_args={"dsbd_beam": ok}), cfg, LIMITS) == 4
    assert 257.0 ** 126.14 < float("inf") and 257.0 ** -126.14 > 0.0
    with pytest.raises(ValueError, match=r"\['stop'\]: stop strings need the model's tokenizer"):
        check_request(SamplingParams(max_tokens=14, ignore_eos=True, extra_args={"dsbd_beam": {
            "width": 2, "max_tokens": 4, "stop": ["x"]}}), cfg, RequestLimits(400, 256, tokenizer=False))
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token ids must be in \[0, 399\].*\[400\]"):
        check_request(SamplingParams(allowed_token_ids=[3, 400]), cfg, LIMITS)
    for rep in (1e-7, 1e7):
        with pytest.raises(ValueError, match=r"^repetition_penalty must be in \[1e-06, 1e\+06\]"):
            check_request(SamplingParams(repetition_penalty=rep), cfg, LIMITS)
    assert check_request(SamplingParams(repetition_penalty=1e-6, allowed_token_ids=[399]), cfg, LIMITS) == 4


@pytest.mark.parametrize("value, match", [
    ({"width": 2, "max_tokens": 4, "depth": -1}, r"\['depth'\] must be an integer in >= 0, got -1"),
    ({"width": 2, "max_tokens": 4, "depth": "2"}, r"\['depth'\] must be an integer"),
    ({"width": 2, "max_tokens": 4, "depth": True}, r"\['depth'\] must be an integer"),
    ({"width": 8, "max_tokens": 4},
     r"\['width'\] = 8 is above the engine's 4 beams per request \(max_beam_width.*up to 4 fit"),
    ({"width": 2, "max_tokens": 0}, r"\['max_tokens'\] must be an integer in >= 1"),
    ({"width": 2, "max_tokens": 4, "n": 3}, r"\['n'\] must be an integer in \[1, 2\]"),
    ({"width": 2, "max_tokens": 4, "length_penalty": float("nan")}, r"\['length_penalty'\] must be a finite"),
    ({"width": 2, "max_tokens": 4, "dpeth": 1}, r"unknown key\(s\) \['dpeth'\]"),
    ([2, 4], r"must be a mapping"),
])
def test_bad_beam_settings_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        BeamParams.parse(value, max_width=4)


def test_nodes_are_optional_and_at_least_the_width():
    assert BeamParams.parse({"width": 2, "max_tokens": 4}, 4, 16).nodes is None
    assert BeamParams.parse({"width": 2, "max_tokens": 4, "nodes": 16}, 4, 16).nodes == 16
    assert BeamParams.parse({"width": 2, "max_tokens": 4, "nodes": 64}, 4).nodes == 64  # no engine bound given
    with pytest.raises(ValueError, match=r"\['nodes'\] must be an integer in \[2, 16\], got 1"):
        BeamParams.parse({"width": 2, "max_tokens": 4, "nodes": 1}, 4, 16)
    with pytest.raises(ValueError, match=r"\['nodes'\] = 17 is above the engine's 16"):
        BeamParams.parse({"width": 2, "max_tokens": 4, "nodes": 17}, 4, 16)
    # the request's N: its own, or the width (the engine's beam_nodes is resolved by engine/state.py)
    assert BeamRequest(BeamParams(width=2, max_tokens=4), P, 0.0, 0).nodes == 2
    assert BeamRequest(BeamParams(width=2, max_tokens=4), P, 0.0, 0, nodes=8).nodes == 8


def test_depth_is_optional():
    assert BeamParams.parse({"width": 2, "max_tokens": 4}, 4).depth is None
    assert BeamParams.parse({"width": 2, "max_tokens": 4, "depth": 0}, 4).depth == 0


def _row(**peaks):
    r = torch.zeros(V)
    for t, v in peaks.items():
        r[int(t[1:])] = v
    return r


def test_full_width_step_passes_a_layer_then_compacts(relayout=False):
    """The step's own compaction (the re-layout after it is off here; see the next test)."""
    beam = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), P, temperature=0.0, seed=0,
                       relayout=relayout)
    # step 1 from the prompt: beams "3" (best) and "5"
    assert beam.partial(_row(t3=10.0, t5=9.5)[None]) is None
    out = step_one(beam, None)
    assert (out.row, out.next_drafts, beam.tokens) == ([3], [5], [3, 5])
    # step 2: leaves node 0 ("3") and node 1 ("5"); the target's best pairs are (node 0, 1) and (node 0, 2). The
    # forest has both at depth 1 (nodes 2, 3) and two children of node 2 at depth 2 (nodes 4, 5: tokens 4 and 6)
    beam.forest = BeamForest(tokens=[1, 2, 4, 6], parents=[0, 0, 2, 2], depths=[2, 2, 3, 3],
                             drafted=[True, True, False, False])
    assert beam.position(P + 2) == P + 1 and beam.position(P + 4) == P + 2  # RoPE position = P - 1 + depth
    assert beam.node_parents() == [-1, -1, 0, 0, 2, 2]
    assert beam.partial(torch.stack([_row(t1=10.0, t2=9.0), _row()])) is None
    # forest logits: after node 2 the best is 4 (a forest node), after node 3 it is 7 (not one): layer 1 passes,
    # layer 2 does not
    out = step_one(beam, None, torch.stack([_row(t4=10.0), _row(t7=10.0), _row(), _row()]))
    assert (out.stepped, out.draft_nodes, out.layers_passed, beam.steps) == (True, 4, 1, 3)
    # leaf 0 (node 0, vLLM's last token) stays; leaf 1 ("5") got no child: dropped; forest nodes 2, 3 are kept and
    # move down to slots P + 1, P + 2; the new leaves "4" (under "1") and "7" (under "2") follow
    assert out.moves == [(P + 2, P + 1), (P + 3, P + 2)]
    assert beam.tokens == [3, 1, 2, 4, 7] and beam.parents == [-1, 0, 0, 1, 2] and beam.depths == [1, 2, 2, 3, 3]
    assert beam.has_draft == [False, True, True, False, False]
    # vLLM appends the kept nodes after its last token and the new leaf 0; leaf 1 is the next draft
    assert (out.row, out.next_drafts) == ([1, 2, 4], [7])
    assert beam.forest is None and beam.draft_skip == 0
    # a forest that passes no layer: its nodes leave nothing behind, and drafting pauses one step
    beam.forest = BeamForest(tokens=[0, 0], parents=[3, 3], depths=[4, 4], drafted=[False, False])
    beam.partial(torch.stack([_row(t5=10.0), _row(t6=10.0)]))
    out = step_one(beam, None, torch.stack([_row(), _row()]))
    assert (out.layers_passed, beam.steps, beam.draft_skip) == (0, 4, 1)
    assert beam.tokens == [3, 1, 2, 4, 7, 5, 6] and out.moves == [] and out.row == [7, 5]


def test_relayout_moves_the_common_prefix_to_linear_context_and_drops_dead_slots():
    beam = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), P, temperature=0.0, seed=0)
    beam.partial(_row(t3=10.0, t5=9.5)[None])
    step_one(beam, None)
    # step 2 as in the test above: the beams are "3 1 4" and "3 2 7"; their common prefix "3" becomes linear context
    # (slot P, already its slot: no K/V move besides the step's own), vLLM's token list does not change
    beam.forest = BeamForest(tokens=[1, 2, 4, 6], parents=[0, 0, 2, 2], depths=[2, 2, 3, 3],
                             drafted=[True, True, False, False])
    beam.partial(torch.stack([_row(t1=10.0, t2=9.0), _row()]))
    out = step_one(beam, None, torch.stack([_row(t4=10.0), _row(t7=10.0), _row(), _row()]))
    assert (beam.prefix, beam.base, beam.tokens, beam.parents) == ([3], P + 1, [1, 2, 4, 7], [-1, -1, 0, 1])
    assert beam.depths == [2, 2, 3, 3] and beam.position(P) == P and beam.position(P + 1 + 2) == P + 2
    assert out.moves == [(P + 2, P + 1), (P + 3, P + 2)] and out.tokens is None and out.dropped == 0
    assert (out.row, out.next_drafts) == ([1, 2, 4], [7])
    assert beam.draft_gap == P  # "3" has no draft K/V (no draft pass ran): the draft's catch-up starts there
    beam.draft_gap = None  # as after a catch-up pass
    # step 3 without a forest: "3 1 4 5" and "3 2 7 6": no common token past "3", no dead node: nothing to do
    beam.partial(torch.stack([_row(t5=10.0), _row(t6=10.0)]))
    out = step_one(beam, None)
    assert (beam.prefix, beam.tokens, out.moves, out.tokens) == ([3], [1, 2, 4, 7, 5, 6], [], None)
    # step 4: both new beams extend "3 1 4 5" (tokens 1 and 2); the beam "3 2 7 6" dies. The step drops its leaf
    # "6" (after vLLM's last token); the re-layout makes "1 4 5" linear context (slots P+1..P+3: "4" and "5" move
    # down from P+3 and P+5), drops the dead "2" and "7", and vLLM's list becomes the prefix and leaf 0
    beam.partial(torch.stack([_row(t1=10.0, t2=9.5), _row()]))
    out = step_one(beam, None)
    assert (beam.prefix, beam.base, beam.tokens, beam.parents) == ([3, 1, 4, 5], P + 4, [1, 2], [-1, -1])
    assert out.moves == [(P + 3, P + 2), (P + 5, P + 3)] and out.dropped == 2
    assert (out.row, out.tokens, out.next_drafts) == ([1], [3, 1, 4, 5, 1], [2])
    assert beam.draft_gap == P + 2  # "1" has the draft K/V of its forest pass, "4" and "5" none: catch-up from "4"
    assert beam.position(P + 4) == P + 4  # leaf 0 at depth 5: position P - 1 + 5, in the slot right after the prefix
    # the beams read through the prefix (what the request returns), and the settled prefix includes it
    assert [beam._path(b.node)[0] for b in beam.live] == [[3, 1, 4, 5, 1], [3, 1, 4, 5, 2]]
    assert beam.settle() == [3, 1, 4, 5]


def test_settled_prefix_waits_for_finished_beams_that_may_still_be_returned():
    """``BeamRequest.settle``: what vLLM outputs for a beam request after each step. A finished beam among the n best
    holds the prefix back even when every live beam agrees; once it drops out of the n best (it never comes back), the
    live beams' common prefix is settled; at the end, the rest of the best beam."""
    beam = BeamRequest(BeamParams(width=2, max_tokens=4, eos_token_id=7), P, temperature=0.0, seed=0)
    paths = lambda: [beam._path(b.node)[0] for b in beam.live]  # noqa: E731
    # step 1: beams "3" and "5"; "7" (EOS) finishes as a beam of its own
    beam.partial(_row(t3=10.0, t5=9.5, t7=8.0)[None])
    step_one(beam, 7)
    assert paths() == [[3], [5]] and [f.tokens for f in beam.finished] == [[7]]
    assert beam.settle() == []
    # step 2: both new beams hang from "3", but the finished [7] is still one of the 2 best: nothing settles
    beam.partial(torch.stack([_row(t1=10.0, t2=9.9, t0=1.0, t4=1.0), _row(t0=1.0, t1=1.0, t2=1.0, t3=1.0)]))
    step_one(beam, 7)
    assert paths() == [[3, 1], [3, 2]] and [f.tokens for f in beam.best()] == [[7]]
    assert beam.settle() == []
    # step 3: [3, 1, EOS] and [3, 2, EOS] finish, both better than [7], which drops out of the 2 best: "3" settles
    beam.partial(torch.stack([_row(t7=20.0, t0=1.0, t1=1.0, t2=1.0), _row(t7=20.0, t0=1.0, t1=1.0, t2=1.0)]))
    step_one(beam, 7)
    assert [f.tokens for f in beam.best()] == [[3, 1, 7], [3, 2, 7]] and all(p[0] == 3 for p in paths())
    assert beam.settle() == [3] and beam.settle() == []
    # step 4 (max_tokens): the search ends; the rest of the best beam follows
    beam.partial(torch.stack([_row(), _row()]))
    out = step_one(beam, 7)
    assert out.finished and beam.best()[0].tokens == [3, 1, 7]
    assert beam.settle() == [1, 7] and beam.settled == 3


def test_beam_settings_may_be_a_json_string():
    """The OpenAI server's ``vllm_xargs`` carry strings and numbers, not mappings: the settings as a JSON object."""
    assert BeamParams.parse('{"width": 2, "max_tokens": 4, "n": 1}', 4) == BeamParams(width=2, max_tokens=4, n=1)
    with pytest.raises(ValueError, match=r"must be a mapping \(or a JSON object string\)"):
        BeamParams.parse("{width: 2}", 4)
    with pytest.raises(ValueError, match=r"must be a mapping"):
        BeamParams.parse("[2, 4]", 4)


def test_rank_by_score_ranks_an_eos_kept_with_ignore_eos_as_vllms_offline_loop():
    """With ``ignore_eos`` an EOS candidate stays a beam; vLLM's ``LLM.beam_search`` ranks it by
    ``cum / (len - 1) ** length_penalty`` (its EOS not counted) against ``cum / len ** length_penalty`` for the others
    (``rank_by_score``), vLLM's server loop by cumulative log-probability (the default)."""
    row = _row(t3=10.0, t7=8.3, t5=8.0)
    lp = torch.log_softmax(row, -1)
    n = P + 1  # tokens of a step-1 candidate, prompt included
    assert lp[5] < lp[7] and lp[7] / (n - 1) < lp[5] / n  # EOS second by log-probability, third by vLLM's score
    leaves = {}
    for rank in (False, True):
        beam = BeamRequest(BeamParams(width=2, max_tokens=4, ignore_eos=True, eos_token_id=7, rank_by_score=rank), P,
                           temperature=0.0, seed=0)
        beam.partial(row[None])
        step_one(beam, 7)
        leaves[rank] = [beam.tokens[b.node] for b in beam.live]
    assert leaves == {False: [3, 7], True: [3, 5]}


@pytest.mark.parametrize("relayout", [False, True])
def test_finished_beams_carry_the_candidates_of_every_token(relayout):
    """``Finished.top`` (as the payload lists it): per token the 2W best (token, log-probability) of the row it was chosen from, best first, for
    tokens chosen from leaves, from a forest node whose layer passed, and through the re-layout's prefix."""
    beam = BeamRequest(BeamParams(width=2, max_tokens=4, ignore_eos=True), P, temperature=0.0, seed=0,
                       relayout=relayout)
    beam.partial(_row(t3=10.0, t5=9.5)[None])
    step_one(beam, None)
    beam.forest = BeamForest(tokens=[1, 2, 4, 6], parents=[0, 0, 2, 2], depths=[2, 2, 3, 3],
                             drafted=[True, True, False, False])
    beam.partial(torch.stack([_row(t1=10.0, t2=9.0), _row()]))
    out = step_one(beam, None, torch.stack([_row(t4=10.0, t0=1.0), _row(t7=10.0), _row(), _row()]))
    assert out.layers_passed == 1  # "4" was chosen from forest node "1"'s row
    beam.partial(torch.stack([_row(t5=10.0), _row(t6=10.0)]))
    out = step_one(beam, None)
    assert out.finished
    rows = {(): _row(t3=10.0, t5=9.5), (3,): _row(t1=10.0, t2=9.0), (3, 1): _row(t4=10.0, t0=1.0),
            (3, 2): _row(t7=10.0), (3, 1, 4): _row(t5=10.0), (3, 2, 7): _row(t6=10.0)}  # context -> its row
    for f, sent in zip(beam.best(), beam.payload()["dsbd_beam"]):
        assert len(f.top) == len(f.tokens) == 4
        assert sent["top_logprobs"] == [RowTop.listed(t) for t in f.top]  # what the front end gets
        for k, (t, v, top) in enumerate(zip(f.tokens, f.logprobs, sent["top_logprobs"])):
            assert len(top) == 4 and (t, v) in top
            # the row the token was chosen from: its best tokens and their log-probabilities (the first two: the
            # rest tie at logit 0 and may come in any order)
            vals, idx = torch.topk(torch.log_softmax(rows[tuple(f.tokens[:k])], -1), 4)
            assert [x for x, _ in top][:2] == idx.tolist()[:2]
            assert all(abs(x - y) < 1e-6 for (_, x), y in zip(top, vals.tolist())), (top, vals)


def _over_drafted_step(forest: BeamForest, forest_rows: list):
    """Steps 1 and 2 of a W = 2 beam request at T = 0 (re-layout off): step 1 from the prompt gives beams "3" (node
    0) and "5" (node 1); step 2 verifies ``forest`` with the given logits rows of its nodes. The target's 2 best pairs
    at step 2 are (node 0, 2) and (node 1, 6), then (node 3 = "2", 4) and (node 4 = "6", 5)."""
    beam = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), P, temperature=0.0, seed=0, relayout=False,
                       nodes=3)
    assert beam.partial(_row(t3=10.0, t5=9.5)[None]) is None
    step_one(beam, None)
    beam.forest = forest
    assert beam.partial(torch.stack([_row(t2=10.0, t1=5.0), _row(t6=10.0)])) is None
    return beam, step_one(beam, None, torch.stack(forest_rows))


def test_over_drafted_forest_passes_where_the_draft_top_w_does_not():
    """N = 3 > W = 2 nodes per depth: the draft's third pair at depth 1, (node 1, 6), is one of the target's 2 best,
    so layer 1 passes (the draft's top 2, both under node 0, would have failed), and so does layer 2 (whose nodes hang
    from all 3 depth-1 nodes); the depth-1 node no beam goes through (token 1) and the depth-2 node under it are
    dropped, the kept nodes move down."""
    over = BeamForest(tokens=[1, 2, 6, 4, 5, 7], parents=[0, 0, 1, 3, 4, 2], depths=[2, 2, 2, 3, 3, 3],
                      drafted=[True] * 3 + [False] * 3, layers=[1, 1, 1, 2, 2, 2], slots=[0, 0, 1, 1, 2, 0])
    rows = [_row(), _row(t4=10.0), _row(t5=10.0), _row(t0=10.0), _row(t0=10.0), _row()]
    beam, out = _over_drafted_step(over, rows)
    assert (out.draft_nodes, out.layers_passed, beam.steps) == (6, 2, 4)
    # kept: leaf 1 ("5"), forest nodes 3 ("2"), 4 ("6"), 5 ("4"), 6 ("5"), moved down past the dropped node 2 ("1");
    # the new leaves "0" hang from nodes 5 and 6 (now 4 and 5)
    assert beam.tokens == [3, 5, 2, 6, 4, 5, 0, 0] and beam.parents == [-1, -1, 0, 1, 2, 3, 4, 5]
    assert out.moves == [(P + 3, P + 2), (P + 4, P + 3), (P + 5, P + 4), (P + 6, P + 5)]
    assert (out.row, out.next_drafts) == ([5, 2, 6, 4, 5, 0], [0])
    # what the cost model reads of it (cost.Subforest): parents as forest indices, the target's beams per passed
    # layer; its 2-subforest (the draft's 2 best pairs, both under node 0) passes no layer, the forest itself 2
    assert out.sub == Subforest(width=2, nodes=3, layers=(1, 1, 1, 2, 2, 2), parents=(-1, -1, -1, 1, 2, 0),
                                beams=((1, 2), (3, 4)))
    assert passed_by_width(out.sub.layers, out.sub.parents, out.sub.beams, [2, 3]) == {2: 0, 3: 2}
    # the same forest cut to W = 2 nodes per depth (the draft's 2 best pairs): layer 1 fails
    cut = BeamForest(tokens=[1, 2, 4, 5], parents=[0, 0, 3, 3], depths=[2, 2, 3, 3], drafted=[True, True, False, False],
                     layers=[1, 1, 2, 2], slots=[0, 0, 1, 1])
    beam, out = _over_drafted_step(cut, [_row(), _row(t4=10.0), _row(), _row()])
    assert (out.draft_nodes, out.layers_passed, beam.steps) == (4, 0, 2)
    assert out.sub.beams == () and out.sub.layers == (1, 1, 2, 2)
