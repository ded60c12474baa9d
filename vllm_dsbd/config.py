"""DSBD's own settings: one frozen, validated config carried inside vLLM's ``VllmConfig.additional_config["dsbd"]``.

Where the settings come from (the plugin's patch ``vllm_dsbd.patches.dsbd_knobs`` moves them, before vLLM builds its
``SpeculativeConfig``, which rejects unknown keys):

* ``speculative_config={"method": "dsbd", "model": DRAFT, "num_speculative_tokens": G, "width": 4, ...}``, or
* ``additional_config={"dsbd": {"width": 4, ...}}``, or both (a key given in both places must agree).

``num_speculative_tokens`` as the user gives it is the draft **depth** G. The scheduler must reserve one slot per
scheduled "draft token": a forest has ``width`` nodes per depth, and a beam request also schedules its ``width - 1``
live leaves after vLLM's last token, so the plugin builds vLLM's ``SpeculativeConfig`` with
``num_speculative_tokens = width * depth + width - 1`` (:attr:`DSBDConfig.num_speculative_slots`); the depth stays
here.

Per request, ``SamplingParams(extra_args={"dsbd_width": k})`` (OpenAI API: ``"vllm_xargs": {"dsbd_width": k}``) caps
the width of that request at ``k`` (``1 <= k <= width``); see :func:`request_width`.

This module imports no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["METHOD", "REQUEST_WIDTH_KEY", "DSBDConfig", "check_request", "request_width", "uses_dsbd"]

METHOD = "dsbd"  # the value of --speculative-method / speculative_config["method"]
ADDITIONAL_CONFIG_KEY = "dsbd"  # VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]
REQUEST_WIDTH_KEY = "dsbd_width"  # SamplingParams.extra_args[REQUEST_WIDTH_KEY]
BEAM_KEY = "dsbd_beam"  # SamplingParams.extra_args[BEAM_KEY]: a beam request (engine/beams.py BeamParams)
REQUEST_KEYS = (REQUEST_WIDTH_KEY, BEAM_KEY)
MODES = ("sample", "single", "full")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class DSBDConfig:
    """DSBD settings for one engine (the contract: ``../shared/DESIGN.md`` §1).

    Attributes:
        width: W, the most beams / draft nodes per depth (>= 1).
        depth: gamma, the draft depth; vLLM's ``num_speculative_tokens`` as the user gives it (>= 1).
        min_width: the least width the dynamic-width rule may choose (1 <= min_width <= width).
        width_threshold: tau in (0, 1]; dynamic width picks the largest k with Pr[#accepted >= k] >= tau.
        dynamic_width: choose the width per layer (True) or always use ``width`` (False).
        mode: what a request gets (DESIGN.md §1). "sample" (default): exact target sampling (temperature 0: plain
            greedy decoding) for every width; the draft proposes up to ``width`` nodes per depth and each verified
            layer emits one token (K = 1), so ``width`` only changes how many drafts are checked. "single": the
            paper's single-output-beam mode, opt-in: layers keep K <= ``width`` beams (dynamic width) and each
            iteration emits one of them; for width > 1 its output law depends on how well the draft agrees (no
            fixed target process; each layer is exact given its width). "full" (W live beams across iterations) is
            part of the algorithm but not available in the engine yet, and is rejected.
    """

    width: int = 2
    depth: int = 3
    min_width: int = 1
    width_threshold: float = 0.9
    dynamic_width: bool = True
    mode: str = "sample"

    def __post_init__(self) -> None:
        for key in ("width", "depth", "min_width"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ValueError(f"DSBD config: {key!r} must be an integer >= 1, got {value!r}")
        if self.min_width > self.width:
            raise ValueError(
                f"DSBD config: 'min_width' must be <= 'width' ({self.width}), got {self.min_width!r}"
            )
        tau = self.width_threshold
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
            raise ValueError(f"DSBD config: 'width_threshold' must be a number in (0, 1], got {tau!r}")
        object.__setattr__(self, "width_threshold", float(tau))
        if not isinstance(self.dynamic_width, bool):
            raise ValueError(f"DSBD config: 'dynamic_width' must be true or false, got {self.dynamic_width!r}")
        if self.mode == "full":
            raise ValueError(
                "DSBD config: 'mode'='full' (full-width mode: W live beams across iterations) is not available in "
                "the engine yet; use mode='sample' (exact target sampling) or mode='single'"
            )
        if self.mode not in MODES:
            raise ValueError(f"DSBD config: 'mode' must be one of {list(MODES)}, got {self.mode!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The accepted keys, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> DSBDConfig:
        """Validated config from a JSON-like mapping (``None`` = all defaults).

        Raises:
            ValueError: ``d`` is not a mapping, has a key not in :meth:`keys` (the message names it and lists the
                allowed keys), or a value out of range (the message names its key).
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"DSBD config must be a mapping of settings, got {type(d).__name__}: {d!r}")
        allowed = cls.keys()
        unknown = [k for k in d if k not in allowed]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise ValueError(
                f"DSBD config: unknown key{'s' if len(unknown) > 1 else ''} {names}; allowed keys: {list(allowed)}"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict that :meth:`from_dict` accepts (what ``additional_config["dsbd"]`` holds)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def num_speculative_slots(self) -> int:
        """Speculative token slots the scheduler reserves per request, ``width * depth + width - 1``: one per forest
        node (``width`` per depth), plus the ``width - 1`` leaves a beam request schedules before its forest.

        This is what vLLM's ``SpeculativeConfig.num_speculative_tokens`` holds for method "dsbd".
        """
        return self.width * self.depth + self.width - 1

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DSBDConfig:
        """The config of an engine built with ``--speculative-method dsbd`` (through ``EngineArgs``/``LLM``/``serve``
        with the plugin registered), checked against the ``SpeculativeConfig`` vLLM built.

        Raises:
            ValueError: the engine is not a DSBD engine, ``additional_config["dsbd"]`` is missing or invalid, or
                ``speculative_config.num_speculative_tokens != width * depth + width - 1``.
        """
        spec = getattr(vllm_config, "speculative_config", None)
        method = getattr(spec, "method", None)
        if method != METHOD:
            raise ValueError(f"not a DSBD engine: speculative_config.method is {method!r}, not {METHOD!r}")
        additional = getattr(vllm_config, "additional_config", None) or {}
        if ADDITIONAL_CONFIG_KEY not in additional:
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is missing: build DSBD engines through EngineArgs, "
                "LLM(...) or `vllm serve` with the vllm_dsbd plugin registered (it fills it in)"
            )
        cfg = cls.from_dict(additional[ADDITIONAL_CONFIG_KEY])
        if spec.num_speculative_tokens != cfg.num_speculative_slots:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens} but DSBD needs "
                f"width*depth + width-1 = {cfg.num_speculative_slots} slots (width {cfg.width}, depth {cfg.depth})"
            )
        return cfg


