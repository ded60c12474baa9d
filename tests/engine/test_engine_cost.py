"""The cost model in a real vLLM 0.26.0 engine on CPU (``engine/cost.py``), temperature 0.

Two DSBD engines (width 2, depth 3) with the same pinned cost table (flat target passes of 10 ms, draft passes of 4 ms:
a layer must pass with probability > 0.4 for depth 1 to pay), on the same tiny random Llama target:

* with an independently drawn random draft (it agrees with the target on almost no greedy token): after its first
  forests fail, the cost model switches drafting off, trying again now and then (after 1, 2, 4, ... idle steps);
  the engine's counts show depth 0 in most of the request-steps and few forests verified;
* with the target as its own draft (every layer passes): it keeps drafting, at the full depth 3 in most steps;
  its beam requests may draft N = 8 nodes per depth (``beam_nodes``, 4W): every N passes alike and flat passes make
  every N cost alike, so the model keeps N = 8 (ties keep the larger N);
* on both, plain greedy requests equal greedy decoding of the target (Hugging Face), and ``LLM.beam_search`` equals
  vLLM's own ``LLM.beam_search`` on a plain engine; the chosen depths reach ``vllm:dsbd_draft_depth``.

A third engine, the self-draft with ``beam_nodes`` 8 and a table whose target passes grow 0.2 ms a token (draft
passes 2 ms): at N = 8 no forest pays for the batch of 4 beam requests, at N = W = 2 it does (every N' starts at the
prior's rate), and the 2-forests pass their layers, so the model drafts N = 2, deeper as their layers pass; its beams
are still vLLM's, and the chosen N reach ``vllm:dsbd_beam_draft_nodes_chosen``.

And the start-up probe of ``cost_model="auto"`` runs on the engine's runner: target and draft tables from one token
on, positive times. An engine with ``cost_model="auto"`` (the table measured, corrected by the steps it ran,
``step_clock.py``), the target as its own draft (every layer passes) and 20 ms added to every target pass (as a large
target's; measured by the table) drafts in most request-steps, and its outputs are still greedy decoding's and vLLM's
beams; then long plain requests without and with a host delay injected into every drafting call: its clock's drafting
step's extra cost (``draft_step``) grows by at least half the delay. A pinned table has no clock.
The pass rates per source, kind of request and N reach Prometheus (``vllm:dsbd_draft_layers_{passed,tried}``): the
random draft's are low, the self-draft's near 1.
"""
from __future__ import annotations

import time

import pytest
import torch

from engine_utils import dsbd_llm, greedy_tokens, metric, runner_of  # sets the CPU engine environment before vllm
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.engine import step_clock  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn, tiny_llama_pair  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

WIDTH, DEPTH, MAX_TOKENS = 2, 3, 32
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [250, 3, 77, 12, 9]]
BEAM = BeamSearchParams(beam_width=WIDTH, max_tokens=16)
TABLE = {"target_ms": {"1": 10, "256": 10}, "draft_ms": {"1": 4, "256": 4}}
SLOPE = {"target_ms": {"1": 10, "256": 61}, "draft_ms": {"1": 2, "256": 2}}  # 0.2 ms a target token
BEAM_NODES = 8  # N of the self-drafted engines' beam requests (4W)
SLOW_TARGET = 0.02  # seconds added to every target pass of the auto engine (its table measures them)
DELAY = 0.1  # seconds of host work injected into every drafting call of the auto engine's last phase
DELAY_TOKENS = 200  # tokens per request in that phase: enough drafting windows for the clock's medians to see it
SPEC = ("vllm:spec_decode_num_drafts", "vllm:dsbd_beam_target_passes", "vllm:dsbd_beam_draft_nodes",
        "vllm:dsbd_beam_layers_passed", "vllm:dsbd_beam_steps")


@pytest.fixture(scope="module")
def models():
    """(target, random draft): the tiny target of the engine tests and an independently drawn 2-layer draft."""
    return tiny_llama_pair(vocab_size=400, seed=0, draft_init="random", init_std=0.1, target_layers=3, draft_layers=2)


def _measure_costs(worker):
    from vllm_dsbd.engine.load_probe import measure_costs

    table = measure_costs(getattr(worker, "worker", worker).model_runner)
    return dict(table.target), dict(table.draft)


def _phase(llm, fn):
    """``fn()``'s result, what it added to the counters ``SPEC`` and to the chosen depths {depth: request-steps}."""
    before = {k: metric(llm, k) or 0 for k in SPEC}
    l0 = llm.collective_rpc("dsbd_load")[0]
    out = fn()
    l1 = llm.collective_rpc("dsbd_load")[0]
    return {"out": out, **{k: (metric(llm, k) or 0) - before[k] for k in SPEC},
            **{key: {d: n - l0[key].get(d, 0) for d, n in l1[key].items() if n - l0[key].get(d, 0)}
               for key in ("depths", "nodes")}}


