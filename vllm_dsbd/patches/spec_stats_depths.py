"""Patch: vLLM's spec-decode statistics of a DSBD engine count per-position acceptance by draft **depth**.

vLLM's scheduler (``Scheduler.make_spec_decoding_stats``, v1/core/sched/scheduler.py:2444) sizes the per-position
arrays of ``SpecDecodingStats`` by ``num_speculative_tokens``, which for DSBD is ``width * depth`` forest slots, and
its ``observe_draft`` adds one to ``num_draft_tokens_per_pos[i]`` for every scheduled node ``i`` as if the nodes were a
chain. For a forest the accepted count is the number of layers passed, so position ``p`` of vLLM's accepted-per-position
vector already means "passed depth p + 1"; the positions ``depth .. width * depth - 1`` can never count anything, and
vLLM's log line and Prometheus showed them as zeros (e.g. 12 positions for W = 4, depth 3).

vLLM also schedules a new one-token request with ``num_speculative_tokens`` placeholder drafts (``-1``; "pad new
decode requests to uniform spec decoding size to preserve full cudagraph", scheduler.py:843-859) and counts them as a
draft of that many tokens with none accepted, although nothing was drafted.

How: ``Scheduler.update_from_output`` keeps its ``scheduler_output`` on the scheduler while it runs (DSBD engines
only), so that for method "dsbd" the stats are made with ``depth`` positions; drafts, drafted tokens (the forest nodes
the scheduler actually scheduled: its ``-1`` placeholders are not drafts, and a step with only placeholders is not a
draft) and accepted tokens (layers passed) are counted as vLLM
counts them; accepted-per-position counts layers passed (position p: passed depth p + 1). ``num_draft_tokens_per_pos``
(read nowhere in vLLM 0.26) stays zero: the scheduler does not know a forest's depth from its node count. Non-DSBD
engines call the original. The Prometheus counters are sized to match by patch ``spec_stats_prometheus``. An engine
without a draft model (depth 0) drafts nothing: the leaves its beam requests schedule in the draft slots are not
drafts, so it makes no spec-decode statistics at all (vLLM's counters stay 0).

Beam requests (``extra_args["dsbd_beam"]``) are kept out of vLLM's statistics on every engine: what vLLM reads as
their accepted drafts is the trie nodes a step kept (``len(row) - 1``, patch ``beam_scheduler``), not layers passed,
so one W = 4 request of 16 beam steps and no layer passed counted 27 "accepted tokens" and a mean acceptance length
of 2.80. Their own counters are ``vllm:dsbd_beam_*`` (``engine/metrics.py``; docs/usage/metrics.md).

When it can go: vLLM lets a speculative method describe its drafts as a tree (positions = depths), or DSBD reports its
own depth statistics to the scheduler.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import DSBDConfig, uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method
from vllm_dsbd.patches.beam_scheduler import is_beam_request

PATCH_ID = "spec_stats_depths"
MODULE = "vllm.v1.core.sched.scheduler"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    def make(orig):
        def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                     num_invalid_spec_tokens, request_id):
            if not uses_dsbd(self.vllm_config):
                return orig(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                            num_invalid_spec_tokens, request_id)
            if not self.log_stats or not num_draft_tokens:
                return spec_decoding_stats
            depth = getattr(self, "_dsbd_depth", None)
            if depth is None:
                depth = self._dsbd_depth = DSBDConfig.from_vllm_config(self.vllm_config).depth
            if depth == 0:  # no draft model: a beam request's leaves ride in the draft slots, nothing is drafted
                return spec_decoding_stats
            if is_beam_request(self.requests.get(request_id)):  # counted in vllm:dsbd_beam_* instead
                return spec_decoding_stats
            sched = getattr(self, "_dsbd_scheduler_output", None)
            drafts = sched.scheduled_spec_decode_tokens.get(request_id) if sched is not None else None
            if drafts is not None:  # the nodes actually drafted: vLLM's -1 placeholders are not drafts
                num_draft_tokens = sum(1 for t in drafts if t >= 0)
            elif num_invalid_spec_tokens:
                num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
            if num_draft_tokens <= 0:  # only placeholders were scheduled: no forest was verified
                return spec_decoding_stats
            if spec_decoding_stats is None:
                spec_decoding_stats = SpecDecodingStats.new(depth)
            s = spec_decoding_stats
            s.num_drafts += 1
            s.num_draft_tokens += num_draft_tokens
            s.num_accepted_tokens += num_accepted_tokens
            for p in range(min(num_accepted_tokens, depth)):
                s.num_accepted_tokens_per_pos[p] += 1
            return s

        return make_spec_decoding_stats

    def make_update(orig):
        def update_from_output(self, scheduler_output, model_runner_output):
            if not uses_dsbd(self.vllm_config):
                return orig(self, scheduler_output, model_runner_output)
            # kept while it runs: this patch reads the scheduler output, patch beam_scheduler the runner output
            self._dsbd_scheduler_output = scheduler_output
            self._dsbd_model_runner_output = model_runner_output
            try:
                return orig(self, scheduler_output, model_runner_output)
            finally:
                self._dsbd_scheduler_output = None
                self._dsbd_model_runner_output = None

        return update_from_output

    wrap_method(PATCH_ID, mod.Scheduler, "make_spec_decoding_stats", make)
    wrap_method(PATCH_ID, mod.Scheduler, "update_from_output", make_update)
