"""Patch: ``SpeculativeConfig.__repr__`` of a "dsbd" engine without a draft model says ``model=None``.

vLLM 0.26's ``__repr__`` (config/speculative.py:1348-1362) prints ``model=None`` for the methods it knows to have no
draft model (ngram, suffix, extract_hidden_states, custom_class) and reads ``draft_model_config.model`` for every
other method. A "dsbd" config without ``model`` has no draft config (patch ``spec_post_init``), so the original
raised ``AttributeError`` where vLLM logs the engine's config at start-up (``VllmConfig.__str__``). The wrapper prints
``SpeculativeConfig(method='dsbd', model=None, num_spec_tokens=N)`` in vLLM's own format for that case; every other
config goes to the original.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "spec_repr"
MODULE = "vllm.config.speculative"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def __repr__(self) -> str:
            if self.method != METHOD or self.draft_model_config is not None:
                return orig(self)
            method, model, num_spec_tokens = self.method, None, self.num_speculative_tokens
            return f"SpeculativeConfig({method=}, {model=}, {num_spec_tokens=})"

        return __repr__

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "__repr__", make)