def _beams(llm):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BEAM)
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _requests(llm):
    def plain():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"plain": _phase(llm, plain), "beams": _phase(llm, lambda: _beams(llm))}


@pytest.fixture(scope="module")
def greedy(models):
    fn = next_token_logits_fn(load_hf(models[0]))
    with torch.no_grad():
        return [greedy_tokens(fn, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def vllm_beams(models):
    with dsbd_llm(models[0]) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BEAM)
        return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _engine(target, draft, table=TABLE, beam_nodes=None):
    return dsbd_llm(target, max_num_seqs=8, speculative_config={
        "method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH, "cost_model": table,
        "beam_nodes": beam_nodes})


@pytest.fixture(scope="module")
def bad(models, vllm_beams):  # vllm_beams first: one engine at a time
    target, draft = models
    with _engine(target, draft) as llm:
        out = _requests(llm)
        out["load"] = llm.collective_rpc("dsbd_load")[0]
        hist = metric(llm, "vllm:dsbd_draft_depth")
        out["hist"] = ({float(le): n for le, n in hist.buckets.items()}, hist.count)
        out["probe"] = llm.collective_rpc(_measure_costs)[0]
        out["rates"] = _pass_rates(llm)
        return out


@pytest.fixture(scope="module")
def self_draft(models, bad):
    target, _ = models
    with _engine(target, target, beam_nodes=BEAM_NODES) as llm:
        out = _requests(llm)
        out["rates"] = _pass_rates(llm)
        return out


def _pass_rates(llm) -> dict:
    """{(source, kind, nodes): (layers passed, layers tried)} from Prometheus."""
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:dsbd_draft_layers_passed", "vllm:dsbd_draft_layers_tried"):
            key = (m.labels["source"], m.labels["kind"], int(m.labels["nodes"]))
            got = out.setdefault(key, [0, 0])
            got[m.name.endswith("tried")] += m.value
    return out


@pytest.fixture(scope="module")
def auto(models, slope):
    """The self-draft with the table measured and corrected online, its target made ``SLOW_TARGET`` dearer per pass
    (as a large target would be; the tiny models' passes cost alike, so a draft the size of the target never pays by
    the table); then plain requests with a host delay injected into every drafting call (the drafter's
    ``propose_forests``). The engine core runs in this process: both go straight into its runner."""
    from vllm_dsbd.engine.load_probe import measure_costs

    target, _ = models
    with _engine(target, target, table="auto") as llm:
        runner = runner_of(llm)
        forward = runner.model.forward

        def slow_forward(*args, **kwargs):
            time.sleep(SLOW_TARGET)
            return forward(*args, **kwargs)

        runner.model.forward = slow_forward  # the target only: the draft is another module of the same weights
        runner.set_cost_table(measure_costs(runner), "measured again, slow target")
        out = _requests(llm)
        out["load"] = llm.collective_rpc("dsbd_load")[0]
        drafter = runner.drafter
        real = drafter.propose_forests

        def slow(jobs):
            if jobs:
                time.sleep(DELAY)
            return (yield from real(jobs))

        def long_requests():
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         vllm.SamplingParams(temperature=0, max_tokens=DELAY_TOKENS, ignore_eos=True), use_tqdm=False)
            return llm.collective_rpc("dsbd_load")[0]

        out["long"] = long_requests()
        drafter.propose_forests = slow
        try:
            out["delayed"] = long_requests()
        finally:
            del drafter.propose_forests
        return out


