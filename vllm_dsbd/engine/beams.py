"""Beams inside one vLLM request (DESIGN.md §2, "Full width lives inside one vLLM request"), without a draft (γ = 0).

A beam request keeps its W live beams as a trie of nodes stored in the request's own KV slots. vLLM's token list of
the request is always ``prompt + trie node tokens in slot order`` (node j at slot ``P + j``, P = prompt length), so
vLLM's tokens, block hashes and recomputation after a preemption see the true token of every slot. The trie's
leaves (the live beams' last tokens) are always its last nodes: leaf 0 is vLLM's last token (not yet in the cache)
and leaves 1.. are scheduled as the request's "draft tokens". A leaf's RoPE position is ``P - 1 + depth`` and its
attention sees the prompt and its own ancestors (``attention.ForestBatch`` with context P over the trie).

One beam step, when the logits of every leaf are in (:meth:`BeamRequest.step`):

* T = 0: vLLM's ``LLM.beam_search``: each live beam's top ``2W`` tokens are candidates (raw log-probabilities,
  cumulative scores summed in float64 as vLLM sums Python floats); a candidate ending in EOS finishes (unless EOS is
  ignored); the ``W`` best other candidates (stable sort, as vLLM's ``sorted``) are the new live beams.
* T > 0: target beam sampling (``core.beam_step``): ``W`` (beam, token) pairs drawn without replacement from the
  joint; a drawn pair ending in EOS finishes.

Then the leaves that got a child are kept and moved to the first leaf slots (:class:`StepResult` says which slots
move), except that leaf 0's slot is never reused by another leaf (a pruned leaf 0 stays as a dead node), so vLLM's
token at every slot stays true. What goes back to vLLM is the row ``[kept leaves after leaf 0's slot] + [new leaf
0]``: vLLM appends it, counts ``len(row) - 1`` accepted drafts and rolls back the rest, which lands exactly on the
new layout. When vLLM scheduled (or, after a preemption, recomputed) only some of the leaves, the step waits: the
logits of the computed leaves are kept and the row is the next leaves (:meth:`BeamRequest.partial`).

A pruned subtree deeper than the leaves stays in the slots as dead nodes (no re-layout yet): KV held is the prompt
plus every node that was ever kept, at most ``W + 1`` per step.

This module imports no vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsbd.core import rng
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.sampling import beam_step

from vllm_dsbd.config import BEAM_KEY  # SamplingParams.extra_args[BEAM_KEY]: the beam request's settings (a dict)

_BEAM_FIELDS = ("width", "max_tokens", "length_penalty", "ignore_eos", "eos_token_id", "n")


@dataclass(frozen=True)
class BeamParams:
    """What a beam request asks for (``extra_args["dsbd_beam"]``); temperature and seed are the request's own."""

    width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    eos_token_id: int | None = None
    n: int | None = None  # beams returned (default: width)

    @staticmethod
    def parse(value: Any, max_width: int) -> "BeamParams":
        """Validated settings; ``ValueError`` naming ``extra_args['dsbd_beam'][key]`` otherwise."""
        name = f"extra_args[{BEAM_KEY!r}]"
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
            raise ValueError(f"{name}['width'] = {width} is above the engine's DSBD width {max_width} "
                             "(start the engine with a larger 'width')")
        width = integer("width", 1, max_width)
        n = integer("n", 1, width, required=False)
        lp = value.get("length_penalty", 1.0)
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"{name}['length_penalty'] must be a finite number, got {lp!r}")
        ign = value.get("ignore_eos", False)
        if not isinstance(ign, bool):
            raise ValueError(f"{name}['ignore_eos'] must be true or false, got {ign!r}")
        return BeamParams(width=width, max_tokens=integer("max_tokens", 1), length_penalty=float(lp),
                          ignore_eos=ign, eos_token_id=integer("eos_token_id", 0, required=False), n=n)

    def engine_tokens(self) -> int:
        """vLLM ``max_tokens`` for the engine request: more than the slots the trie can ever take (at most
        ``width + 1`` per step), so that vLLM never finishes the request itself; DSBD finishes it."""
        return self.max_tokens * (self.width + 1) + 2

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _BEAM_FIELDS}


@dataclass
class Finished:
    tokens: list[int]
    cum_logprob: float
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class StepResult:
    """What the runner does after a beam step of one request."""

    row: list[int]  # tokens returned to vLLM (appended; len(row) - 1 counted as accepted drafts)
    moves: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot) K/V moves
    next_drafts: list[int] = field(default_factory=list)  # the leaves vLLM schedules as draft tokens next
    finished: bool = False


