"""A step mixing every kind of work reads the device once to verify and once to draft (one host copy per round for
all its kinds of work, ``engine/reads.py``), real vLLM 0.26.0 on CPU with the simulated device (``sim_device``).

One engine of width 2 (tiny random Llama pair, depth 3, pinned speculation, the static paths a device runs:
``VLLM_DSBD_STATIC_VERIFY=1``, the runner's ``dsbd_static_layers``) serves one batch mixing plain requests (seeded T = 1),
beam search requests (T = 0) and seeded beam sampling requests (T = 1) through ``extra_args["dsbd_beam"]``, so most
steps verify and draft all three kinds. The runner's whole verification (``_sample``: plain verification, the T = 0
and T > 0 beam steps) and whole drafting (``propose_draft_token_ids``: plain and beam forests) each run under a
simulated device (the draft model's own forward unobserved, its logits tagged as device tensors). Checked:

* every ``_sample`` call reads the device once, and so does every drafting call whose static bets held, including
  the steps that mixed all three kinds (their readers side by side: ``reads.gather``); with ``reads.MERGE = False``
  (one read per kind, as before) the same steps read once per kind, so the count can tell the two apart;
* no operation mixes a device tensor with a host one;
* the outputs (plain tokens, beams and their scores) are the same with and without merging and without the
  simulated device, and drafts were made and accepted (the engine's counters), so nothing passes vacuously;
* with a plain and a beam sampling request at top-k 1 (width 2), the static draft loops' bets fail (counted) and
  those calls fall back to the general loops inside the gathered readers (several rounds): the outputs are still the
  same merged, apart and unobserved.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    dsbd_llm, metric, runner_of, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import sim_device  # noqa: E402
from vllm_dsbd.engine import reads  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

STEPS, MAX_TOKENS = 8, 16
PROMPTS = [[5 + k, 6 + 2 * k, 7 + 3 * k] for k in range(4)]


def _params(narrow: bool = False):
    """Per prompt: a plain request, a beam search and a beam sampling request. ``narrow``: the first plain and the
    first beam sampling request draw from top-k 1 at width 2, which breaks the static draft loops' bet (one draw per
    depth): their calls fall back to the general loops, which read once per depth inside the gathered readers."""
    out = []
    for k in range(len(PROMPTS)):
        top_k = 1 if narrow and k == 0 else 0
        out.append(vllm.SamplingParams(temperature=1.0, seed=k, top_k=top_k, max_tokens=MAX_TOKENS, ignore_eos=True))
        beam = {"width": 2, "max_tokens": STEPS, "ignore_eos": True}
        n = STEPS * 3 + 2
        out.append(vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                                       extra_args={"dsbd_beam": beam}))
        out.append(vllm.SamplingParams(temperature=1.0, seed=20 + k, top_k=top_k, max_tokens=n, ignore_eos=True,
                                       detokenize=False,
                                       extra_args={"dsbd_beam": {**beam, "dynamic_width": k % 2 == 1}}))
    return out


def _kinds(plan) -> frozenset:
    out = set()
    for row in plan:
        b = row.state.beam
        out.add("plain" if b is None else "beam_t0" if b.temperature <= 0.0 else "beam_t1")
    return frozenset(out)


class StepObserver:
    """Runs the runner's ``_sample`` and ``propose_draft_token_ids`` under a SimulatedDevice each, and keeps them."""

    def __init__(self):
        self.calls: list[tuple[str, frozenset, sim_device.SimulatedDevice, bool]] = []
        self.active = False

    def install(self, mp, runner):
        from vllm_dsbd.engine import drafter as drafter_mod
        from vllm_dsbd.engine import runner as runner_mod

        mixin = runner_mod.DSBDRunnerMixin
        orig_sample, orig_propose = mixin._sample, mixin.propose_draft_token_ids
        orig_forward = drafter_mod.DSBDDrafter.forward_ragged
        obs, drafter = self, runner.drafter
        for planes in runner._kv_planes().values():  # the KV cache lives on the device too (the K/V moves)
            sim_device.tag(planes.planes)

        def sample(self, logits, meta):
            if not obs.active:
                return orig_sample(self, logits, meta)
            kinds = _kinds(self._dsbd_plan)
            mode = sim_device.SimulatedDevice()
            with mode:
                out = orig_sample(self, sim_device.tag(logits), meta)
            obs.calls.append(("verify", kinds, mode, False))
            return out

        def propose(self, *args, **kwargs):
            if not obs.active:
                return orig_propose(self, *args, **kwargs)
            mode = sim_device.SimulatedDevice()
            misses = drafter.static_misses + drafter.beam_static_misses
            drafter._sim_mode = mode
            try:
                with mode:
                    out = orig_propose(self, *args, **kwargs)
            finally:
                drafter._sim_mode = None
            kinds = frozenset(("plain" if st.beam is None else "beam") for req_id in self.input_batch.req_ids
                              if (st := self.dsbd_requests.get(req_id)) is not None)
            missed = drafter.static_misses + drafter.beam_static_misses > misses  # a bet failed: the loops drafted
            obs.calls.append(("draft", kinds, mode, missed))
            return out

        mp.setattr(mixin, "_sample", sample)
        mp.setattr(mixin, "propose_draft_token_ids", propose)
        mp.setattr(drafter_mod.DSBDDrafter, "forward_ragged", sim_device.draft_forward(orig_forward, lambda: obs.active))


