"""DSBD's own settings: one frozen, validated config carried inside vLLM's ``VllmConfig.additional_config["dsbd"]``.

Where the settings come from (the plugin's patch ``vllm_dsbd.patches.dsbd_knobs`` moves them, before vLLM builds its
``SpeculativeConfig``, which rejects unknown keys):

* ``speculative_config={"method": "dsbd", "model": DRAFT, "num_speculative_tokens": G, "width": 4, ...}``, or
* ``additional_config={"dsbd": {"width": 4, ...}}``, or both (a key given in both places must agree).

``num_speculative_tokens`` as the user gives it is the draft **depth** G. The scheduler must reserve one slot per
scheduled "draft token": a forest has up to ``N = max(width, beam_nodes)`` nodes per depth (``width`` for plain
requests, ``beam_nodes`` for beam requests), and a beam request of width W schedules its W - 1 live leaves after
vLLM's last token (W up to ``max_beam_width``, 64 by default, whatever ``width``), so the plugin builds vLLM's
``SpeculativeConfig`` with ``num_speculative_tokens = max(N * depth + width - 1, max_beam_width - 1)``
(:attr:`DSBDConfig.num_speculative_slots`); the depth stays here.

Without a ``model`` (``speculative_config={"method": "dsbd", "width": 4}``) the engine has no draft model
(``draft=False``) and drafts its forests from draft-free sources (``sources``, default ``["recycle", "lookup"]``:
the target's own recycled top tokens and lookup in the request's text; depth 3 unless given). With ``"sources": []``
it drafts nothing (depth 0): beam requests are in-engine beam search / beam sampling with no forests, other requests
are sampled from the target, one target pass per token, and ``num_speculative_tokens`` is ``max(1, width - 1,
max_beam_width - 1)`` (a beam request's leaves; vLLM needs at least 1).

Per-request settings and checks (``extra_args["dsbd_width"]``, ``["dsbd_beam"]``) are in ``vllm_dsbd/requests.py``.

This module imports no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["ADDITIONAL_CONFIG_KEY", "AUTO_BUDGET", "AUTO_COST", "DEFAULT_DEPTH", "DEFAULT_MAX_BEAM_WIDTH", "METHOD",
           "DSBDConfig", "uses_dsbd"]

METHOD = "dsbd"  # the value of --speculative-method / speculative_config["method"]
ADDITIONAL_CONFIG_KEY = "dsbd"  # VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]
MODES = ("sample", "single", "full")
AUTO_BUDGET = "auto"  # verify_budget: measured at start-up (engine/load.py)
AUTO_COST = "auto"  # cost_model: the table measured at start-up (engine/cost.py)
COST_TABLE_KEYS = ("target_ms", "draft_ms", "step_ms")  # a pinned cost_model table
# the most beams of a beam request when 'max_beam_width' is not given (vLLM's loop has no bound; 64 leaves cost 63
# scheduler slots per request, see DSBDConfig.num_speculative_slots)
DEFAULT_MAX_BEAM_WIDTH = 64
DEFAULT_DEPTH = 3  # the draft depth when an engine that drafts (a draft model or draft-free sources) is given none
SOURCES = ("model", "recycle", "lookup")  # where forest nodes come from (``DSBDConfig.sources``)
FREE_SOURCES = ("recycle", "lookup")  # the default without a draft model


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class DSBDConfig:
    """DSBD settings for one engine (the contract: ``docs/design/algorithm.md`` §1).

    Attributes:
        width: W, the most beams / draft nodes per depth (>= 1).
        depth: gamma, the draft depth; vLLM's ``num_speculative_tokens`` as the user gives it (>= 1 with a draft
            model, 0 without; ``None``: 3 with a draft model, 0 without).
        min_width: the least width the dynamic-width rule may choose (1 <= min_width <= width).
        width_threshold: tau in (0, 1]; dynamic width picks the largest k with Pr[#accepted >= k] >= tau.
        dynamic_width: choose the width per layer (True) or always use ``width`` (False).
        mode: what a request gets (``docs/design/algorithm.md`` §1). "sample" (default): exact target sampling
            (temperature 0: plain greedy decoding) for every width; the draft proposes up to ``width`` nodes per depth
            and each verified layer emits one token (K = 1), so ``width`` only changes how many drafts are checked.
            "single": the paper's single-output-beam mode, opt-in: layers keep K <= ``width`` beams (dynamic width)
            and each iteration emits one of them; for width > 1 its output law depends on how well the draft agrees
            (no fixed target process; each layer is exact given its width). "full" (W live beams across iterations) is
            part of the algorithm but not available in the engine yet, and is rejected. Without a draft model
            only "sample" (no draft layers to keep beams in).
        draft: whether the engine has a draft model (set by the plugin from ``speculative_config["model"]``). False:
            no draft is loaded or run; beam requests are beam search / beam sampling in the engine, other requests
            plain target sampling (``min_width``, ``width_threshold`` and ``dynamic_width`` have no effect).
        verify_budget: load-aware speculation (``engine/load.py``): the most tokens a step schedules (each request
            its root or beam leaves plus its forest) before the draft width, then depth, shrink, down to no draft.
            "auto" (default): with the cost model on, no cap (the cost model weighs the load); without it, the knee
            of the target's forward time, measured at start-up on a GPU, and at least one request's full step; an
            integer >= 1: that budget (a cap under the cost model's choice); None: pinned, every request drafts the
            configured width and depth whatever the load or the acceptance (the cost model is off too). Mode
            "single" is always pinned (its output law depends on the width and depth), as is an engine without a
            draft model (nothing to shrink); an integer there is refused.
        cost_model: each step, each request's draft depth (and a T = 0 beam request's N, from its width up) maximises
            expected tokens per second (``engine/cost.py``) from a table of target and draft pass times by token count
            and the request's pass rate in its earlier steps; depth 0 where drafting does not pay. "auto" (default): the
            table is measured at start-up (on every device); a mapping ``{"target_ms": {tokens: ms}, "draft_ms":
            {tokens: ms}, "step_ms": ms}``: that table (pinned; "step_ms" optional, default 0); None: off (shapes from
            ``verify_budget`` alone). Applies where the shape is load-aware (a draft model, mode "sample",
            ``verify_budget`` not None).
        full_cuda_graphs: let vLLM's full CUDA graphs (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) replay the target
            passes that need no forest attention: steps whose forests are all chains (width 1) with no beam request's
            trie or forest. Other passes run piecewise (attention outside the graphs) or eagerly (``engine/graphs.py``).
            Off by default: not yet checked on a GPU (``tests/engine/test_engine_full_graphs_gpu.py``).
        beam_nodes: N, the nodes per depth of a beam request's draft forest (over-drafting,
            ``docs/design/algorithm.md`` §1, ``docs/design/beams.md`` §3.3): at T = 0 the draft's N best (beam, token)
            pairs per depth, at T > 0 N draws without replacement from the draft's joint; a layer passes when the
            target's W new beams are all drafted, so N > W makes layers pass more often with an imperfect draft. An
            integer >= ``width``, or None (default): each beam request's own width. A beam request may set its own
            (``extra_args["dsbd_beam"]["nodes"]``, at most this, or ``width`` when None). Needs a forest source. Plain
            requests keep ``width`` nodes per depth.
        sources: where forest nodes come from, a list of "model" (the draft model), "recycle" (the target's own top
            tokens from the rows it computed for the request: each live beam, each verified forest node, each plain
            root) and "lookup" (continuations of each beam's or sequence's last tokens in its prompt, its own output
            and its sibling beams). None (default): ``["model"]`` with a draft model, ``["recycle", "lookup"]``
            without; ``[]``: no forests (the gamma = 0 engine). "model" is there exactly when a draft model is. Nodes
            of both draft-free sources are scored by beam score + estimated log-probability, N per depth,
            deduplicated (``engine/source_drafter.py``); with "model" beside them, each node's draft row is mixed
            with the sources' candidates there (``engine/mixing.py``).
        max_beam_slots: the most KV slots one beam request may hold (prompt + its trie, ``docs/design/beams.md``
            §3.3), which may exceed ``max_model_len``: a beam request's slots hold every beam's tokens, while its
            positions stay the true token positions (at most prompt + max_tokens <= ``max_model_len``). The engine
            sizes its per-request block tables and token buffers for ``max(max_model_len, max_beam_slots)``
            (:meth:`slot_len`) and refuses to start when its KV pool cannot hold one such request. None (default):
            ``max_model_len`` (beam slots count against the context length, as before).
        max_beam_width: the most beams one beam request may have (``LLM.beam_search``'s ``beam_width``, OpenAI
            ``n``, ``dsbd_beam``'s ``width``), apart from ``width`` (plain requests' draft nodes per depth). A beam
            request of width W schedules its W - 1 leaves as draft tokens, so the scheduler's slots per request
            (:attr:`num_speculative_slots`) are at least ``max_beam_width - 1``; its forest takes the slots left
            (narrowed, or none at the widest). None (default): ``max(width, DEFAULT_MAX_BEAM_WIDTH)`` = 64 for the
            default width, or ``width`` with ``full_cuda_graphs`` (whose graphs replay passes of exactly 1 +
            ``num_speculative_tokens`` tokens per request).
    """

    width: int = 2
    depth: int | None = None
    min_width: int = 1
    width_threshold: float = 0.9
    dynamic_width: bool = True
    mode: str = "sample"
    draft: bool = True
    verify_budget: int | str | None = AUTO_BUDGET
    cost_model: str | dict | None = AUTO_COST
    full_cuda_graphs: bool = False
    beam_nodes: int | None = None
    sources: tuple[str, ...] | None = None
    max_beam_slots: int | None = None
    max_beam_width: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.draft, bool):
            raise ValueError(f"DSBD config: 'draft' must be true or false, got {self.draft!r}")
        self._check_sources()
        if self.depth is None:
            object.__setattr__(self, "depth", DEFAULT_DEPTH if self.drafting else 0)
        elif not self.drafting and not (_is_int(self.depth) and self.depth == 0):
            raise ValueError(
                f"DSBD config: 'depth' (num_speculative_tokens: the draft depth) = {self.depth!r} needs a forest "
                "source, and this engine has none ('sources': []): give 'sources' (e.g. [\"recycle\", \"lookup\"]) "
                "or a draft model (--spec-model), or leave 'depth' and num_speculative_tokens out for an engine "
                "without forests (beam search and beam sampling in the engine, plain requests sampled from the target)"
            )
        for key in ("width", "depth", "min_width") if self.drafting else ("width", "min_width"):
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
        for key in ("dynamic_width", "full_cuda_graphs"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"DSBD config: {key!r} must be true or false, got {getattr(self, key)!r}")
        if self.mode == "full":
            raise ValueError(
                "DSBD config: 'mode'='full' (full-width mode: W live beams across iterations) is not available in "
                "the engine yet; use mode='sample' (exact target sampling) or mode='single'"
            )
        if self.mode not in MODES:
            raise ValueError(f"DSBD config: 'mode' must be one of {list(MODES)}, got {self.mode!r}")
        if not self.draft and self.mode != "sample":
            raise ValueError(
                f"DSBD config: 'mode'={self.mode!r} keeps beams in draft layers and needs a draft model, and none is "
                "given: set speculative_config['model'] (--spec-model), or leave 'mode' out (beam requests are beam "
                "search / beam sampling in the engine without a draft)"
            )
        self._check_budget()
        n = self.beam_nodes
        if n is not None:
            if not _is_int(n) or n < self.width:
                raise ValueError(f"DSBD config: 'beam_nodes' must be an integer >= 'width' ({self.width}) or null "
                                 f"(each beam request's width), got {n!r}")
            if not self.drafting:
                raise ValueError(f"DSBD config: 'beam_nodes' = {n} sets the nodes per depth of beam requests' draft "
                                 "forests, and this engine has no forest source: leave 'beam_nodes' out")
        self._check_cost_model()
        m = self.max_beam_slots
        if m is not None and (not _is_int(m) or m < 1):
            raise ValueError(f"DSBD config: 'max_beam_slots' must be an integer >= 1 (KV slots per beam request) or "
                             f"null (max_model_len), got {m!r}")
        b = self.max_beam_width
        if b is None:
            object.__setattr__(self, "max_beam_width", self.width if self.full_cuda_graphs
                               else max(self.width, DEFAULT_MAX_BEAM_WIDTH))
        elif not _is_int(b) or b < 1:
            raise ValueError(f"DSBD config: 'max_beam_width' must be an integer >= 1 (the most beams of a beam "
                             f"request) or null ({DEFAULT_MAX_BEAM_WIDTH}, or 'width' when larger), got {b!r}")

    def slot_len(self, max_model_len: int) -> int:
        """The most KV slots (tokens in vLLM's list) one request may hold in the engine: ``max_model_len``, or
        ``max_beam_slots`` when larger (beam requests only; others stay within ``max_model_len``)."""
        return max(max_model_len, self.max_beam_slots or 0)

    def _check_sources(self) -> None:
        src = self.sources
        if src is None:
            object.__setattr__(self, "sources", ("model",) if self.draft else FREE_SOURCES)
            return
        if isinstance(src, str) or not isinstance(src, (list, tuple)) or any(s not in SOURCES for s in src) \
                or len(set(src)) != len(src):
            raise ValueError(f"DSBD config: 'sources' must be a list of distinct names from {list(SOURCES)} (or [] "
                             f"for no forests), got {src!r}")
        src = tuple(src)
        if ("model" in src) != self.draft:
            raise ValueError(f"DSBD config: 'sources' = {list(src)} " + (
                "names 'model' and this engine has no draft model: give one (--spec-model) or leave 'model' out"
                if not self.draft else "leaves out 'model' and the engine has a draft model: add 'model' or leave "
                "the draft model out (--spec-model)"))
        object.__setattr__(self, "sources", src)

    @property
    def drafting(self) -> bool:
        """Whether the engine drafts forests at all: a draft model, or a draft-free source."""
        return bool(self.sources)

    @property
    def free_sources(self) -> tuple[str, ...]:
        """The draft-free sources ("recycle", "lookup") this engine drafts from (alone, or mixed into the draft
        model's rows when "model" is there too)."""
        return tuple(s for s in self.sources if s != "model")

    @property
    def max_beam_nodes(self) -> int:
        """The most nodes per depth a beam request's forest may have: ``beam_nodes``, or ``width`` when None."""
        return self.width if self.beam_nodes is None else self.beam_nodes

    def _check_budget(self) -> None:
        b = self.verify_budget
        if not (b is None or b == AUTO_BUDGET or (_is_int(b) and b >= 1)):
            raise ValueError(f"DSBD config: 'verify_budget' must be {AUTO_BUDGET!r} (measured at start-up), an integer "
                             f">= 1 (tokens per step) or null (pinned: the configured width and depth), got {b!r}")
        if _is_int(b) and not self.drafting:
            raise ValueError(f"DSBD config: 'verify_budget' = {b} shrinks draft forests, and this engine has no forest "
                             "source: leave 'verify_budget' out")
        if _is_int(b) and self.mode == "single":
            raise ValueError(f"DSBD config: 'verify_budget' = {b} with mode='single': that mode's output law depends "
                             "on the width and depth, so they are pinned (not load-aware); leave 'verify_budget' out")

    def _check_cost_model(self) -> None:
        c = self.cost_model
        if c is None or c == AUTO_COST:
            return
        table = isinstance(c, Mapping) and "target_ms" in c and "draft_ms" in c and set(c) <= set(COST_TABLE_KEYS)
        for key in ("target_ms", "draft_ms") if table else ():
            t = c[key]
            table = table and isinstance(t, Mapping) and len(t) > 0 and all(
                str(n).isdigit() and int(n) >= 1 and not isinstance(v, bool) and isinstance(v, (int, float))
                and v >= 0 for n, v in t.items())
        step = c.get("step_ms", 0) if table else None
        if not table or isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0:
            raise ValueError(f"DSBD config: 'cost_model' must be {AUTO_COST!r} (measured at start-up), null (off) or a "
                             "table {'target_ms': {tokens: ms}, 'draft_ms': {tokens: ms}, 'step_ms': ms} (token "
                             f"counts >= 1, times >= 0; 'step_ms' optional), got {c!r}")
        if not self.drafting or self.mode == "single":
            raise ValueError("DSBD config: a 'cost_model' table chooses draft depths, and this engine "
                             + ("has no forest source" if not self.drafting else "is in mode 'single', whose shape is "
                                "pinned") + ": leave 'cost_model' out")
        object.__setattr__(self, "cost_model", {k: ({str(n): float(v) for n, v in c[k].items()}
                                                    if k != "step_ms" else float(c[k])) for k in c})

    @property
    def cost_aware(self) -> bool:
        """Whether the cost model chooses each request's draft depth and T = 0 beam requests' N (``engine/cost.py``):
        load-aware, and a ``cost_model`` given ("auto" or a table)."""
        return self.load_aware and self.cost_model is not None

    @property
    def load_aware(self) -> bool:
        """Whether the draft shape follows the load (``engine/load.py``): a forest source, mode "sample", a budget."""
        return self.drafting and self.mode == "sample" and self.verify_budget is not None

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
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @property
    def forest_slots(self) -> int:
        """Slots a full forest step takes, ``N * depth + width - 1``: one per forest node (``N`` =
        :attr:`max_beam_nodes` >= ``width`` per depth) plus the ``width - 1`` leaves of a beam request of the engine's
        width; without a forest source ``max(1, width - 1)``. A draft model writes a forest's draft K/V ahead of the
        target, so this many KV slots are vLLM's lookahead per request (patch ``beam_scheduler``)."""
        if not self.drafting:
            return max(1, self.width - 1)
        return self.max_beam_nodes * self.depth + self.width - 1

    @property
    def num_speculative_slots(self) -> int:
        """Speculative token slots the scheduler reserves per request: :attr:`forest_slots`, or the
        ``max_beam_width - 1`` leaves of the widest beam request when more (its forest takes what is left).

        This is what vLLM's ``SpeculativeConfig.num_speculative_tokens`` holds for method "dsbd".
        """
        return max(self.forest_slots, self.max_beam_width - 1)

    def _slots_rule(self) -> str:
        forest = (f"max(1, width-1) = {self.forest_slots} (width {self.width}, no forest source)" if not self.drafting
                  else f"N*depth + width-1 = {self.forest_slots} (N = beam_nodes or width = {self.max_beam_nodes}, "
                  f"width {self.width}, depth {self.depth})")
        return f"{self.num_speculative_slots} slots: the larger of {forest} and max_beam_width-1 = " \
               f"{self.max_beam_width - 1}"

    def describe(self) -> str:
        """The settings and what they mean, in one line: a DSBD engine's start-up log line (``engine/runner.py``).
        It says why vLLM's logged ``num_spec_tokens`` is not the depth the user gave (scheduler slots, not depth),
        and which width settings act in which mode (``dynamic_width`` acts in mode "single" only)."""
        leaves = f"a beam request's {self.width - 1} lea{'f' if self.width == 2 else 'ves'} after its first"
        slots = f"vLLM's num_spec_tokens={self.num_speculative_slots} is the scheduler's slots per request, " + (
            f"max(1, width-1): {leaves}" + (" (vLLM needs at least 1)" if self.width == 1 else "")
            if not self.drafting else
            (f"width*depth + width-1: {self.width * self.depth} forest nodes + {leaves}"
             if self.max_beam_nodes == self.width else
             f"beam_nodes*depth + width-1: {self.max_beam_nodes * self.depth} beam-forest nodes + {leaves}"))
        if self.num_speculative_slots > self.forest_slots:
            slots = (f"vLLM's num_spec_tokens={self.num_speculative_slots} is the scheduler's slots per request, "
                     f"max_beam_width-1: the leaves of a beam request of up to {self.max_beam_width} beams (its "
                     f"forest in the slots left), more than a full forest step's {self.forest_slots}")
        if not self.drafting:
            beams = f"{self.max_beam_width} beam{'s' if self.max_beam_width > 1 else ''}"
            return (f"width {self.width}, no draft model and no forest source: beam requests (up to {beams}) run beam search / beam "
                    f"sampling in the engine, other requests one target pass per token; {slots}")
        if self.mode == "sample":
            mode = ("mode sample: every request is sampled exactly from the target (greedy-identical at temperature "
                    f"0); a verified layer checks its up to {self.width} drafts and emits one token, so the width is "
                    "how many drafts are checked per depth ('dynamic_width' has no effect in this mode)")
        else:
            mode = (f"mode single: a layer keeps up to {self.width} beams, " + (
                f"its width chosen per layer (dynamic width: min_width {self.min_width}, width_threshold "
                f"{self.width_threshold})" if self.dynamic_width else f"always {self.width} (fixed width)"))
        load = ("the draft shape is pinned (verify_budget null)" if not self.load_aware else
                f"forests shrink when a step's tokens exceed verify_budget {self.verify_budget!r} (load-aware)")
        src = "a draft model" if self.draft else "no draft model, draft-free sources " + "+".join(self.sources)
        return (f"forests from {src}; draft depth {self.depth} (num_speculative_tokens / --spec-tokens as given), "
                f"width {self.width} "
                f"(draft nodes per depth): up to {self.width * self.depth} forest nodes verified per target pass and up to "
                f"{self.depth + 1} tokens emitted per pass; {mode}; {load}; {slots}")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DSBDConfig:
        """The config of an engine built with ``--speculative-method dsbd`` (through ``EngineArgs``/``LLM``/``serve``
        with the plugin registered), checked against the ``SpeculativeConfig`` vLLM built.

        Raises:
            ValueError: the engine is not a DSBD engine, ``additional_config["dsbd"]`` is missing or invalid, its
                ``draft`` flag disagrees with ``speculative_config.model``, or ``num_speculative_tokens`` is not
                :attr:`num_speculative_slots`.
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
        model = getattr(spec, "model", None)
        if cfg.draft != (model is not None):
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['draft'] is {cfg.draft} but the engine's "
                f"speculative_config.model is {model!r}: build DSBD engines through EngineArgs, LLM(...) or "
                "`vllm serve` with the vllm_dsbd plugin registered"
            )
        if spec.num_speculative_tokens != cfg.num_speculative_slots:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens} but DSBD needs "
                f"{cfg._slots_rule()}"
            )
        return cfg


def uses_dsbd(vllm_config: Any) -> bool:
    """Whether the engine was configured with ``--speculative-method dsbd``."""
    return getattr(getattr(vllm_config, "speculative_config", None), "method", None) == METHOD
