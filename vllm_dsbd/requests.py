"""Per-request DSBD settings and checks: what ``SamplingParams.extra_args`` may carry on a DSBD engine and which
sampling settings it refuses.

* ``extra_args["dsbd_width"] = k`` (OpenAI API: ``"vllm_xargs": {"dsbd_width": k}``) caps one request's width at
  ``k`` (``1 <= k <= width``): :func:`request_width`.
* ``extra_args["dsbd_beam"] = {...}`` makes the request a beam request (beam search or beam sampling inside the
  engine): :class:`BeamParams` (its ``nodes``: the draft forest's nodes per depth, ``width <= nodes <= beam_nodes``).
* :func:`check_request` validates a request when vLLM admits it (patch ``request_validation``), so a bad request is
  refused with a message naming the parameter and the engine keeps serving; :class:`RequestLimits` carries what the
  front end knows of the model (vocabulary, context length, tokenizer) to bound token ids and the length penalty.

This module imports no torch and no vLLM.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from vllm_dsbd.config import METHOD, DSBDConfig

__all__ = ["BEAM_KEY", "REQUEST_KEYS", "REQUEST_WIDTH_KEY", "BeamParams", "RequestLimits", "check_request",
           "request_width"]

REQUEST_WIDTH_KEY = "dsbd_width"  # SamplingParams.extra_args[REQUEST_WIDTH_KEY]
BEAM_KEY = "dsbd_beam"  # SamplingParams.extra_args[BEAM_KEY]: a beam request (BeamParams)
REQUEST_KEYS = (REQUEST_WIDTH_KEY, BEAM_KEY)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestLimits:
    """What the front end knows of the model that bounds a request's values (the patch ``request_validation`` reads it
    from vLLM's ``ModelConfig``)."""

    vocab: int  # the model's vocabulary size: token ids are in [0, vocab)
    max_len: int  # max_model_len: a beam's length (prompt included) never exceeds it
    tokenizer: bool = True  # False with ``skip_tokenizer_init``: no text, so no stop strings

    def length_penalty_bound(self) -> float:
        """The largest |length_penalty| for which ``n ** length_penalty`` is a finite, non-zero float for every
        length n <= max_len + 1 (a beam's score divides by it; 1.8e308 ** 1 is the largest double, e ** -745 the
        smallest): 700 / ln(max_len + 1), rounded down."""
        return math.floor(700.0 / math.log(max(self.max_len, 2) + 1) * 100) / 100


_BEAM_FIELDS = ("width", "max_tokens", "length_penalty", "ignore_eos", "eos_token_id", "n", "depth", "dynamic_width",
                "rank_by_score", "nodes", "stop_token_ids", "stop", "include_stop_str_in_output", "num_beam_groups",
                "diversity_penalty")