@pytest.fixture(scope="module")
def runs():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_DSBD_STATIC_VERIFY", "1")  # the static paths a device runs (the runner sets dsbd_static_layers)
    target, draft = tiny_pair()
    with dsbd_llm(target, max_num_seqs=len(PROMPTS) * 3,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                      "width": 2, "verify_budget": None}) as llm:
        runner = runner_of(llm)
        obs = StepObserver()
        obs.install(mp, runner)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]

        def gen(narrow: bool = False):
            outs = llm.generate(prompts, _params(narrow), use_tqdm=False)
            return [list(o.outputs[0].token_ids) if o.kv_transfer_params is None
                    else [(b["token_ids"], b["cum_logprob"]) for b in o.kv_transfer_params["dsbd_beam"]] for o in outs]

        out = {"static_layers": runner.dsbd_static_layers}
        try:
            out["plain"] = gen()
            obs.active = True
            for merge in (True, False):
                mp.setattr(reads, "MERGE", merge)
                counts = [metric(llm, c) or 0 for c in ("vllm:spec_decode_num_accepted_tokens",
                                                         "vllm:dsbd_beam_draft_nodes", "vllm:dsbd_beam_layers_passed")]
                n0 = len(obs.calls)
                out[merge] = gen()
                out[f"calls_{merge}"] = obs.calls[n0:]
                out[f"counts_{merge}"] = [metric(llm, c) - b for c, b in zip(
                    ("vllm:spec_decode_num_accepted_tokens", "vllm:dsbd_beam_draft_nodes",
                     "vllm:dsbd_beam_layers_passed"), counts)]
            drafter = runner.drafter
            narrow_runs = (("narrow", False, True), ("narrow_True", True, True), ("narrow_False", True, False))
            for name, active, merge in narrow_runs:
                obs.active = active
                mp.setattr(reads, "MERGE", merge)
                drafter._static_skip = drafter._static_backoff = 0
                drafter.beam_static_skip = drafter.beam_static_backoff = 0
                misses = drafter.static_misses, drafter.beam_static_misses
                out[name] = gen(narrow=True)
                out[name + "_misses"] = (drafter.static_misses - misses[0], drafter.beam_static_misses - misses[1])
        finally:
            mp.undo()
    return out


def _reads(m: sim_device.SimulatedDevice) -> int:
    return sum(m.syncs.values())


def test_a_step_reads_once_to_verify_and_once_to_draft(runs):
    """Merged, every verification and every drafting call whose bets held reads the device at most once; the same
    calls without merging (``reads.MERGE = False``: the same requests, so the same steps, call for call) read once
    per kind that had something to read, up to 3 times to verify a step mixing every kind (4 with T > 0 forests)
    and twice to draft plain and beam forests: merged, each such call reads exactly once."""
    assert runs["static_layers"]  # the engine took the static paths (VLLM_DSBD_STATIC_VERIFY=1)
    merged, apart = runs["calls_True"], runs["calls_False"]
    assert [(k, kinds) for k, kinds, *_ in merged] == [(k, kinds) for k, kinds, *_ in apart]
    every = frozenset(("plain", "beam_t0", "beam_t1"))
    pairs = [(k, kinds, m, a) for (k, kinds, m, x), (_, _, a, y) in zip(merged, apart) if not (x or y)]
    print("(kind, kinds, reads merged, reads apart):",
          [(k, "+".join(sorted(kinds)), _reads(m), _reads(a)) for k, kinds, m, a in pairs])
    for k, kinds, m, a in pairs:
        assert m.mismatches == [] and a.mismatches == [], (k, m.mismatches[:3], a.mismatches[:3])
        assert _reads(m) == min(_reads(a), 1), (k, kinds, m.syncs, a.syncs)
    mixed = [_reads(a) for k, kinds, _, a in pairs if k == "verify" and kinds == every]
    both = [_reads(a) for k, kinds, _, a in pairs if k == "draft" and _reads(a) >= 2]
    assert len(mixed) >= 3 and max(mixed) >= 3, mixed  # steps mixing every kind: 3 or more reads apart, 1 merged
    assert len(both) >= 3 and max(both) == 2, both  # plain and beam drafting in one call: 2 apart, 1 merged
    for k, kinds, m, missed in merged:  # a failed bet: the general loops read once per depth (not merged)
        assert m.mismatches == [], (k, m.mismatches[:3])


def test_merging_and_observing_change_nothing(runs):
    assert runs[True] == runs[False] == runs["plain"]
    for merge in (True, False):
        accepted, beam_nodes, layers_passed = runs[f"counts_{merge}"]
        assert accepted > 0 and beam_nodes > 0 and layers_passed > 0, runs[f"counts_{merge}"]


def test_failed_bets_fall_back_inside_the_gathered_readers(runs):
    """Narrow supports (top-k 1 at width 2) break the static draft loops' bets, plain and beam: those calls draft
    again with the general loops (reading once per depth) inside the gathered readers, and the outputs are the same
    merged, apart and unobserved."""
    for name in ("narrow", "narrow_True", "narrow_False"):
        plain_misses, beam_misses = runs[name + "_misses"]
        assert plain_misses > 0 and beam_misses > 0, (name, runs[name + "_misses"])
    assert runs["narrow_True"] == runs["narrow_False"] == runs["narrow"]
    assert runs["narrow"] != runs["plain"]  # the narrow requests drew otherwise
