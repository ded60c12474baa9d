"""Patch: ``SpeculativeConfig.__post_init__`` builds a "dsbd" config exactly like a "draft_model" one.

vLLM 0.26's ``__post_init__`` creates the draft ``ModelConfig``, the draft parallel config and the draft max length
for ``method == "draft_model"`` and raises ``NotImplementedError("Unsupported speculative method")`` for any method
it does not know. For "dsbd" the wrapper runs the original with ``method = "draft_model"`` and puts "dsbd" back.
If vLLM's auto-detection turned the draft into something else (its path contains "eagle-", "eagle3", "dflash",
"dspark", or its config is a Medusa/MLP-speculator/MTP checkpoint), "dsbd" is refused: DSBD needs a plain causal LM
draft sharing the target's vocabulary, or an EAGLE-3 head. A head is recognised by the architecture in its
``config.json`` (``engine.head.HEAD_ARCHS``, whatever its path): the original then runs with ``method = "eagle3"``,
so vLLM skips its detection by path and wraps the head's config as it does for its own EAGLE-3 drafts
(``EAGLEConfig(method="eagle3")``: vLLM builds ``Eagle3LlamaForCausalLM``).

A "dsbd" config without ``model`` is an engine without a draft model: vLLM's ``__post_init__`` has nothing to build
for it (after inferring the method it only builds the draft's configs, config/speculative.py:692-1050) and
would raise "num_speculative_tokens was provided but without speculative model" (:692-732), so the original is not
run: ``draft_model_config`` and ``draft_parallel_config`` stay None and ``prompt_lookup_min/max`` are 0, as for a
draft model.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "spec_post_init"
MODULE = "vllm.config.speculative"
DRAFT_MODEL = "draft_model"
EAGLE3 = "eagle3"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def __post_init__(self):
            if self.method != METHOD:
                return orig(self)
            if self.model is None:  # an engine without a draft model: no draft configs to build
                self.prompt_lookup_min = self.prompt_lookup_max = 0
                return self
            from vllm_dsbd.engine.head import HEAD_ARCHS, is_head_checkpoint

            head = is_head_checkpoint(self.model, self.revision)
            # a head: built as vLLM builds an "eagle3" draft (no detection by path; its config wrapped in EAGLEConfig)
            self.method = EAGLE3 if head else DRAFT_MODEL
            try:
                result = orig(self)
                detected = self.method
            finally:
                self.method = METHOD
            if not head and detected != DRAFT_MODEL:
                raise ValueError(
                    f"speculative method {METHOD!r} needs a plain causal-LM draft model or an EAGLE-3 head "
                    f"(architectures {list(HEAD_ARCHS)}), but vLLM detected {self.model!r} as a {detected!r} "
                    "checkpoint"
                )
            return result

        return __post_init__

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "__post_init__", make)