@dataclass(frozen=True)
class BeamParams:
    """What a beam request asks for (``extra_args["dsbd_beam"]``); temperature and seed are the request's own."""

    width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    eos_token_id: int | None = None
    n: int | None = None  # beams returned (default: width)
    depth: int | None = None  # draft depth of the request's forests (default: the engine's; 0: no draft)
    dynamic_width: bool = False  # T > 0: the paper's dynamic width per drafted layer (default: fixed width W)
    # T = 0: rank a step's candidates by vLLM's length-normalised score, where a candidate ending in EOS (kept as a
    # beam with ignore_eos) counts one token less: LLM.beam_search's rule. False: by cumulative log-probability, the
    # rule of vLLM's OpenAI server loop. The two differ only for EOS candidates with ignore_eos.
    rank_by_score: bool = False
    nodes: int | None = None  # N, draft forest nodes per depth, width <= N (default: the engine's beam_nodes)
    # a beam whose new token is one of these ids, or whose generated text now contains one of these strings,
    # finishes ("stop"), as a beam ending in EOS does (engine/beams/stops.py)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the returned text keeps the stop string (front ends cut it otherwise)
    # T = 0: diverse beam search (HF's group beam search): the W beams in G groups of W / G, each step the groups in
    # order, a group's token log-probabilities lowered by diversity_penalty x how often earlier groups chose the token
    # at this step (engine/beams/groups.py)
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0

    @staticmethod
    def parse(value: Any, max_width: int, max_nodes: int | None = None,
              limits: RequestLimits | None = None) -> "BeamParams":
        """Validated settings; ``ValueError`` naming ``extra_args['dsbd_beam'][key]`` otherwise. ``max_width``: the
        engine's ``DSBDConfig.max_beam_width``. ``max_nodes``: the most forest nodes per depth the engine reserves
        slots for (``DSBDConfig.max_beam_nodes``, or the request's width when larger; None: no bound here, for the
        front end, which the engine checks again). ``limits`` (the front end's): token ids below the vocabulary,
        ``|length_penalty|`` within :meth:`RequestLimits.length_penalty_bound`, no ``stop`` strings without a
        tokenizer."""
        name = f"extra_args[{BEAM_KEY!r}]"
        if isinstance(value, str):  # the OpenAI server's vllm_xargs carry strings and numbers, never mappings
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"{name} must be a mapping (or a JSON object string) with keys "
                                 f"{list(_BEAM_FIELDS)}, got {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping with keys {list(_BEAM_FIELDS)}, got {value!r}")
        unknown = [k for k in value if k not in _BEAM_FIELDS]
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {unknown}; allowed keys: {list(_BEAM_FIELDS)}")

        def integer(key, lo, hi=None, required=True):
            v = value.get(key)
            if v is None and not required:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                rng_ = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"{name}[{key!r}] must be an integer in {rng_}, got {v!r}")
            return v

        width = value.get("width")
        if isinstance(width, int) and not isinstance(width, bool) and width > max_width:
            raise ValueError(f"{name}['width'] = {width} is above the engine's {max_width} beams per request "
                             f"(max_beam_width: a beam request of width W takes W - 1 scheduler slots for its "
                             f"leaves; up to {max_width} fit, or start the engine with a larger 'max_beam_width')")
        width = integer("width", 1, max_width)
        n = integer("n", 1, width, required=False)
        lp = value.get("length_penalty", 1.0)
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"{name}['length_penalty'] must be a finite number, got {lp!r}")
        if limits is not None and abs(lp) > (bound := limits.length_penalty_bound()):
            raise ValueError(f"{name}['length_penalty'] = {lp!r}: |length_penalty| must be at most {bound} with "
                             f"max_model_len {limits.max_len} (a beam's score divides by its length ** "
                             "length_penalty, which must stay a finite, non-zero number)")
        vocab = limits.vocab if limits is not None else None
        ign, dyn = value.get("ignore_eos", False), value.get("dynamic_width", False)
        rank = value.get("rank_by_score", False)
        inc = value.get("include_stop_str_in_output", False)
        for key, v in (("ignore_eos", ign), ("dynamic_width", dyn), ("rank_by_score", rank),
                       ("include_stop_str_in_output", inc)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}[{key!r}] must be true or false, got {v!r}")
        nodes = value.get("nodes")
        if max_nodes is not None and isinstance(width, int):  # a request's own width is always a valid N
            max_nodes = max(max_nodes, width)
        if max_nodes is not None and isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > max_nodes:
            raise ValueError(f"{name}['nodes'] = {nodes} is above the engine's {max_nodes} draft nodes per depth "
                             "(start the engine with a larger 'beam_nodes')")
        nodes = integer("nodes", width, max_nodes, required=False)
        ids = value.get("stop_token_ids") or []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < (vocab or t + 1) for t in ids):
            span = f"in [0, {vocab - 1}], the model's vocabulary" if vocab else ">= 0"
            raise ValueError(f"{name}['stop_token_ids'] must be a list of token ids (integers {span}), got {ids!r}")
        stop = value.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"{name}['stop'] must be a string or a list of non-empty strings, got {stop!r}")
        if stop and limits is not None and not limits.tokenizer:
            raise ValueError(f"{name}['stop']: stop strings need the model's tokenizer, and this engine runs with "
                             "skip_tokenizer_init (no text); use 'stop_token_ids'")
        groups = integer("num_beam_groups", 1, width, required=False) or 1
        if width % groups:
            raise ValueError(f"{name}['num_beam_groups'] = {groups} must divide the width {width} (each group is a beam "
                             "search of width / num_beam_groups beams)")
        dp = value.get("diversity_penalty", 0.0)
        if isinstance(dp, bool) or not isinstance(dp, (int, float)) or not math.isfinite(dp) or dp < 0:
            raise ValueError(f"{name}['diversity_penalty'] must be a finite number >= 0, got {dp!r}")
        if dp and groups == 1:
            raise ValueError(f"{name}['diversity_penalty'] = {dp} needs 'num_beam_groups' > 1 (the penalty acts "
                             "between groups)")
        return BeamParams(width=width, max_tokens=integer("max_tokens", 1), length_penalty=float(lp),
                          ignore_eos=ign, eos_token_id=integer("eos_token_id", 0, vocab - 1 if vocab else None,
                                                               required=False), n=n,
                          depth=integer("depth", 0, required=False), dynamic_width=dyn, rank_by_score=rank,
                          nodes=nodes, stop_token_ids=tuple(ids), stop=tuple(stop), include_stop_str_in_output=inc,
                          num_beam_groups=groups, diversity_penalty=float(dp))

    def engine_tokens(self) -> int:
        """vLLM ``max_tokens`` for the engine request: more than the slots the trie can ever take (at most
        ``width + 1`` per step), so that vLLM never finishes the request itself; DSBD finishes it."""
        return self.max_tokens * (self.width + 1) + 2

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v := getattr(self, k), tuple) else v for k in _BEAM_FIELDS}


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


