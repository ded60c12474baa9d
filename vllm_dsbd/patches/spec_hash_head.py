"""Patch: ``SpeculativeConfig.compute_hash`` of a "dsbd" config whose draft is an EAGLE-3 head hashes as vLLM's
"eagle3" does.

vLLM 0.26's hash (config/speculative.py:293-328), part of the key of the compiled-graph cache, counts a target that
returns auxiliary hidden states (methods "eagle3", "extract_hidden_states", "dflash", "dspark") and the head's
config and layer ids. A "dsbd" engine with a head makes its target return them too (``engine/runner.py``), but
hashed as "dsbd" it would share the key of a "dsbd" engine with a plain draft on the same target: on a GPU with
``torch.compile`` the second engine could load the first one's compiled target, which returns no auxiliary states
(or returns them where none are expected). The wrapper hashes a head config with ``method = "eagle3"`` (restored
after); every other config goes to the original.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "spec_hash_head"
MODULE = "vllm.config.speculative"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def compute_hash(self) -> str:
            if self.method != METHOD or self.draft_model_config is None:
                return orig(self)
            from vllm_dsbd.engine.head import is_head

            if not is_head(self.draft_model_config.hf_config):
                return orig(self)
            self.method = "eagle3"
            try:
                return orig(self)
            finally:
                self.method = METHOD

        return compute_hash

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "compute_hash", make)