@pytest.fixture(scope="module")
def slope(models, self_draft):
    """The self-draft, ``beam_nodes`` 8, the sloped table: beam search; the N histogram; then beam sampling (T = 1)."""
    target, _ = models
    with _engine(target, target, table=SLOPE, beam_nodes=BEAM_NODES) as llm:
        out = _phase(llm, lambda: _beams(llm))
        hist = metric(llm, "vllm:dsbd_beam_draft_nodes_chosen")
        out["hist"] = ({float(le): n for le, n in hist.buckets.items()}, hist.count)
        beam = {"width": WIDTH, "max_tokens": 16, "ignore_eos": True}
        params = [vllm.SamplingParams(temperature=1.0, seed=s, max_tokens=16 * (WIDTH + 1) + 2, ignore_eos=True,
                                      detokenize=False, extra_args={"dsbd_beam": beam}) for s in range(len(PROMPTS))]
        out["sampled"] = _phase(llm, lambda: [o.kv_transfer_params["dsbd_beam"] for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
        return out


def test_outputs_equal_greedy_and_vllm_beams(bad, self_draft, slope, auto, greedy, vllm_beams):
    for run in (bad, self_draft, auto):
        assert run["plain"]["out"] == greedy
    for beams in (bad["beams"], self_draft["beams"], slope, auto["beams"]):
        # vLLM's beams, token for token and in order; their scores up to float32 rounding (another batch shape)
        assert [[t for t, _ in b] for b in beams["out"]] == [[t for t, _ in b] for b in vllm_beams]
        assert [[s for _, s in b] for b in beams["out"]] == [pytest.approx([s for _, s in b], abs=1e-4)
                                                             for b in vllm_beams]


def test_the_pinned_table_is_the_engines(bad):
    cost = bad["load"]["cost"]
    assert cost["target"] == pytest.approx({1: 0.010, 256: 0.010})
    assert cost["draft"] == pytest.approx({1: 0.004, 256: 0.004})
    assert bad["load"]["budget"] is None  # "auto" with the cost model on: no cap


def test_a_bad_draft_is_switched_off(bad):
    plain, beams = bad["plain"], bad["beams"]
    steps = len(PROMPTS) * (MAX_TOKENS - 1)  # decoding steps of the plain requests
    assert sum(plain["depths"].values()) >= steps
    # drafting off in most request-steps: the first forests and the tries after 1, 2, 4, ... idle steps only
    assert plain["depths"].get(0, 0) >= 0.6 * sum(plain["depths"].values()), plain["depths"]
    assert 0 < plain["vllm:spec_decode_num_drafts"] <= 0.4 * steps, plain
    assert beams["depths"].get(0, 0) >= 0.6 * sum(beams["depths"].values()), beams["depths"]
    assert beams["vllm:dsbd_beam_draft_nodes"] <= 0.4 * WIDTH * beams["vllm:dsbd_beam_steps"], beams


def test_a_self_draft_keeps_drafting(self_draft):
    plain, beams = self_draft["plain"], self_draft["beams"]
    for run in (plain, beams):
        assert run["depths"].get(0, 0) <= 0.1 * sum(run["depths"].values()), run["depths"]
        assert run["depths"].get(DEPTH, 0) >= 0.6 * sum(run["depths"].values()), run["depths"]
    # forests verified in most plain steps; beam forests pass layers: fewer target passes than beam steps
    assert plain["vllm:spec_decode_num_drafts"] >= 0.5 * len(PROMPTS) * MAX_TOKENS / (DEPTH + 1), plain
    assert beams["vllm:dsbd_beam_layers_passed"] > 0
    assert beams["vllm:dsbd_beam_target_passes"] < beams["vllm:dsbd_beam_steps"], beams


def test_chosen_depths_reach_prometheus(bad):
    buckets, count = bad["hist"]
    depths = bad["load"]["depths"]
    assert count == sum(depths.values()) and buckets[0.0] == depths[0]
    assert buckets[float(DEPTH)] == count  # nothing above the configured depth


def test_the_auto_probe_runs_on_the_engine(bad):
    target, draft = bad["probe"]
    for table in (target, draft):
        sizes = sorted(table)
        assert sizes[0] == 1 and sizes == [2 ** k for k in range(len(sizes))] and all(t > 0 for t in table.values())


def test_ties_keep_the_requested_n(self_draft):
    nodes = self_draft["beams"]["nodes"]
    assert nodes == {BEAM_NODES: sum(nodes.values())} and sum(nodes.values()) >= 0.6 * self_draft["beams"][
        "vllm:dsbd_beam_steps"] / (DEPTH + 1), self_draft["beams"]


def test_beam_sampling_chooses_n_too(slope):
    """At T = 1 (beam sampling) the model chooses N as well, from the forests verified at each N (no subforest is
    read at T > 0): N below the request's 8 pays on the sloped table, as at T = 0; every request still ends with W
    beams of 16 tokens."""
    run = slope["sampled"]
    print(f"T = 1: N chosen {run['nodes']}, depths {run['depths']}")
    total = sum(run["nodes"].values())
    # chosen, not requested: N below the request's 8 in most steps and N = W among them (the exploration of the wider
    # N keeps W from a majority at T > 0: 10 of 25 steps in one run)
    assert set(run["nodes"]) <= {2, 3, 4, 6, 8} and run["nodes"].get(WIDTH, 0) >= 0.25 * total
    assert sum(v for n, v in run["nodes"].items() if n < 8) >= 0.8 * total, run["nodes"]
    assert run["vllm:dsbd_beam_layers_passed"] > 0
    assert all(len(beams) == WIDTH and all(len(b["token_ids"]) == 16 for b in beams) for beams in run["out"])


def test_a_smaller_n_where_the_full_n_does_not_pay(slope):
    nodes, depths = slope["nodes"], slope["depths"]
    print(f"N chosen {nodes}, depths {depths}, counters", {k: slope[k] for k in SPEC})
    assert set(nodes) <= {2, 3, 4, 6, 8} and nodes.get(WIDTH, 0) >= 0.8 * sum(nodes.values()), nodes
    assert depths.get(0, 0) <= 0.2 * sum(depths.values()), depths  # it drafts (at N = 8 nothing would pay)
    assert slope["vllm:dsbd_beam_layers_passed"] > 0
    assert slope["vllm:dsbd_beam_target_passes"] < 0.6 * slope["vllm:dsbd_beam_steps"], slope
    buckets, count = slope["hist"]  # the engine's whole life: this phase only
    assert count == sum(nodes.values()) and buckets[float(WIDTH)] == nodes[WIDTH] and buckets[8.0] == count


def test_an_auto_engine_with_a_draft_that_pays_drafts(auto):
    # (its outputs: greedy decoding's and vLLM's beams, test_outputs_equal_greedy_and_vllm_beams)
    print("auto engine: depths", {k: auto[k]["depths"] for k in ("plain", "beams")}, "clock", auto["load"]["clock"],
          "cost", {k: auto["load"]["cost"][k] for k in ("step", "draft_step")})
    # the engine's first requests: its warm-up (step_clock.WARMUP decode steps, unmeasured) drafts nothing
    warmup = step_clock.WARMUP * len(PROMPTS)
    for run, skip in ((auto["plain"], warmup), (auto["beams"], 0)):
        assert run["depths"].get(0, 0) - skip <= 0.4 * (sum(run["depths"].values()) - skip), run["depths"]
    assert auto["plain"]["vllm:spec_decode_num_drafts"] > 0 and auto["beams"]["vllm:dsbd_beam_layers_passed"] > 0


def test_the_auto_table_is_corrected_by_measured_steps(auto, bad):
    """The same long plain requests without and with ``DELAY`` injected into every drafting call: the clock's
    drafting extra (``draft_step`` plus ``node`` per forest node at the measured windows' nodes; medians over the last
    ``WINDOW`` windows, each phase longer than that) is at least a quarter of the delay with it: a clock that charged
    drafting to no window, or to every window alike, would leave it near 0 (the old clamp at 0 made ``draft_step >= 0``
    unfailable). Not the growth over the phase without the delay: on 2 loaded
    cores that phase alone once measured 57 ms (the self-draft runs the slow target), so the difference is load-bound
    (+18 ms for a 50 ms delay once, +12 ms for 100 ms under the full suite)."""
    before, delayed = auto["long"], auto["delayed"]
    print(f"injected {1e3 * DELAY:.0f} ms per drafting call: draft_step {1e3 * delayed['cost']['draft_step']:.1f} ms "
          f"(without: {1e3 * before['cost']['draft_step']:.1f} ms), node {1e3 * delayed['cost']['node']:.2f} ms; "
          f"clock {delayed['clock']}; depths {delayed['depths']}")
    assert before["clock"]["steps"] - auto["load"]["clock"]["steps"] >= step_clock.WINDOW, before["clock"]
    assert delayed["clock"]["steps"] - before["clock"]["steps"] >= step_clock.WINDOW, delayed["clock"]
    # the extra the table now charges a window with the measured forests (a fixed part and one per node, whichever
    # way the clock's fit splits it: all per node where every window held as many nodes)
    extra = delayed["cost"]["draft_step"] + 0.5 * delayed["cost"]["node"] * delayed["clock"]["forest_nodes"]
    assert extra >= 0.25 * DELAY, delayed
    assert bad["load"]["clock"] is None  # a pinned table is not corrected


def test_pass_rates_per_source_and_n_reach_prometheus(bad, self_draft):
    print("pass rates: random draft", bad["rates"], "self-draft", self_draft["rates"])
    for run in (bad, self_draft):
        assert {k for k, _, _ in run["rates"]} == {"model"} and {k for _, k, _ in run["rates"]} == {"plain", "beam"}
    passed, tried = map(sum, zip(*bad["rates"].values()))
    assert tried > 0 and passed <= 0.2 * tried
    assert all(p >= 0.8 * t > 0 for p, t in self_draft["rates"].values()), self_draft["rates"]
    assert {n for _, k, n in self_draft["rates"] if k == "beam"} == {BEAM_NODES}