# Penalties and logits rules: applied to plain requests per forest node (engine/penalties.py, engine/processors.py); a
# beam request takes none, as vLLM's beam search has none (BeamSearchParams: beam width, max_tokens, ignore_eos,
# temperature, length_penalty), so a beam request that sets one is refused.
_PENALTIES = (
    ("presence_penalty", lambda v: (v or 0.0) != 0.0),
    ("frequency_penalty", lambda v: (v or 0.0) != 0.0),
    ("repetition_penalty", lambda v: (1.0 if v is None else v) != 1.0),
)
_RULES = (
    ("min_p", lambda v: (v or 0.0) > 0.0),
    ("min_tokens", lambda v: (v or 0) > 0),
    ("logit_bias", bool),
    ("allowed_token_ids", lambda v: v is not None),
    ("bad_words", bool),
)
# Structured outputs (``structured_outputs``: JSON, regex, choice, grammar; the OpenAI server's response_format and
# forced tool calls) are served on plain requests, every forest row masked by the grammar after its own path
# (engine/grammar.py), and on beam requests at temperature 0 as vLLM's beam search applies them, without a forest
# (engine/beams/grammar.py); a beam request with them at temperature > 0 is refused in :func:`check_request`.
# SamplingParams a DSBD request may not set: (attribute, what counts as set). Each would have to act on every forest
# node with that node's own history or grammar state (and on the draft alike, for exactness), which is not built.
# Refused, never ignored.
# ``prompt_logprobs`` (vLLM's runner computes them from the prompt rows, which a forest never shares) and
# ``logprob_token_ids`` (gathered from each emitted token's target row, as vLLM's sampler does) are served on plain
# requests; vLLM's beam search has neither, so a beam request that sets one is refused.
# repetition_penalty divides positive logits and multiplies negative ones (vLLM allows any value > 0): within this range
# a float32 logit below 3e32 in magnitude stays finite (vLLM's greedy sampler takes the argmax of infinities; DSBD's
# verification would take log-probabilities of them)
REPETITION_RANGE = (1e-6, 1e6)
_LOGPROB_EXTRAS = (
    ("prompt_logprobs", lambda v: v is not None),
    ("logprob_token_ids", lambda v: v is not None),
)
_REFUSED = (
    ("thinking_token_budget", lambda v: v is not None),
    ("repetition_detection", lambda v: v is not None),
)


def check_beam_logprobs(sampling_params: Any, beam: BeamParams) -> None:
    """``logprobs`` on a beam request: the best beam's per-token logprobs (the chosen token and the ``logprobs``
    best of the row it was chosen from, vLLM's shape), filled in the front end when the request finishes
    (patches/beam_outputs.py). Each beam step ranks the 2W best tokens of each beam's row, so at most 2W
    alternatives are known, and only at temperature 0 (beam sampling keeps the chosen token's log-probability only);
    streamed (``DELTA``) chunks before the last would carry none, so that kind is refused with logprobs."""
    k = getattr(sampling_params, "logprobs", None)
    if k is None:
        return
    top = 2 * beam.width
    if k < 0 or k > top:
        raise ValueError(f"logprobs: a beam request of width {beam.width} returns at most {top} alternatives per "
                         f"token (2 * width: the best tokens of each beam's row, which its beam steps rank), got {k}")
    if k > 0 and (getattr(sampling_params, "temperature", 0.0) or 0.0) >= 1e-5:
        raise ValueError(f"logprobs: alternatives (logprobs = {k} > 0) on a beam request at temperature > 0 (beam "
                         "sampling) are not kept; logprobs = 0 gives the chosen tokens' log-probabilities")
    kind = getattr(getattr(sampling_params, "output_kind", None), "name", None)
    if kind == "DELTA":
        raise ValueError("logprobs: not supported on a streamed beam request (extra_args[" + repr(BEAM_KEY) + "], "
                         "output kind DELTA): the beams' log-probabilities are known when the request finishes; "
                         "leave logprobs out, or do not stream")