@dataclass
class _Live:
    node: int  # trie index of the beam's last token (-1: the prompt)
    score: float  # float64 cumulative raw log-probability (what vLLM reports and ranks by)
    sample_score: float  # the beam-sampling score log P (T > 0)


class BeamRequest:
    """The trie and live beams of one beam request."""

    def __init__(self, params: BeamParams, prompt_len: int, temperature: float, seed: int, top_k: int = 0,
                 top_p: float = 1.0):
        self.params = params
        self.top_k, self.top_p = top_k, top_p  # on the flattened joint (T > 0 only, as in core.joint)
        self.prompt_len = prompt_len
        self.temperature = temperature
        self.seed = seed
        self.tokens: list[int] = []  # trie node tokens, node j at slot prompt_len + j
        self.parents: list[int] = []  # -1: child of the prompt's last token
        self.depths: list[int] = []  # 1-based
        self.logprobs: list[float] = []  # raw log-probability of the node's token after its parent
        self.live: list[_Live] = [_Live(-1, 0.0, 0.0)]
        self.finished: list[Finished] = []
        self.steps = 0
        self.leaf_logits: list[torch.Tensor] = []  # logits of the leaves computed so far this step
        # leaves that are in vLLM's token list (leaf fixed - 1 is its last token): their slots cannot move
        self.fixed = 1

    # layout --------------------------------------------------------------------------------------------------
    @property
    def first_leaf_slot(self) -> int:
        """Slot of leaf 0 (= vLLM's last token, not yet computed at the start of a step)."""
        node = self.live[0].node
        return self.prompt_len - 1 if node < 0 else self.prompt_len + node

    @property
    def num_leaves(self) -> int:
        return len(self.live)

    def position(self, slot: int) -> int:
        """RoPE position of the token at ``slot``."""
        return slot if slot < self.prompt_len else self.prompt_len - 1 + self.depths[slot - self.prompt_len]

    def leaf_tokens(self, start: int) -> list[int]:
        return [self.tokens[b.node] for b in self.live[start:] if b.node >= 0]

    # the step ------------------------------------------------------------------------------------------------
    def partial(self, logits: torch.Tensor) -> StepResult | None:
        """Records the logits of the next computed leaves ([m, V]); returns the row that moves on to the leaves
        still missing, or None when every leaf is now in (call :meth:`step`)."""
        self.leaf_logits.extend(logits.float().cpu().unbind(0))
        m = len(self.leaf_logits)
        if m >= self.num_leaves:
            return None
        if m < self.fixed:
            raise RuntimeError(f"DSBD beams: {m} leaf logits after a pass that computed leaf {self.fixed - 1}")
        nxt = self.leaf_tokens(m)  # leaves m.. (never the prompt: a first step has one leaf)
        # vLLM computed leaves < m; the row makes leaf m its new last token and leaves m+1.. the drafts
        row = [self.tokens[b.node] for b in self.live[self.fixed : m + 1]]
        self.fixed = m + 1
        return StepResult(row=row, next_drafts=nxt[1:])

    def step(self, eos_score_token: int | None) -> StepResult:
        """One beam step over the collected leaf logits. ``eos_score_token``: the EOS id vLLM's length penalty
        looks at (the tokenizer's, even when EOS is ignored)."""
        logits = torch.stack(self.leaf_logits)  # [Wl, V]
        self.leaf_logits = []
        self._eos_score = eos_score_token
        p = self.params
        eos = None if p.ignore_eos else p.eos_token_id
        lp = torch.log_softmax(logits.float(), dim=-1)
        if self.temperature <= 0.0:
            cands = self._search(lp, eos)
        else:
            cands = self._sample(logits, lp, eos)
        self.steps += 1
        return self._apply(cands)

    def _search(self, lp: torch.Tensor, eos: int | None) -> list[tuple[int, int, float, float, float]]:
        W = self.params.width
        vals, idx = torch.topk(lp, min(2 * W, lp.shape[-1]), dim=-1)
        cands = []
        for b, beam in enumerate(self.live):
            for v, t in zip(vals[b].tolist(), idx[b].tolist()):
                cum = beam.score + v
                if eos is not None and t == eos:
                    self._finish(beam, [t], [v], cum, "stop")
                else:
                    cands.append((b, t, cum, v, cum))
        cands = sorted(cands, key=lambda c: c[2], reverse=True)  # stable, as vLLM's sorted(..., reverse=True)
        return cands[:W]

    def _sample(self, logits: torch.Tensor, lp: torch.Tensor, eos: int | None):
        Wl, V = logits.shape
        params = BatchParams.make(1, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  width=self.params.width, seed=self.seed, eos=-1, single=False)
        scores = torch.tensor([[b.sample_score for b in self.live]], dtype=torch.float32)
        live = torch.ones(1, Wl, dtype=torch.bool)
        pos = torch.tensor([self.prompt_len + self.steps], dtype=torch.int64)
        st = beam_step(logits[None], scores, live, params, pos, rng.Stream.TARGET_DRAW)
        cands = []
        for j in torch.nonzero(st.valid[0]).flatten().tolist():
            b, t = int(st.parent[0, j]), int(st.token[0, j])
            v = float(lp[b, t])
            beam = self.live[b]
            if eos is not None and t == eos:
                self._finish(beam, [t], [v], beam.score + v, "stop")
            else:
                cands.append((b, t, beam.score + v, v, float(st.score[0, j])))
        return cands

    def _apply(self, cands) -> StepResult:
        """Compacts the kept leaves, appends the new ones, and builds the row for vLLM."""
        P, old = self.prompt_len, self.live
        done = not cands or self.steps >= self.params.max_tokens
        if done:  # the last step: the new beams are final ("length"); nothing more is scheduled
            for b, t, cum, v, _ in cands:
                self._finish(old[b], [t], [v], cum, "length")
            self.live = []
            # vLLM appends one token before the scheduler stops the request (patch beam_scheduler); any id will do
            return StepResult(row=[self.tokens[old[0].node] if old[0].node >= 0 else 0], finished=True)
        kept = sorted({b for b, *_ in cands})
        moves: list[tuple[int, int]] = []
        if old[0].node < 0:  # first step: the only leaf is the prompt's last token
            base, new_index = len(self.tokens), {0: -1}
            row_kept: list[int] = []
        else:
            # leaves are nodes start .. start + Wl - 1; the first `fixed` are in vLLM's token list and stay where
            # they are (dead ones as holes), the kept ones after them move down
            start, f = old[0].node, self.fixed
            new_index = {b: old[b].node for b in kept if b < f}
            dst = start + f
            for k, b in enumerate([b for b in kept if b >= f]):
                src_node, dst_node = old[b].node, dst + k
                new_index[b] = dst_node
                if src_node != dst_node:
                    moves.append((P + src_node, P + dst_node))
                    for arr in (self.tokens, self.parents, self.depths, self.logprobs):
                        arr[dst_node] = arr[src_node]
            base = dst + sum(1 for b in kept if b >= f)
            for arr in (self.tokens, self.parents, self.depths, self.logprobs):
                del arr[base:]
            row_kept = self.tokens[start + f : base]
        self.fixed = 1
        live = []
        for b, t, cum, v, ss in cands:
            par = new_index[b]
            self.tokens.append(t)
            self.parents.append(par)
            self.depths.append(1 if par < 0 else self.depths[par] + 1)
            self.logprobs.append(v)
            live.append(_Live(len(self.tokens) - 1, cum, ss))
        self.live = live
        first = self.tokens[live[0].node]
        return StepResult(row=row_kept + [first], moves=moves, next_drafts=self.leaf_tokens(1))

    def _path(self, node: int) -> tuple[list[int], list[float]]:
        toks, lps = [], []
        while node >= 0:
            toks.append(self.tokens[node])
            lps.append(self.logprobs[node])
            node = self.parents[node]
        return toks[::-1], lps[::-1]

    def _finish(self, beam: _Live, extra: list[int], extra_lp: list[float], cum: float, reason: str) -> None:
        toks, lps = self._path(beam.node)
        self.finished.append(Finished(toks + extra, cum, lps + extra_lp, reason))

    # the answer ------------------------------------------------------------------------------------------------
    def best(self) -> list[Finished]:
        """The n best beams by vLLM's length-normalised score (``get_beam_search_score``: the sequence length
        counts the prompt, minus one when the last token is EOS)."""
        eos, lp, P = getattr(self, "_eos_score", None), self.params.length_penalty, self.prompt_len

        def key(f: Finished) -> float:
            n = P + len(f.tokens) - (1 if f.tokens and eos is not None and f.tokens[-1] == eos else 0)
            return f.cum_logprob / (n ** lp)

        ranked = sorted(self.finished, key=key, reverse=True)
        return ranked[: self.params.n or self.params.width]

    def payload(self) -> dict[str, Any]:
        """What the finished request carries to the front end (``RequestOutput.kv_transfer_params``)."""
        return {BEAM_KEY: [{"token_ids": f.tokens, "cum_logprob": f.cum_logprob, "logprobs": f.logprobs,
                            "finish_reason": f.finish_reason} for f in self.best()],
                "dsbd_beam_steps": self.steps, "dsbd_trie_slots": len(self.tokens)}
