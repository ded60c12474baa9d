"""On the real vLLM 0.26.0: a forest the cost model asked of the draft-free sources and they did not build (none, or
shallower than asked, the scheduler cutting nothing) reaches the request's estimate as a failed layer
(``ShapePlanMixin._observe(..., asked)``), from forest steps and from bare steps alike, and the metrics count the built
layers only. The law of that counting is tests/unit/test_unbuilt_layers.py; this test is the wiring.

Tiny random Llama target, the default sources (recycle, lookup), a pinned flat cost table (forests always priced to
pay, so the model asks for them every step), greedy. Every call of the runner's ``_observe`` is recorded; replayed into
a fresh ``Acceptance`` per request it must give each request's live counts, and replayed without the unbuilt layers
(the rule until 2026-12-07, planted) it must not.
"""
from __future__ import annotations

from engine_utils import dsbd_llm, runner_of, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.engine import acceptance, cost  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [10, 20, 30, 10, 20], [100, 101, 102, 103]]
TABLE = {"target_ms": {"1": 10, "256": 10}, "draft_ms": {"1": 1, "256": 1}}


def test_asked_layers_the_sources_did_not_build_reach_the_estimates():
    target, _ = tiny_pair()
    with dsbd_llm(target, speculative_config={"method": "dsbd", "cost_model": TABLE}) as llm:
        runner = runner_of(llm)
        calls, observe = [], runner._observe

        def traced(st, kind, passed, depth, nodes, sub=None, asked=0):
            calls.append((st.req_id, passed, depth, nodes, asked, runner._dsbd_bare))
            return observe(st, kind, passed, depth, nodes, sub, asked)

        runner._observe = traced
        params = vllm.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        states = {c[0]: runner.dsbd_requests.get(c[0]) for c in calls}
        live = {r: (st.acceptance.passed, st.acceptance.tried) for r, st in states.items() if st is not None}
        metric = runner.dsbd_stats.pass_rates
    unbuilt = [c for c in calls if c[4] > c[2]]
    print(f"{len(calls)} observations, {len(unbuilt)} with layers asked and not built "
          f"({sum(c[2] == 0 for c in unbuilt)} with none built, {sum(c[5] for c in unbuilt)} on bare steps)")
    assert unbuilt, calls  # the sources fell short of what the model asked
    assert any(c[2] == 0 for c in unbuilt) and any(c[2] > 0 for c in calls), calls
    assert live, calls
    for req, counts in live.items():
        ours = [c for c in calls if c[0] == req]
        new, old = acceptance.Acceptance(), acceptance.Acceptance()
        for _, passed, depth, nodes, asked, _ in ours:
            new.observe(passed, max(depth, asked), None, nodes)
            if depth > 0:
                old.observe(passed, depth, None, nodes)
        assert (new.passed, new.tried) == counts, (req, ours)
        if any(asked > depth for _, _, depth, _, asked, _ in ours):  # planted: the old rule misses them
            assert (old.passed, old.tried) != counts, (req, ours)
    built = [c for c in calls if c[2] > 0]
    assert sum(v[1] for v in metric.values()) == sum(min(p + 1, d) for _, p, d, _, _, _ in built), metric
    assert cost.DRAFT in {k[0] for k in metric}
