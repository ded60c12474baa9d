"""Patch: vLLM's Prometheus per-position acceptance counter of a DSBD engine has one series per draft depth.

``PrometheusStatLogger.__init__`` (v1/metrics/loggers.py:477) builds ``SpecDecodingProm`` from
``speculative_config``, which makes one ``vllm:spec_decode_num_accepted_tokens_per_pos`` series per
``num_speculative_tokens`` position: ``width * depth`` forest slots for DSBD, of which only the first ``depth`` can
ever count (patch ``spec_stats_depths``: positions are depths). How: for method "dsbd" the logger builds its
``SpecDecodingProm`` (or Ray's subclass) from a copy of ``speculative_config`` whose ``num_speculative_tokens`` is the
DSBD depth; the copy is used for that constructor call only (the engine, the logger's config and every other metric
see vLLM's config unchanged). Non-DSBD engines are untouched.

When it can go: with ``spec_stats_depths``.
"""

from __future__ import annotations

import copy
import types

from vllm_dsbd.config import DSBDConfig, uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "spec_stats_prometheus"
MODULE = "vllm.v1.metrics.loggers"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            if not uses_dsbd(vllm_config):
                return orig(self, vllm_config, *args, **kwargs)
            spec = copy.copy(vllm_config.speculative_config)
            object.__setattr__(spec, "num_speculative_tokens", DSBDConfig.from_vllm_config(vllm_config).depth)
            cls = type(self)._spec_decoding_cls
            self._spec_decoding_cls = lambda _spec, *a, **k: cls(spec, *a, **k)
            try:
                return orig(self, vllm_config, *args, **kwargs)
            finally:
                del self._spec_decoding_cls

        return __init__

    wrap_method(PATCH_ID, mod.PrometheusStatLogger, "__init__", make)
