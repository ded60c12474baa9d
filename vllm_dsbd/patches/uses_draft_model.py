"""Patch: ``SpeculativeConfig.uses_draft_model()`` is true for "dsbd" with a draft model.

DSBD rides on vLLM's draft-model path: every call site below must treat "dsbd" as "draft_model" (vLLM 0.26):

* ``v1/worker/gpu_model_runner.py`` (CPU runner inherits it):
  ``__init__`` creates the drafter (``DraftModelProposer``; the DSBD engine will hook in here);
  ``sample_tokens`` (``drafter_runs_model_forward``: use GPU sampled tokens for drafting);
  ``propose_draft_token_ids`` (the draft-model/EAGLE branch that calls ``drafter.propose``);
  ``_dummy_run`` (drafter dummy run); ``initialize_metadata_builders`` (drafter attention backend);
  ``_check_and_update_cudagraph_mode`` (drafter cudagraph dispatcher).
* ``v1/worker/cpu_model_runner.py`` ``initialize_kv_cache`` (a log line).
* ``v1/core/sched/scheduler.py`` ``Scheduler.__init__``: ``num_lookahead_tokens = num_spec_tokens`` (KV slots the
  drafter writes beyond the scheduled tokens).
* ``config/speculative.py``: ``max_num_new_slots_for_drafting`` (one extra slot per request for draft models) and
  the ``use_heterogeneous_vocab`` check.

A "dsbd" engine without a draft model (no ``model``; patch ``spec_post_init``) is not a draft-model engine: False, so
no draft model is loaded, no draft KV cache or lookahead slots are allocated and no drafter dummy run is made. (vLLM's
runner then knows no drafter for the method; ``engine/runner.py`` handles that.)
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "uses_draft_model"
MODULE = "vllm.config.speculative"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def uses_draft_model(self) -> bool:
            return (self.method == METHOD and self.model is not None) or orig(self)

        return uses_draft_model

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "uses_draft_model", make)
