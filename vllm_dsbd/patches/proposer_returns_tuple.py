"""Patch: ``SpecDecodeBaseProposer.model_returns_tuple()`` is False for "dsbd".

vLLM 0.26's proposer takes its ``method`` from the ``SpeculativeConfig`` and returns
``method not in ("mtp", "draft_model", "dflash")``, i.e. True for an unknown method, and then unpacks the draft
model's output as ``(hidden_states, aux)``. A DSBD draft is an ordinary causal LM returning one tensor, as for
"draft_model". The proposer module is heavy (attention backends, model loader) and imported only by model runners,
so the patch waits for its import (``when_imported``) instead of importing it in every vLLM process.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "proposer_returns_tuple"
MODULE = "vllm.v1.spec_decode.llm_base_proposer"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def model_returns_tuple(self) -> bool:
            if self.method == METHOD:
                return False
            return orig(self)

        return model_returns_tuple

    wrap_method(PATCH_ID, mod.SpecDecodeBaseProposer, "model_returns_tuple", make)
