"""The DSBD step stays on the device (issue 15 item 2), checked on CPU with a simulated accelerator (``sim_device``).

A real vLLM 0.26.0 engine (tiny Llama pair, width 2 and width 1 (the sampler's chain fast path), depth 3, pinned draft
shape, temperature 1 and 0, EOS as an ordinary token and as a stop) runs with the simulated device active inside the
drafter's ``propose_forests`` (the draft model's forward itself runs unobserved; its logits are tagged as device
tensors), inside the sampler's ``verify`` and inside the runner's gathering of beam requests' logits (the target's
logits tagged). Checked:

* no operation mixes a device tensor with a host tensor (each would raise on CUDA);
* the forests handed from the drafter to the sampler are device tensors, and so is the draft joint;
* the host synchronisations of a call do not grow with the batch: at batch 16 no source line synchronises more than
  (depth + 1) x width (<= 8) times in a call (once per layer and draft at most: a read per request would make 16), and
  a call makes at most twice the synchronisations of a call at batch 1 (data-dependent branches taken more often);
  the counts and lines are printed;
* beam requests (``LLM.beam_search``, width-2 engine): their logits rows of a step come to the host in one copy;
* the outputs are those of the same engine without the simulated device (it observes, it changes nothing);
* width 1 with the static chain path (``core/chain_static.py``, what the sampler runs on a GPU, forced here): each
  verification makes one host synchronisation (its results' copy), drafting one per depth, and the outputs equal
  the CPU's row-subset chain path's.
"""
from __future__ import annotations

import collections

import pytest

from engine_utils import shutdown  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import sim_device  # noqa: E402
from vllm_dsbd.models import tiny_llama_pair  # noqa: E402

DEPTH, MAX_TOKENS = 3, 10
PROMPTS = [[5 + k, 6 + 2 * k, 7 + 3 * k] for k in range(16)]


class Observer:
    """Runs the drafter's and the sampler's entry points under a SimulatedDevice, one per call, and keeps them."""

    def __init__(self, chain_static: bool | None = None):
        self.chain_static = chain_static
        self.calls: list[tuple[str, int, sim_device.SimulatedDevice]] = []
        self.forest_tensors: list[bool] = []
        self.active = False

    def install(self, monkeypatch):
        from vllm_dsbd.engine import drafter, sampler

        orig_verify, orig_propose, orig_forward = sampler.verify, drafter.DSBDDrafter.propose_forests, \
            drafter.DSBDDrafter._forward
        obs = self

        def verify(logits, rows, cfg):
            if not obs.active:
                return orig_verify(logits, rows, cfg)  # the reference runs: the CPU's default path
            for r in rows:
                if r.forest is not None:
                    f = r.forest.forest
                    obs.forest_tensors.append(all(sim_device.on_device(t) for t in (f.valid, f.q_joint, f.parent)))
            mode = sim_device.SimulatedDevice()
            with mode:
                out = orig_verify(sim_device.tag(logits), rows, cfg, chain_static=obs.chain_static)
            obs.calls.append(("verify", len(rows), mode))
            return out

        def propose(self, jobs):
            if not obs.active or not jobs:
                return orig_propose(self, jobs)
            mode = sim_device.SimulatedDevice()
            self._sim_mode = mode
            with mode:
                out = orig_propose(self, jobs)
            obs.calls.append(("propose", len(jobs), mode))
            return out

        def forward(self, *args, **kwargs):
            mode = getattr(self, "_sim_mode", None)
            if not obs.active or mode is None:
                return orig_forward(self, *args, **kwargs)
            with mode.paused():  # the draft model's own forward (vLLM's) is not what this checks
                out = orig_forward(self, *args, **kwargs)
            return sim_device.tag(out)

        from vllm_dsbd.engine import runner as runner_mod

        orig_beam_rows = runner_mod._beam_logits_on_host

        def beam_rows(logits, plan, discard):
            if not obs.active:
                return orig_beam_rows(logits, plan, discard)
            mode = sim_device.SimulatedDevice()
            with mode:
                out = orig_beam_rows(sim_device.tag(logits), plan, discard)
            if out:
                obs.calls.append(("beam_rows", len(out), mode))
            return out

        monkeypatch.setattr(runner_mod, "_beam_logits_on_host", beam_rows)
        monkeypatch.setattr(sampler, "verify", verify)
        monkeypatch.setattr(drafter.DSBDDrafter, "propose_forests", propose)
        monkeypatch.setattr(drafter.DSBDDrafter, "_forward", forward)


