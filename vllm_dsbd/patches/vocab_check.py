"""Patch: ``SpeculativeConfig.verify_equal_vocab_size_if_draft_model()`` checks "dsbd" drafts too.

vLLM 0.26 compares target and draft vocabulary sizes only for ``method == "draft_model"`` (called from the
``_verify_args`` model validator and from ``DraftModelProposer.__init__``). DSBD verifies draft tokens against target
probabilities token by token, so it needs the same check: the wrapper runs the original with
``method = "draft_model"`` for "dsbd".
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import temporarily, when_imported, wrap_method

PATCH_ID = "vocab_check"
MODULE = "vllm.config.speculative"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    def make(orig):
        def verify_equal_vocab_size_if_draft_model(self):
            if self.method != METHOD:
                return orig(self)
            with temporarily(self, "method", "draft_model"):
                return orig(self)

        return verify_equal_vocab_size_if_draft_model

    wrap_method(PATCH_ID, sp.SpeculativeConfig, "verify_equal_vocab_size_if_draft_model", make)
