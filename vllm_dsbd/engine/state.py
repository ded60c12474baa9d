"""What the DSBD engine remembers about each request between engine steps: its seed and sampling settings (fixed when it
registers, new or resumed), the forest drafted last step (vLLM's "draft tokens" for it) and how far the draft model's KV
cache is valid. Seeds and why draft K/V are recomputed: docs/design/forests.md §3.4.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm_dsbd import envs
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core.forest import Forest
from vllm_dsbd.core.params import BatchParams, HostFacts
from vllm_dsbd.core.sources import SourceIndex
from vllm_dsbd.requests import BEAM_KEY, BeamParams, request_width

from . import bare
from .beams.grammar import BeamGrammar
from .beams.stops import StopRule
from .beams.trie import BeamRequest
from .cost import Acceptance
from .penalties import RequestPenalties
from .processors import RequestRules

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy
# "0": beam requests keep their dead trie slots and their common prefix in the trie (no re-layout); for comparisons
# in benchmarks/engine/beams.py and tests, not a user setting. Read as each beam request registers
# (:meth:`Requests.register`), so that one engine serves requests with and without it
RELAYOUT_ENV = envs.BEAM_RELAYOUT


@dataclass
class PendingForest:
    """A drafted forest waiting for the target's verification pass."""

    forest: Forest  # one request: [1, G, W]
    tokens: list[int]  # node tokens in compact (depth-major) order: what vLLM schedules as draft tokens
    parents: list[int]  # compact parent index of each node (-1 = child of the root)
    depths: list[int]  # 1-based depth of each node
    root_pos: int  # position of the root token (the last emitted token, not yet in the target cache)
    # ``sampler.truncate(forest, ., len(tokens))`` (nothing cut: the depth capped at the last valid layer), built by
    # the drafter for the whole batch at once; None: compute it
    uncut: Forest | None = None
    depth: int | None = None  # ``forest.depth`` as an int (read without a device synchronisation); None: read it


@dataclass
class RequestState:
    req_id: str
    seed: int
    width: int  # W of this request (<= the engine's width)
    temperature: float  # 0 = deterministic
    top_k: int  # 0 = off
    top_p: float  # 1 = off
    eos: int  # -1 = EOS is an ordinary token (ignore_eos or none)
    max_tokens: int | None
    draft_len: int = 0  # positions [0, draft_len) have valid draft-model K/V
    pending: PendingForest | None = None
    beam: BeamRequest | None = None  # a beam request (extra_args["dsbd_beam"]): its trie and live beams
    penalties: RequestPenalties | None = None  # a plain request's repetition / presence / frequency penalties
    rules: RequestRules | None = None  # a plain request's min_p, min_tokens, logit_bias, allowed_token_ids, bad_words
    # structured outputs: the worker's matcher (``engine/grammar.py``), whose masks every row of the request's forests
    # and drafts takes (docs/deviations.md D22)
    structured: bool = False
    grammar: Any = None
    seeded: bool = False  # the request gave a seed (its T > 0 draws then depend on it alone)
    # vLLM's sampler draws its token when it has no forest (engine/bare.py: a step without forests is vLLM's step)
    vllm_sampler: bool = False
    # statistics (M3)
    iterations: int = 0
    layers_passed: int = 0
    widths: list[int] = field(default_factory=list)
    # the cost model's estimate of its per-layer pass rate, from the forests it verified (engine/cost.py)
    acceptance: Acceptance = field(default_factory=Acceptance)
    forest_nodes: int = 0  # nodes per depth of its pending forest (the cost model's choice, or its width)
    asked_depth: int = 0  # the depth its last drafting job asked (the cost model's, capped); read at verification
    # an engine with draft-free sources: the request's recycle table and lookup index (engine/source_drafter.py)
    sources: SourceIndex | None = None
    # an engine whose draft is an EAGLE-3 head: the target's features its next catch-up pass reads (engine/head.py)
    head_features: Any = None