def check_request(sampling_params: Any, cfg: DSBDConfig, limits: RequestLimits | None = None) -> int:
    """Validates one request for a DSBD engine; returns its width (:func:`request_width`). ``limits``: the model's
    (the front end passes them; None: the checks that need them are skipped).

    Raises:
        ValueError: an unknown ``dsbd_*`` key in ``extra_args`` (named), a setting the DSBD engine does not apply
            (the message names the parameter), a bad width, a beam request's draft ``depth`` on an engine without
            a draft model, or on a beam request: ``max_tokens`` below what its trie may take, neither
            ``ignore_eos`` nor a beam ``eos_token_id`` (vLLM would stop it on EOS), ``stop`` / ``stop_token_ids`` on its
            SamplingParams (the beams take them in ``dsbd_beam``, at any temperature),
            ``structured_outputs`` at T > 0, with a ``depth`` or with groups, ``logprobs`` above 2 * width, above 0 at T > 0 or streamed (DELTA), a penalty,
            or ``min_p``, ``min_tokens``, ``logit_bias``,
            ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs`` or ``logprob_token_ids``; with ``limits``:
            a token id outside the vocabulary (``dsbd_beam`` ``eos_token_id`` / ``stop_token_ids``, and
            ``allowed_token_ids``, which vLLM bounds by the tokenizer only), a ``length_penalty`` whose powers
            overflow, or ``dsbd_beam`` ``stop`` strings on an engine without a tokenizer.
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    unknown = [k for k in extra if isinstance(k, str) and k.startswith("dsbd_") and k not in REQUEST_KEYS]
    if unknown:
        raise ValueError(f"extra_args: unknown DSBD key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(k) for k in unknown)}; the DSBD request keys are {list(REQUEST_KEYS)}")
    if extra.get(BEAM_KEY) is not None:
        # ValueError naming extra_args['dsbd_beam'][key]
        beam = BeamParams.parse(extra[BEAM_KEY], cfg.max_beam_width, cfg.max_beam_nodes, limits)
        if not cfg.drafting and beam.depth:
            raise ValueError(f"extra_args[{BEAM_KEY!r}]['depth'] = {beam.depth}: this DSBD engine has no forest source "
                             "(no draft model, 'sources': []), so its beam requests have no draft forest; leave 'depth' "
                             "out (or 0)")
        need, mt = beam.engine_tokens(), getattr(sampling_params, "max_tokens", None)
        if mt is not None and mt < need:
            raise ValueError(f"max_tokens: a beam request of width {beam.width} and {beam.max_tokens} tokens needs "
                             f"max_tokens >= {need} on its SamplingParams (its trie takes up to width + 1 slots per "
                             f"step; DSBD ends the request itself), got {mt}")
        if not getattr(sampling_params, "ignore_eos", False) and (beam.ignore_eos or beam.eos_token_id is None):
            raise ValueError(f"ignore_eos: a beam request needs ignore_eos=True on its SamplingParams unless "
                             f"extra_args[{BEAM_KEY!r}]['eos_token_id'] names its EOS (EOS would otherwise be an "
                             "ordinary beam token, and vLLM stops a request whose tokens reach EOS before DSBD "
                             "returns any beam)")
        for name in ("stop", "stop_token_ids"):
            if getattr(sampling_params, name, None):
                raise ValueError(f"{name}: not supported on a beam request's SamplingParams (vLLM would check it on "
                                 "the request's trie slots and settled text, not on each beam); set it in "
                                 f"extra_args[{BEAM_KEY!r}][{name!r}], which each beam obeys")
        if beam.num_beam_groups > 1 and (getattr(sampling_params, "temperature", 0.0) or 0.0) >= 1e-5:
            raise ValueError(f"extra_args[{BEAM_KEY!r}]['num_beam_groups'] = {beam.num_beam_groups}: diverse beam "
                             "search is served at temperature 0 only (group beam sampling is not defined here)")
        if getattr(sampling_params, "structured_outputs", None) is not None:
            if (getattr(sampling_params, "temperature", 0.0) or 0.0) >= 1e-5:
                raise ValueError(f"structured_outputs: not supported on a beam request (extra_args[{BEAM_KEY!r}]) at "
                                 "temperature > 0 (beam sampling under a grammar is not built); beam search "
                                 "(temperature 0) and plain requests with structured outputs are served")
            if beam.depth:
                raise ValueError(f"extra_args[{BEAM_KEY!r}]['depth'] = {beam.depth}: a beam request with "
                                 "structured_outputs drafts no forest; leave 'depth' out (or 0)")
            if beam.num_beam_groups > 1:
                raise ValueError(f"structured_outputs: not supported with extra_args[{BEAM_KEY!r}]['num_beam_groups'] "
                                 f"= {beam.num_beam_groups} (diverse beam search under a grammar is not built)")
        pens = [name for name, is_set in _PENALTIES if is_set(getattr(sampling_params, name, None))]
        if pens:
            raise ValueError(f"{', '.join(pens)}: not applied to a beam request (extra_args[{BEAM_KEY!r}]), as vLLM's "
                             "beam search applies no penalties; set the neutral value in the request "
                             "(repetition_penalty 1, presence_penalty and frequency_penalty 0), or start the engine "
                             "with --generation-config vllm when the model's generation_config.json sets it")
        rules = [name for name, is_set in _RULES if is_set(getattr(sampling_params, name, None))]
        if rules:
            raise ValueError(f"{', '.join(rules)}: not applied to a beam request (extra_args[{BEAM_KEY!r}]), as vLLM's "
                             "beam search has no such setting (BeamSearchParams); leave "
                             f"{'it' if len(rules) == 1 else 'them'} unset on beam requests (plain requests take "
                             f"{'it' if len(rules) == 1 else 'them'})")
        extras = [name for name, is_set in _LOGPROB_EXTRAS if is_set(getattr(sampling_params, name, None))]
        if extras:
            raise ValueError(f"{', '.join(extras)}: not supported on a beam request (extra_args[{BEAM_KEY!r}]), as "
                             "vLLM's beam search returns neither (BeamSearchParams); 'logprobs' gives each beam token's "
                             "log-probability and alternatives; plain requests take "
                             f"{'it' if len(extras) == 1 else 'them'}")
        check_beam_logprobs(sampling_params, beam)
    rep = getattr(sampling_params, "repetition_penalty", None)
    if rep is not None and not REPETITION_RANGE[0] <= rep <= REPETITION_RANGE[1]:
        raise ValueError(f"repetition_penalty must be in [{REPETITION_RANGE[0]:g}, {REPETITION_RANGE[1]:g}] on a DSBD "
                         f"engine, got {rep!r}: further out, penalised float32 logits overflow to infinities, and the "
                         "DSBD sampler needs finite log-probabilities to verify forests")
    allowed = getattr(sampling_params, "allowed_token_ids", None)
    if limits is not None and allowed and not all(_is_int(t) and 0 <= t < limits.vocab for t in allowed):
        raise ValueError(f"allowed_token_ids: token ids must be in [0, {limits.vocab - 1}] (the model's vocabulary), "
                         f"got {[t for t in allowed if not (_is_int(t) and 0 <= t < limits.vocab)][:8]}")
    bad = [name for name, is_set in _REFUSED if is_set(getattr(sampling_params, name, None))]
    if bad:
        names = ", ".join(bad)
        raise ValueError(
            f"{names}: not supported with speculative method {METHOD!r} (the DSBD sampler applies temperature, top_k, "
            "top_p, min_p, the repetition, presence and frequency penalties, logit_bias, allowed_token_ids, bad_words, "
            "min_tokens, seed, stop conditions, logprobs, prompt_logprobs, logprob_token_ids and structured outputs only); leave "
            f"{'it' if len(bad) == 1 else 'them'} unset or use an engine without DSBD"
        )
    return request_width(sampling_params, cfg)
