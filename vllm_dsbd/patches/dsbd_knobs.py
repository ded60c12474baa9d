"""Patch: ``EngineArgs.create_speculative_config`` moves DSBD's knobs into ``additional_config["dsbd"]``.

vLLM 0.26 builds ``SpeculativeConfig(**speculative_config)`` (pydantic, ``extra="forbid"``) inside
``EngineArgs.create_engine_config`` after merging ``--spec-method/--spec-model/--spec-tokens`` into the dict. For
method "dsbd" the wrapper, before the original runs:

1. merges the three shorthands into a copy of ``speculative_config`` as vLLM does (same mutual-exclusion error);
2. takes every key that is not a ``SpeculativeConfig`` field (``width``, ``min_width``, ``width_threshold``,
   ``dynamic_width``, ``mode``, ``depth``, and typos such as ``widht``) out of it, merges them with
   ``additional_config["dsbd"]`` (a key given in both places must agree) and validates them with
   ``DSBDConfig.from_dict`` (unknown keys and bad values raise ``ValueError`` naming the key);
3. takes depth = ``num_speculative_tokens`` (default 3) and builds the ``SpeculativeConfig`` with
   ``num_speculative_tokens = max(N * depth + width - 1, max_beam_width - 1)`` (N = ``beam_nodes`` or ``width``): one
   scheduler slot per forest node and per beam leaf, at least the leaves of the widest beam request (64 beams by
   default).
   Without ``model`` the engine has no draft model (``DSBDConfig.draft`` False) and drafts from its draft-free
   ``sources`` (default recycle + lookup, depth 3); with ``"sources": []`` it drafts nothing (depth 0, a depth given
   is an error) and ``num_speculative_tokens = max(1, width - 1, max_beam_width - 1)`` (a beam request's leaves).
   Setting it here, before the ``VllmConfig`` exists, is the only safe place: the scheduler (``num_spec_tokens``, ``num_lookahead_tokens``,
   token budget), the worker's runner (buffers, rejection-sampler/metrics sizes) and the spec-decoding stats are
   built from the pickled config in other processes and must all agree;
4. after the original returns, stores ``DSBDConfig.to_dict()`` in a new ``additional_config`` dict.

The ``EngineArgs`` fields are left as the user set them (only ``additional_config`` gains "dsbd"), so calling
``create_engine_config`` twice gives the same config. Non-"dsbd" configs go to the original untouched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from collections.abc import Mapping
from typing import Any

from vllm_dsbd.config import ADDITIONAL_CONFIG_KEY, METHOD, DSBDConfig
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "dsbd_knobs"
MODULE = "vllm.engine.arg_utils"
# SpeculativeConfig settings that change the slot layout of a request; DSBD's forest layout needs them off
UNSUPPORTED = {
    "num_speculative_tokens_per_batch_size": None,
    "parallel_drafting": False,
}
_FLAGS = (
    ("--spec-method", "method", "spec_method"),
    ("--spec-model", "model", "spec_model"),
    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
)


def requested_method(engine_args: Any) -> str | None:
    """The speculative method the user asked for (shorthand flag first), without validating anything."""
    if engine_args.spec_method is not None:
        return engine_args.spec_method
    return (engine_args.speculative_config or {}).get("method")


def merged_speculative_dict(engine_args: Any) -> dict[str, Any]:
    """A copy of ``speculative_config`` with the shorthand flags merged in and "-" in keys replaced by "_"."""
    spec = dict(engine_args.speculative_config or {})
    for flag, key, attr in _FLAGS:
        value = getattr(engine_args, attr)
        if value is None:
            continue
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    return {k.replace("-", "_"): v for k, v in spec.items()}


def split_dsbd(spec: dict[str, Any], additional_config: Mapping[str, Any] | None, spec_fields: set[str]):
    """Splits a merged ``speculative_config`` dict of method "dsbd" into (vLLM's part, DSBDConfig).

    vLLM's part has ``num_speculative_tokens = DSBDConfig.num_speculative_slots``. Raises ValueError naming the
    offending key.
    """
    spec = dict(spec)
    knobs = {k: spec.pop(k) for k in list(spec) if k not in spec_fields}
    if additional_config is not None and not isinstance(additional_config, Mapping):
        raise ValueError(f"additional_config must be a dict to carry DSBD settings, got {type(additional_config)}")
    extra = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a mapping of DSBD settings, got {extra!r}"
            )
        for key, value in extra.items():
            key = key.replace("-", "_") if isinstance(key, str) else key
            if key in knobs and knobs[key] != value:
                raise ValueError(
                    f"DSBD setting {key!r} is given twice with different values: speculative_config[{key!r}]="
                    f"{knobs[key]!r}, additional_config[{ADDITIONAL_CONFIG_KEY!r}][{key!r}]={value!r}"
                )
            knobs[key] = value

    draft = spec.get("model") is not None
    if knobs.get("draft", draft) != draft:
        raise ValueError(
            f"DSBD 'draft'={knobs['draft']!r} disagrees with speculative_config['model']={spec.get('model')!r} (an "
            "engine has a draft model exactly when 'model' / --spec-model names one); leave 'draft' out"
        )
    knobs["draft"] = draft
    depth = spec.get("num_speculative_tokens")
    if depth is not None and knobs.get("depth", depth) != depth:
        raise ValueError(
            f"DSBD 'depth'={knobs['depth']!r} disagrees with num_speculative_tokens={depth!r} (which is the DSBD "
            "draft depth); give one of them"
        )
    # no depth given: DEFAULT_DEPTH with a forest source (a draft model or draft-free sources), 0 without one
    # (DSBDConfig decides; it refuses a depth without a source)
    knobs["depth"] = depth if depth is not None else knobs.get("depth")
    cfg = DSBDConfig.from_dict(knobs)

    for key, off in UNSUPPORTED.items():
        if spec.get(key, off) != off:
            raise ValueError(f"speculative_config[{key!r}] is not supported with method {METHOD!r}")
    spec["num_speculative_tokens"] = cfg.num_speculative_slots
    return spec, cfg


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.logger import init_logger

    logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler and format apply
    spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}

    def make(orig):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            if requested_method(self) != METHOD:
                additional = self.additional_config
                if isinstance(additional, Mapping) and ADDITIONAL_CONFIG_KEY in additional:
                    logger.warning_once(
                        "additional_config[%r] is ignored: the speculative method is not %r",
                        ADDITIONAL_CONFIG_KEY,
                        METHOD,
                    )
                return orig(self, target_model_config, target_parallel_config)

            spec, cfg = split_dsbd(merged_speculative_dict(self), self.additional_config, spec_fields)
            saved = {attr: getattr(self, attr) for attr in ("speculative_config", *(a for _, _, a in _FLAGS))}
            try:
                self.speculative_config = spec
                for _, _, attr in _FLAGS:
                    setattr(self, attr, None)
                result = orig(self, target_model_config, target_parallel_config)
            finally:
                for attr, value in saved.items():
                    setattr(self, attr, value)
            self.additional_config = {**(self.additional_config or {}), ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
            if cfg.draft and importlib.util.find_spec("vllm_dsbd.engine") is None:
                logger.warning_once(
                    "DSBD engine (vllm_dsbd.engine) not installed: running vLLM's draft-model speculation with "
                    "%d linear draft tokens (N*depth + width-1) instead of the DSBD forest",
                    cfg.num_speculative_slots,
                )
            return result

        return create_speculative_config

    wrap_method(PATCH_ID, mod.EngineArgs, "create_speculative_config", make)