class Requests:
    """The engine's per-request states, keyed by request id."""

    def __init__(self, cfg: DSBDConfig, seed: int | None, load_tokenizer=None, compile_grammar=None):
        self.cfg = cfg
        # (req_id, sampling params) -> a structured request's ``grammar.RequestGrammar`` (None: none compiled)
        self._compile_grammar = compile_grammar
        # the model's tokenizer, loaded on first use (beam requests' stop strings): a callable returning it
        self._load_tokenizer, self._tokenizer = load_tokenizer, None
        self._rng = random.Random(0 if seed is None else seed)
        self._states: dict[str, RequestState] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def register(self, req_id: str, sampling_params, num_computed_tokens: int, prompt_len: int = 0,
                 reasoning: dict | None = None, prompt=()) -> RequestState:
        """(Re)registers a request that starts (or restarts after a preemption) with ``num_computed_tokens`` tokens
        already in the cache. Their draft K/V are NOT trusted (the request that computed a cached block need not have
        run the draft over it, and a draft over zeros or stale K/V drafts badly), so its first draft pass covers the
        whole context. A resumed beam request keeps its trie (its slots are recomputed from vLLM's token list).
        ``reasoning`` / ``prompt``: a plain structured request's reasoning gate (``grammar.Compiler``)."""
        old = self._states.get(req_id)
        if old is not None:  # resumed: keep the seed, forget the forest and the draft cache
            old.pending = None
            old.asked_depth = 0
            old.draft_len = 0
            old.head_features = None
            if old.beam is not None:
                old.beam.resumed()
            return old
        sp = sampling_params
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        temp = float(sp.temperature)
        eos = getattr(sp, "eos_token_id", None)
        st = RequestState(
            req_id=req_id,
            seed=int(seed),
            width=request_width(sp, self.cfg),
            temperature=0.0 if temp < _EPS else temp,
            top_k=int(sp.top_k) if sp.top_k and sp.top_k > 0 else 0,
            top_p=float(sp.top_p),
            eos=-1 if (sp.ignore_eos or eos is None) else int(eos),
            max_tokens=sp.max_tokens,
            draft_len=0,  # prefix-cache hits have the target's K/V, not necessarily the draft's
            structured=getattr(sp, "structured_outputs", None) is not None,
            seeded=sp.seed is not None,
        )
        beam = (sp.extra_args or {}).get(BEAM_KEY)
        if beam is None:
            st.penalties = RequestPenalties.of(sp)
            st.rules = RequestRules.of(sp)
            if st.structured and self._compile_grammar is not None:
                st.grammar = self._compile_grammar(req_id, sp, reasoning, prompt)
            st.vllm_sampler = bare.vllm_samples(st)
        else:
            bp = BeamParams.parse(beam, self.cfg.max_beam_width, self.cfg.max_beam_nodes)
            # N, the forest's nodes per depth: the request's, else the engine's beam_nodes, else the request's width
            nodes = bp.nodes if bp.nodes is not None else max(bp.width, self.cfg.beam_nodes or 0)
            st.beam = BeamRequest(bp, prompt_len, st.temperature, st.seed, st.top_k, st.top_p,
                                  self.cfg.width_threshold, self.cfg.min_width,
                                  relayout=envs.read(only=(envs.BEAM_RELAYOUT,)).beam_relayout, nodes=nodes,
                                  stops=self._stops(bp))
            if st.structured and self._compile_grammar is not None:  # vLLM's beam search under a grammar
                st.beam.grammar = BeamGrammar(self._compile_grammar(req_id, sp))
        self._states[req_id] = st
        return st

    def _stops(self, bp: BeamParams) -> StopRule | None:
        """A beam request's stop token ids and stop strings (the tokenizer is loaded for the first stop strings)."""
        if not (bp.stop_token_ids or bp.stop):
            return None
        decode = None
        if bp.stop:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            tok = self._tokenizer
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (vLLM's default)
        return StopRule(bp.stop_token_ids, bp.stop, decode)

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._states.pop(r, None)

    def __len__(self) -> int:
        return len(self._states)


def batch_params(states: list[RequestState], depth: list[int], cfg: DSBDConfig) -> BatchParams:
    """The core's per-request parameters of plain requests (drafting and verification alike), with their host facts
    from the same values (no reduction over the tensors)."""
    temperature, top_k, top_p = [s.temperature for s in states], [s.top_k for s in states], [s.top_p for s in states]
    width, eos = [s.width for s in states], [s.eos for s in states]
    params = BatchParams.make(
        len(states), temperature=temperature, top_k=top_k, top_p=top_p, width=width, seed=[s.seed for s in states],
        eos=eos, depth=depth, min_width=[min(cfg.min_width, s.width) for s in states],
        tau=cfg.width_threshold, dynamic=cfg.dynamic_width, single=True, max_k=1 if cfg.mode == "sample" else 0)
    return params.with_(facts=HostFacts.of_values(temperature, top_k, top_p, width, eos, [True] * len(states)))
