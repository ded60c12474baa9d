"""The DSBD step stays on the device (few host synchronisations per step, none growing with the batch), checked on
CPU with a simulated accelerator (``sim_device``).

A real vLLM 0.26.0 engine (tiny Llama pair, width 2 and width 1 (the sampler's chain fast path), depth 3, pinned draft
shape, temperature 1 and 0, EOS as an ordinary token and as a stop) runs with the simulated device active inside the
drafter's ``propose_forests`` (the draft model's forward itself runs unobserved; its logits are tagged as device
tensors), inside the sampler's ``verify``, and for beam requests (``LLM.beam_search`` at T = 0 and seeded beam
sampling at T = 1 through ``extra_args["dsbd_beam"]``) inside the runner's gathering of their rows, their beam steps
and the beam drafter (the target's logits tagged). Checked:

* no operation mixes a device tensor with a host tensor (each would raise on CUDA);
* the forests handed from the drafter to the sampler are device tensors, and so is the draft joint;
* the host synchronisations of a call do not grow with the batch: at batch 16 no source line synchronises more than
  (depth + 1) x width (<= 8) times in a call (once per layer and draft at most: a read per request would make 16), and
  a call makes at most twice the synchronisations of a call at batch 1 (data-dependent branches taken more often);
  the counts and lines are printed;
* beam requests (width-2 engine): no logits row (nor a joint over the vocabulary) comes to the host, in the target's
  beam steps or in the draft's; a step's beam steps of all requests read the device once at T = 0 (their rows' best
  tokens), once at T > 0 (the beam step of the requests without a forest beside every verified layer of those
  with one, the runner's ``dsbd_static_layers`` as on a device: the outputs equal the CPU's one read per layer), the beam
  drafter once per call (all depths' pairs in one copy);
* the plain requests' drafter reads the device once per call (all depths' draws in one copy), at width 1 and 2;
* the outputs are those of the same engine without the simulated device (it observes, it changes nothing);
* the static paths (what the sampler runs on a GPU, forced here): width 1 the chain path (``core/chain_static.py``),
  width 2 the forest path (``core/verify_static.py``): each verification makes one host synchronisation (its
  results' copy), and the outputs equal the CPU's row-subset paths'.
"""
from __future__ import annotations

import collections

import pytest

from engine_utils import dsbd_llm, runner_of, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import sim_device  # noqa: E402
from vllm_dsbd.engine import reads  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

DEPTH, MAX_TOKENS = 3, 10
PROMPTS = [[5 + k, 6 + 2 * k, 7 + 3 * k] for k in range(16)]


class Observer:
    """Runs the drafter's and the sampler's entry points under a SimulatedDevice, one per call, and keeps them."""

    def __init__(self, static: bool | None = None):
        self.static = static
        self.calls: list[tuple[str, int, sim_device.SimulatedDevice]] = []
        self.forest_tensors: list[bool] = []
        self.active = False
        self.current = None  # the mode of the entry point running (its reads' shapes: ``mode.fetched``)

    def observe(self, mode, reader):
        """Runs a reader (``engine/reads.py``) to its result under ``mode``, its reads counted there (each entry
        point is observed alone, its reads not merged with the step's other work: that is
        ``test_engine_step_reads.py``), and the shapes of the tensors it reads kept (``mode.fetched``)."""
        self.current = mode
        try:
            with mode:
                return reads.run(reader)
        finally:
            self.current = None

    def install(self, monkeypatch):
        from vllm_dsbd.engine import drafter, sampler

        orig_verify, orig_propose, orig_forward = sampler.verify, drafter.DSBDDrafter.propose_forests, \
            drafter.DSBDDrafter.forward_ragged
        orig_fetch = reads.fetch
        obs = self

        def fetch(tensors):
            if obs.current is not None:
                obs.current.fetched.extend(tuple(t.shape) for t in tensors)
            return orig_fetch(tensors)

        def verify(logits, rows, cfg, **kw):  # readers, as the entry points they wrap
            if not obs.active:
                return (yield from orig_verify(logits, rows, cfg, **kw))  # the reference runs: the CPU's default path
            for r in rows:
                if r.forest is not None:
                    f = r.forest.forest
                    obs.forest_tensors.append(all(sim_device.on_device(t) for t in (f.valid, f.q_joint, f.parent)))
            mode = sim_device.SimulatedDevice()
            out = obs.observe(mode, orig_verify(sim_device.tag(logits), rows, cfg, **{**kw, "chain_static": obs.static,
                                                                                     "forest_static": obs.static}))
            obs.calls.append(("verify", len(rows), mode))
            return out

        def propose(self, jobs):
            if not obs.active or not jobs:
                return (yield from orig_propose(self, jobs))
            mode = sim_device.SimulatedDevice()
            self._sim_mode = mode
            misses = self.static_misses
            out = obs.observe(mode, orig_propose(self, jobs))
            mode.static_miss = self.static_misses > misses  # the static drafter's bet failed: the loop drafted
            obs.calls.append(("propose", len(jobs), mode))
            return out

        from vllm_dsbd.engine import proposing as proposing_mod
        from vllm_dsbd.engine import runner as runner_mod

        orig_beam_step = runner_mod.DSBDRunnerMixin._beam_steps
        orig_propose_beams = proposing_mod.propose_beam_forests

        def beam_step(self, plan, logits, ks, results, moves):  # a step's beam requests of one kind: rows, steps
            if not obs.active:
                return (yield from orig_beam_step(self, plan, logits, ks, results, moves))
            mode = sim_device.SimulatedDevice()
            out = obs.observe(mode, orig_beam_step(self, plan, sim_device.tag(logits), ks, results, moves))
            obs.calls.append(("beam_step", len(ks), mode))
            return out

        def propose_beams(drafter_, jobs):
            if not obs.active or not jobs:
                return (yield from orig_propose_beams(drafter_, jobs))
            mode = sim_device.SimulatedDevice()
            drafter_._sim_mode = mode
            try:
                out = obs.observe(mode, orig_propose_beams(drafter_, jobs))
            finally:
                drafter_._sim_mode = None
            obs.calls.append(("propose_beams", len(jobs), mode))
            return out

        monkeypatch.setattr(reads, "fetch", fetch)
        monkeypatch.setattr(runner_mod.DSBDRunnerMixin, "_beam_steps", beam_step)
        monkeypatch.setattr(proposing_mod, "propose_beam_forests", propose_beams)
        monkeypatch.setattr(sampler, "verify", verify)
        monkeypatch.setattr(drafter.DSBDDrafter, "propose_forests", propose)
        monkeypatch.setattr(drafter.DSBDDrafter, "forward_ragged", sim_device.draft_forward(orig_forward, lambda: obs.active))


