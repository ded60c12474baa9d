"""The benchmark-only set-rate acceptance (``vllm_dsbd/testing/set_acceptance.py``): its accepted path is a real
root-to-leaf path of the forest, and the package never imports it (the serving path cannot reach it)."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

from vllm_dsbd.testing import set_acceptance  # noqa: E402
from vllm_dsbd.engine.beams.step import step_one  # noqa: E402


def test_chain_is_the_path_to_the_first_deepest_node():
    # compact order: depth 1 nodes 0, 1; depth 2 nodes 2 (child of 1), 3 (child of 0); depth 3 node 4 (child of 3)
    parents, depths = [-1, -1, 1, 0, 3], [1, 1, 2, 2, 3]
    assert set_acceptance.chain(parents, depths) == [0, 3, 4]
    assert set_acceptance.chain([-1, -1, 1], [1, 1, 2]) == [1, 2]
    assert set_acceptance.chain([], []) == []


def test_package_never_imports_it():
    hits = [p for p in (ROOT / "vllm_dsbd").rglob("*.py") if "set_acceptance" in p.read_text()]
    assert hits == []


def _beam_after_one_step():
    """A T = 0 beam request of width 2 after its first step (leaves "3", "5"), with a forest of 2 nodes under each
    depth: depth 1 nodes 2, 3 (under leaf node 0), depth 2 nodes 4, 5 (under node 2); the target's logits make no
    forest node one of its best pairs, so the real rule passes no layer."""
    import torch

    from vllm_dsbd.engine.beams.trie import BeamForest, BeamRequest
    from vllm_dsbd.requests import BeamParams

    V, P = 8, 5
    beam = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), P, temperature=0.0, seed=0,
                       relayout=False)
    first = torch.zeros(V)
    first[3], first[5] = 10.0, 9.5
    beam.partial(first[None])
    step_one(beam, None)
    beam.forest = BeamForest(tokens=[1, 2, 4, 6], parents=[0, 0, 2, 2], depths=[2, 2, 3, 3],
                             drafted=[True, True, False, False])
    leaves = torch.zeros(2, V)
    leaves[:, 7] = 10.0  # the target's best pairs end in token 7: never a forest token
    leaves[:, 0] = 9.0
    beam.partial(leaves)
    return beam, torch.zeros(4, V).index_fill_(1, torch.tensor([7]), 10.0)


def test_beam_layers_pass_at_the_set_rate():
    """Rate 1: every forest layer under the live beams passes (the beams become forest nodes, one beam step each);
    rate 0: none passes; uninstall restores the real rule (which passes none here)."""
    from vllm_dsbd.engine.beams.trie import BeamRequest

    real = BeamRequest.verify_layers
    try:
        set_acceptance.install(1.0)
        assert BeamRequest.verify_layers is not real
        beam, flogits = _beam_after_one_step()
        out = step_one(beam, None, flogits)
        assert (out.layers_passed, beam.steps) == (2, 4)  # depth 1 then depth 2, then the step on their logits
        # the beams run through the forest: "3" -> node "1" (depth 1) -> nodes "4", "6" (depth 2), then the target's
        # own step ("7" on both); leaf "5" and node "2" got no child and are dropped
        assert beam.tokens == [3, 1, 4, 6, 7, 7] and beam.parents == [-1, 0, 1, 1, 2, 3]
        set_acceptance.set_rate(0.0)
        beam, flogits = _beam_after_one_step()
        assert (step_one(beam, None, flogits).layers_passed, beam.steps) == (0, 2)
    finally:
        set_acceptance.uninstall()
    assert BeamRequest.verify_layers is real
    beam, flogits = _beam_after_one_step()
    assert step_one(beam, None, flogits).layers_passed == 0


def test_beam_sampling_layers_pass_at_the_set_rate():
    """T > 0 beam requests (``beam_sampling.verify``): rate 1 makes each request's layer output its first K drafts
    (every output a forest node: the layer passes), rate 0 leaves the real outputs, or, when they are all drafts
    (a real pass), makes the last one a pair outside the forest; uninstall restores the real function."""
    import torch

    from vllm_dsbd.engine import reads
    from vllm_dsbd.engine.beams import sampling as beam_sampling
    from vllm_dsbd.engine.beams.trie import beam_params, BeamRequest
    from vllm_dsbd.requests import BeamParams

    V = 8
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # the target's mass is on token 7: the drafts (tokens 1..4) are almost surely rejected
    layer = beam_sampling.Layer(logits=logits, scores=[0.0, -1.0], drafts=[0 * V + 1, 1 * V + 2, 0 * V + 3, 4],
                                logq=torch.log_softmax(torch.zeros(2 * V), -1), position=9, dynamic=False)
    req = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), 5, temperature=1.0, seed=3)
    params = beam_params([req, req])
    real = beam_sampling.verify
    real_out, ks = reads.run(real([layer, layer], params))
    assert ks == [2, 2] and all(p.token == 7 for ps in real_out for p in ps)
    try:
        set_acceptance.install(1.0)
        assert beam_sampling.verify is not real
        out, ks = reads.run(beam_sampling.verify([layer, layer], params))
        assert [[(p.beam, p.token) for p in ps] for ps in out] == [[(0, 1), (1, 2)]] * 2 and ks == [2, 2]
        set_acceptance.set_rate(0.0)
        out, _ = reads.run(beam_sampling.verify([layer, layer], params))
        assert [[(p.beam, p.token) for p in ps] for ps in out] == [[(p.beam, p.token) for p in ps] for ps in real_out]
        sure = beam_sampling.Layer(logits=torch.tensor([[0.0, 0.0, -float("inf")]]), scores=[0.0], drafts=[0, 1],
                                   logq=None, position=9, dynamic=False)  # P's support is the 2 drafts: a real pass
        one = beam_params([req])
        assert sorted((p.beam, p.token) for p in reads.run(real([sure], one))[0][0]) == [(0, 0), (0, 1)]
        (ps,), _ = reads.run(beam_sampling.verify([sure], one))
        assert any(p.beam * 3 + p.token not in sure.drafts for p in ps)  # rate 0: made to fail
    finally:
        set_acceptance.uninstall()
    assert beam_sampling.verify is real


def test_beam_forest_layers_pass_at_the_set_rate():
    """T > 0 beam requests, all layers in one call (``beam_sampling.verify_forests``): rate 1 passes every drafted
    layer with its first K drafts as outputs, then the bonus layer (no drafts) ends the request's layers; rate 0
    keeps the real first layer (here it rejects the drafts: the target's mass is on token 7) and ends there;
    uninstall restores the real function."""
    import torch

    from vllm_dsbd.engine import reads
    from vllm_dsbd.engine.beams import sampling as beam_sampling
    from vllm_dsbd.engine.beams.trie import beam_params, BeamRequest
    from vllm_dsbd.requests import BeamParams

    V = 8
    rows = torch.zeros(6, V)
    rows[:, 7] = 10.0
    q = torch.log_softmax(torch.zeros(2 * V), -1)
    plan = beam_sampling.Plan(leaves=rows[:2], scores=[0.0, -1.0], nodes=rows[2:], drafts=[[0, 1], [2, 3]],
                              joint=[[0 * V + 1, 1 * V + 2], [0 * V + 3, 1 * V + 4]], logq=[q, q], position=9,
                              layers=8, dynamic=False, eos=-1)
    req = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), 5, temperature=1.0, seed=3)
    params = beam_params([req])
    real = beam_sampling.verify_forests
    (real_out,) = reads.run(real([plan], params))
    assert len(real_out) == 1 and all(p.token == 7 for p in real_out[0][0])  # drafts rejected: one layer
    try:
        set_acceptance.install(1.0)
        assert beam_sampling.verify_forests is not real
        (out,) = reads.run(beam_sampling.verify_forests([plan], params))
        assert [[(p.beam, p.token) for p in ps] for ps, _ in out[:2]] == [[(0, 1), (1, 2)], [(0, 3), (1, 4)]]
        assert len(out) == 3 and [k for _, k in out[:2]] == [2, 2]  # then the bonus layer
        set_acceptance.set_rate(0.0)
        (out,) = reads.run(beam_sampling.verify_forests([plan], params))
        assert [[(p.beam, p.token) for p in ps] for ps, _ in out] == [[(p.beam, p.token) for p in real_out[0][0]]]
    finally:
        set_acceptance.uninstall()
    assert beam_sampling.verify_forests is real
