"""Patch: ``SpeculativeConfig.__post_init__`` builds a "dsbd" config exactly like a "draft_model" one.

vLLM 0.26's ``__post_init__`` creates the draft ``ModelConfig``, the draft parallel config and the draft max length
for ``method == "draft_model"`` and raises ``NotImplementedError("Unsupported speculative method")`` for any method
it does not know. For "dsbd" the wrapper runs the original with ``method = "draft_model"`` and puts "dsbd" back.
If vLLM's auto-detection turned the draft into something else (its path contains "eagle-", "eagle3", "dflash",
"dspark", or its config is a Medusa/MLP-speculator/MTP checkpoint), "dsbd" is refused: DSBD needs a plain causal LM
draft sharing the target's vocabulary.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "spec_post_init"
MODULE = "vllm.config.speculative"
DRAFT_MODEL = "draft_model"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def __post_init__(self):
            if self.method != METHOD:
                return orig(self)
            self.method = DRAFT_MODEL
            try:
                result = orig(self)
                detected = self.method
            finally:
                self.method = METHOD
            if detected != DRAFT_MODEL:
                raise ValueError(
                    f"speculative method {METHOD!r} needs a plain causal-LM draft model, but vLLM detected "
                    f"{self.model!r} as a {detected!r} checkpoint"
                )
            return result

        return __post_init__

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "__post_init__", make)

