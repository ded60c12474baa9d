"""Patch: a DSBD engine rejects a bad request in the front end, before the request reaches the engine: a bad
per-request width, or a sampling setting the DSBD sampler does not apply (``requests.check_request``: prompt
logprobs, ...; on beam requests structured outputs, the penalties, min_p, min_tokens, logit_bias, allowed_token_ids and
bad_words, which vLLM's beam search has not), or a value the worker could not serve: token ids outside the model's
vocabulary (``dsbd_beam`` ``eos_token_id`` / ``stop_token_ids``, ``allowed_token_ids``), a beam ``length_penalty``
whose powers overflow, beam ``stop`` strings without a tokenizer (``requests.RequestLimits``, from the model config).

vLLM's own checks run first, without its refusal of ``min_p`` and ``logit_bias`` under any speculative method
(``SamplingParams._validate_spec_decode``, which it reaches through ``speculative_config``): DSBD applies both per
forest node (``engine/processors.py``).

``InputProcessor._validate_params`` (v1/engine/input_processor.py) is where vLLM raises ``ValueError`` for bad
``SamplingParams``: offline ``LLM.generate`` raises it to the caller, the OpenAI server answers 400, and the engine
keeps serving. Without this patch the width in ``extra_args["dsbd_width"]`` is only checked in the worker, where the
ValueError kills the engine core (HTTP 500 and a dead server).
"""

from __future__ import annotations

import types

from vllm_dsbd.config import METHOD, DSBDConfig
from vllm_dsbd.requests import RequestLimits, check_request
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "request_validation"
MODULE = "vllm.v1.engine.input_processor"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    from vllm.sampling_params import SamplingParams

    def make(orig):
        def _validate_params(self, params, supported_tasks):
            spec = self.speculative_config
            if spec is None or spec.method != METHOD or not isinstance(params, SamplingParams):
                orig(self, params, supported_tasks)
                return
            # vLLM's own checks, but its refusal of min_p and logit_bias with speculative decoding (the only use of
            # speculative_config there, SamplingParams._validate_spec_decode): DSBD applies both per forest node
            self.speculative_config = None
            try:
                orig(self, params, supported_tasks)
            finally:
                self.speculative_config = spec
            cfg = getattr(self, "_dsbd_config", None)
            if cfg is None:
                cfg = self._dsbd_config = DSBDConfig.from_vllm_config(self.vllm_config)
                mc = self.model_config
                self._dsbd_limits = RequestLimits(vocab=mc.get_vocab_size(), max_len=mc.max_model_len,
                                                  tokenizer=not mc.skip_tokenizer_init)
            check_request(params, cfg, self._dsbd_limits)  # ValueError naming the parameter

        return _validate_params

    wrap_method(PATCH_ID, mod.InputProcessor, "_validate_params", make)
