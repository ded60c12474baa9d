"""Patch: at the end of ``VllmConfig.__post_init__``, a "dsbd" config gets a CUDA-graph mode without attention inside
graphs and refuses the engine settings DSBD would ignore.

``VllmConfig.__post_init__`` is where vLLM resolves ``compilation_config.cudagraph_mode`` (optimization-level
defaults, then its own overrides, e.g. ``_maybe_override_dynamic_sd_cudagraph_mode``, encoder-decoder, KV connectors,
sequence parallelism, which can raise PIECEWISE to FULL, and the platform's ``check_and_update_config``). After the
original has run, the wrapper, for "dsbd" configs only:

1. ``engine.support.check_engine_config``: refuses engine-level logits processors and an explicit thinking-budget
   reasoning config (ValueError naming the setting); see that module;
2. ``engine.graphs.enforce``: FULL, FULL_DECODE_ONLY and FULL_AND_PIECEWISE (and PIECEWISE whose graphs would contain
   attention) become PIECEWISE where the graphs are split at the attention ops, else NONE, logged at INFO; with the
   DSBD setting ``full_cuda_graphs`` full modes stay for the passes without forest attention (see that module).

Every config goes through here (``EngineArgs.create_engine_config`` for ``LLM``/``vllm serve``/``AsyncEngineArgs``, a
``VllmConfig`` built directly, ``dataclasses.replace`` copies); a config unpickled in an engine-core or worker process
keeps the mode set here. Non-"dsbd" configs are returned exactly as the original made them.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "vllm_post_init"
MODULE = "vllm.config.vllm"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def __post_init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if uses_dsbd(self):
                from vllm_dsbd.engine import graphs, support

                support.check_engine_config(self)
                graphs.enforce(self)

        return __post_init__

    wrap_method(PATCH_ID, mod.VllmConfig, "__post_init__", make)