@pytest.fixture(scope="module", params=[(2, None), (1, None), (1, True)], ids=["width2", "width1", "width1-static"])
def runs(request):
    width, chain_static = request.param
    target, draft = tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                                    draft_layers=2)
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                   enable_prefix_caching=False, max_num_seqs=16,
                   speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                       "width": width, "verify_budget": None})
    mp = pytest.MonkeyPatch()
    obs = Observer(chain_static)
    obs.install(mp)

    def gen(prompts, temperature, eos_stop):
        sp = [vllm.SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=k, ignore_eos=not eos_stop)
              for k in range(len(prompts))]
        return [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]

    def beams(prompts):  # beam requests: their logits rows come to the host in one copy per step
        from vllm.sampling_params import BeamSearchParams

        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=2, max_tokens=6))
        return [[list(s.tokens) for s in o.sequences] for o in outs]

    cases = [("one", PROMPTS[:1], 1.0, False), ("many", PROMPTS, 1.0, False), ("greedy", PROMPTS[:4], 0.0, True)]
    try:
        plain = {name: gen(p, t, e) for name, p, t, e in cases}
        plain["beams"] = beams(PROMPTS[:4]) if width >= 2 else None
        obs.active = True
        out = {}
        for name, p, t, e in cases:
            n0 = len(obs.calls)
            out[name] = gen(p, t, e)
            out[name + "_calls"] = obs.calls[n0:]
        n0 = len(obs.calls)
        out["beams"] = beams(PROMPTS[:4]) if width >= 2 else None
        out["beams_calls"] = obs.calls[n0:]
        out["plain"], out["forests_on_device"], out["width"] = plain, obs.forest_tensors, width
        out["static"] = chain_static
        return out
    finally:
        mp.undo()
        shutdown(llm)


def test_no_operation_mixes_device_and_host_tensors(runs):
    calls = runs["one_calls"] + runs["many_calls"] + runs["greedy_calls"]
    assert {k for k, _, _ in calls} == {"verify", "propose"}
    bad = [m for _, _, mode in calls for m in mode.mismatches]
    assert bad == [], bad[:5]


def test_forests_reach_the_sampler_on_the_device(runs):
    assert len(runs["forests_on_device"]) > len(PROMPTS) and all(runs["forests_on_device"])


def test_syncs_per_call_do_not_grow_with_the_batch(runs):
    R, bound = len(PROMPTS), (DEPTH + 1) * runs["width"]
    assert bound < R
    for kind in ("propose", "verify"):
        one = [sum(m.syncs.values()) for k, n, m in runs["one_calls"] if k == kind and n == 1]
        many = [m for k, n, m in runs["many_calls"] if k == kind and n == R]
        assert one and many and max(one) > 0
        sites = collections.Counter()
        for m in many:
            sites.update(m.syncs)
        print(f"{kind}: syncs per call at batch 1 {min(one)}..{max(one)}, at batch {R} "
              f"{min(sum(m.syncs.values()) for m in many)}..{max(sum(m.syncs.values()) for m in many)}; "
              f"lines over {len(many)} calls: {sites.most_common()}")
        for m in many:
            worst = max(m.syncs.values())
            assert worst <= bound, (kind, m.syncs.most_common(3))
            assert sum(m.syncs.values()) <= 2 * max(one), (kind, m.syncs.most_common())


def test_drafting_syncs_once_per_depth(runs):
    """The drafter reads nothing from the device but its one host copy per depth (each depth's draws), and at width 1
    one copy in all (``DSBDDrafter._draft_chains``): the core's branches on the requests' settings read host values
    (``BatchParams.facts``)."""
    calls = [m for k, _, m in runs["one_calls"] + runs["many_calls"] if k == "propose"]
    assert calls
    for m in calls:
        assert set(m.syncs) == {next(iter(m.syncs))} and next(iter(m.syncs)).startswith("engine/drafter.py"), m.syncs
        assert sum(m.syncs.values()) <= (1 if runs["width"] == 1 else DEPTH), m.syncs


@pytest.mark.parametrize("runs", [(1, True)], indirect=True, ids=["width1-static"])
def test_static_chain_verification_syncs_once(runs):
    assert runs["static"]
    calls = [m for k, _, m in runs["one_calls"] + runs["many_calls"] + runs["greedy_calls"] if k == "verify"]
    assert calls
    for m in calls:
        assert sum(m.syncs.values()) == 1 and next(iter(m.syncs)).startswith("engine/sampler.py"), m.syncs


def test_observing_changes_nothing(runs):
    for name in ("one", "many", "greedy", "beams"):
        assert runs[name] == runs["plain"][name]


# beam search W = 2 needs an engine width >= 2
@pytest.mark.parametrize("runs", [(2, None)], indirect=True, ids=["width2"])
def test_beam_requests_logits_come_over_in_one_copy(runs):
    """Beam requests keep their beam steps on the host; their logits rows of a step come over in one copy (not one or
    two per request), without mixing device and host tensors."""
    calls = [(n, m) for k, n, m in runs["beams_calls"] if k == "beam_rows"]
    assert calls and max(n for n, _ in calls) == 4  # the 4 beam requests together in a step
    for n, m in calls:
        assert m.mismatches == [] and sum(m.syncs.values()) == 1, (n, m.syncs, m.mismatches[:3])