def uses_dsbd(vllm_config: Any) -> bool:
    """Whether the engine was configured with ``--speculative-method dsbd``."""
    return getattr(getattr(vllm_config, "speculative_config", None), "method", None) == METHOD


def request_width(sampling_params: Any, cfg: DSBDConfig) -> int:
    """The width of one request: ``sampling_params.extra_args["dsbd_width"]`` if given, else ``cfg.width``.

    Raises:
        ValueError: the value is not an integer with ``1 <= value <= cfg.width`` (the message names
            ``extra_args['dsbd_width']``).
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    if REQUEST_WIDTH_KEY not in extra or extra[REQUEST_WIDTH_KEY] is None:
        return cfg.width
    value = extra[REQUEST_WIDTH_KEY]
    if not _is_int(value) or not 1 <= value <= cfg.width:
        raise ValueError(
            f"extra_args[{REQUEST_WIDTH_KEY!r}] must be an integer in [1, {cfg.width}] (the engine's DSBD width), "
            f"got {value!r}"
        )
    return value


# SamplingParams a DSBD request may not set: (attribute, what counts as set). The DSBD sampler draws from the target's
# and the draft's joints with temperature, top-k and top-p only; these would have to act on every forest node with
# that node's own history (and on the draft alike, for exactness), which is not built. Refused, never ignored.
_REFUSED = (
    ("presence_penalty", lambda v: (v or 0.0) != 0.0),
    ("frequency_penalty", lambda v: (v or 0.0) != 0.0),
    ("repetition_penalty", lambda v: (1.0 if v is None else v) != 1.0),
    ("min_p", lambda v: (v or 0.0) > 0.0),
    ("min_tokens", lambda v: (v or 0) > 0),
    ("logit_bias", bool),
    ("allowed_token_ids", lambda v: v is not None),
    ("bad_words", bool),
    ("structured_outputs", lambda v: v is not None),
    ("logprob_token_ids", lambda v: v is not None),
    ("prompt_logprobs", lambda v: v is not None),
    ("thinking_token_budget", lambda v: v is not None),
    ("repetition_detection", lambda v: v is not None),
)


def check_request(sampling_params: Any, cfg: DSBDConfig) -> int:
    """Validates one request for a DSBD engine; returns its width (:func:`request_width`).

    Raises:
        ValueError: an unknown ``dsbd_*`` key in ``extra_args`` (named), a setting the DSBD engine does not apply
            (the message names the parameter), or a bad width.
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    unknown = [k for k in extra if isinstance(k, str) and k.startswith("dsbd_") and k not in REQUEST_KEYS]
    if unknown:
        raise ValueError(f"extra_args: unknown DSBD key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(k) for k in unknown)}; the DSBD request keys are {list(REQUEST_KEYS)}")
    if extra.get(BEAM_KEY) is not None:
        from vllm_dsbd.engine.beams import BeamParams

        BeamParams.parse(extra[BEAM_KEY], cfg.width)  # ValueError naming extra_args['dsbd_beam'][key]
    bad = [name for name, is_set in _REFUSED if is_set(getattr(sampling_params, name, None))]
    if bad:
        names = ", ".join(bad)
        raise ValueError(
            f"{names}: not supported with speculative method {METHOD!r} (the DSBD sampler applies temperature, top_k, "
            "top_p, seed, stop conditions and logprobs only); leave "
            f"{'it' if len(bad) == 1 else 'them'} unset or use an engine without DSBD"
        )
    return request_width(sampling_params, cfg)