@pytest.fixture(scope="module", params=[(2, None), (1, None), (1, True), (2, True)],
                ids=["width2", "width1", "width1-static", "width2-static"])
def runs(request):
    width, static = request.param
    target, draft = tiny_pair()
    with dsbd_llm(target, max_num_seqs=16, disable_log_stats=True,  # vLLM's default
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": width, "verify_budget": None}) as llm:
        mp = pytest.MonkeyPatch()
        obs = Observer(static)
        obs.install(mp)

        def gen(prompts, temperature, eos_stop):
            sp = [vllm.SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=k, ignore_eos=not eos_stop)
                  for k in range(len(prompts))]
            return [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]

        def beams(prompts):  # beam search (T = 0)
            from vllm.sampling_params import BeamSearchParams

            outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                   BeamSearchParams(beam_width=2, max_tokens=6))
            return [[list(s.tokens) for s in o.sequences] for o in outs]

        def sampled_beams(prompts):  # seeded beam sampling (T = 1), fixed and dynamic width
            beam = {"width": 2, "max_tokens": 6}
            sp = [vllm.SamplingParams(temperature=1.0, seed=k, max_tokens=6 * 3 + 2, ignore_eos=True, detokenize=False,
                                      extra_args={"dsbd_beam": {**beam, "dynamic_width": k % 2 == 1}})
                  for k in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return [[(b["token_ids"], b["cum_logprob"]) for b in o.kv_transfer_params["dsbd_beam"]] for o in outs]

        cases = [("one", PROMPTS[:1], 1.0, False), ("many", PROMPTS, 1.0, False), ("greedy", PROMPTS[:4], 0.0, True)]
        try:
            plain = {name: gen(p, t, e) for name, p, t, e in cases}
            plain["beams"] = beams(PROMPTS[:4]) if width >= 2 else None
            plain["sampled_beams"] = sampled_beams(PROMPTS[:4]) if width >= 2 else None
            obs.active = True
            out = {}
            for name, p, t, e in cases:
                n0 = len(obs.calls)
                out[name] = gen(p, t, e)
                out[name + "_calls"] = obs.calls[n0:]
            n0 = len(obs.calls)
            out["beams"] = beams(PROMPTS[:4]) if width >= 2 else None
            out["beams_calls"] = obs.calls[n0:]
            n0 = len(obs.calls)
            runner = runner_of(llm)
            cpu_layers, runner.dsbd_static_layers = runner.dsbd_static_layers, True  # what a device runs (the CPU: False)
            try:
                out["sampled_beams"] = sampled_beams(PROMPTS[:4]) if width >= 2 else None
            finally:
                runner.dsbd_static_layers = cpu_layers
            out["sampled_beams_calls"] = obs.calls[n0:]
            out["plain"], out["forests_on_device"], out["width"] = plain, obs.forest_tensors, width
            out["static"] = static
            return out
        finally:
            mp.undo()


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


def test_drafting_syncs_once(runs):
    """The drafter reads nothing from the device but one host copy of all depths' draws: at width 1
    ``DSBDDrafter._draft_chains``, at width 2 ``DSBDDrafter._draft_static`` (whose bet, every request's draws filling
    its width, holds on every call here; when it fails the general loop makes one copy per depth): the core's
    branches on the requests' settings read host values (``BatchParams.facts``)."""
    calls = [m for k, _, m in runs["one_calls"] + runs["many_calls"] + runs["greedy_calls"] if k == "propose"]
    assert calls
    for m in calls:
        assert set(m.syncs) == {next(iter(m.syncs))} and next(iter(m.syncs)).startswith("engine/reads.py"), m.syncs
        assert not m.static_miss
        assert sum(m.syncs.values()) == 1, m.syncs


@pytest.mark.parametrize("runs", [(1, True), (2, True)], indirect=True, ids=["width1-static", "width2-static"])
def test_static_verification_syncs_once(runs):
    """The static paths (what a GPU runs: ``core/chain_static.py`` at width 1, ``core/verify_static.py`` at width
    2; forced here) read the device once per verification (the results' copy), and their outputs equal the CPU's
    row-subset paths' (``test_observing_changes_nothing`` on this engine)."""
    assert runs["static"]
    calls = [m for k, _, m in runs["one_calls"] + runs["many_calls"] + runs["greedy_calls"] if k == "verify"]
    assert calls
    for m in calls:
        assert sum(m.syncs.values()) == 1 and next(iter(m.syncs)).startswith("engine/reads.py"), m.syncs


def test_observing_changes_nothing(runs):
    for name in ("one", "many", "greedy", "beams", "sampled_beams"):
        assert runs[name] == runs["plain"][name]


# beam requests of width 2 need an engine width >= 2
@pytest.mark.parametrize("runs", [(2, None)], indirect=True, ids=["width2"])
def test_beam_requests_stay_on_the_device(runs):
    """Beam requests' target beam steps and draft beam steps run on the device: no operation mixes device and host
    tensors, and nothing the size of a vocabulary row comes to the host (what does: the rows' best tokens at T = 0,
    each layer's outputs at T > 0, each depth's draft pairs). A step's beam steps read the device once for all
    requests at T = 0, at most twice at T > 0 (the requests without a forest, then every layer of those with one),
    and the drafter once per call."""
    V = 400
    for name in ("beams_calls", "sampled_beams_calls"):
        calls = runs[name]
        kinds = collections.Counter(k for k, _, _ in calls)
        assert kinds["beam_step"] and kinds["propose_beams"], kinds
        assert max(n for k, n, _ in calls if k == "beam_step") == 4  # the 4 beam requests together in a step
        for k, n, m in calls:
            assert m.mismatches == [], (name, k, m.mismatches[:3])
            # what is read: the tensors the readers hand to ``reads.fetch`` (which copies their bytes in one
            # flat tensor), and any other host copy
            wide = [(w, shape) for w, shape in m.host_copies if not w.startswith("engine/reads.py")
                    and shape and shape[-1] >= V] + [("fetched", s) for s in m.fetched if s and s[-1] >= V]
            assert m.fetched, (name, k)
            assert wide == [], (name, k, wide[:3])
        steps = [sum(m.syncs.values()) for k, _, m in calls if k == "beam_step"]
        drafts = [sum(m.syncs.values()) for k, _, m in calls if k == "propose_beams"]
        print(f"{name}: syncs per step of the beam requests {min(steps)}..{max(steps)}, per drafting call "
              f"{min(drafts)}..{max(drafts)}; lines: "
              f"{sum((m.syncs for k, _, m in calls), collections.Counter()).most_common(6)}")
        lines = {line for _, _, m in calls for line in m.syncs}
        assert all(line.startswith(("engine/reads.py", "engine/beams/step.py", "engine/beams/drafter.py",
                                    "engine/beams/sampling.py", "engine/beams/trie.py"))
                   for line in lines), lines
        assert all(s == 1 for s in drafts), drafts  # the drafter: once per call (``beam_drafter._draft_static``)
        # T = 0: the rows' best tokens, once for all requests; T > 0: once for the requests without a forest (one
        # beam step) and all layers of the ones with one (``beam_sampling.verify_forests``) side by side
        # (``reads.gather``; was once per verified layer, then twice)
        assert set(steps) == {1}, steps
