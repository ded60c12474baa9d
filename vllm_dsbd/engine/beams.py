"""Beams inside one vLLM request (DESIGN.md §2, "Full width lives inside one vLLM request"), with or without DSBD's
draft forest.

A beam request keeps its W live beams as a trie of nodes stored in the request's own KV slots, after its linear
context (the prompt, then the beams' common prefix; ``base`` slots). vLLM's token list of the request is always
``linear context + trie node tokens in slot order`` (node j at slot ``base + j``), so vLLM's tokens, block hashes
and recomputation after a preemption see the true token of every slot. The trie's leaves (the live beams' last
tokens) are always its last nodes: leaf 0 is vLLM's last token (not yet in the cache) and leaves 1.. are scheduled as
the request's "draft tokens". A node's RoPE position is ``P - 1 + depth`` (P = prompt length, depth counted from
the prompt) and its attention sees the linear context and its own ancestors (``attention.ForestBatch`` with context
``base`` over the trie).

After each step the draft model beam-searches (T = 0) or beam-samples (T > 0) a forest a few steps ahead of the live
beams (``beam_drafter.py``): W nodes per depth, stored after the trie (forest node c at slot
``base + len(trie) + c``) and scheduled as draft tokens after the leaves, so one target pass computes the leaves and
the forest together.

One beam step, when the logits of every leaf are in (:meth:`BeamRequest.step`):

* T = 0: vLLM's ``LLM.beam_search``: each live beam's top ``2W`` tokens are candidates (raw log-probabilities,
  cumulative scores summed in float64 as vLLM sums Python floats); a candidate ending in EOS finishes (unless EOS is
  ignored); the ``W`` best other candidates (stable sort, as vLLM's ``sorted``) are the new live beams. With a
  forest: while the W new beams are all forest nodes, their logits are in this pass too, so the next beam step runs
  on them at once (a forest layer *passed*); the first step whose beams are not all forest nodes ends the pass. The
  draft only decides how many steps one target pass makes: every step is the target's own, so the beams are vLLM's.
* T > 0: target beam sampling: ``W`` (beam, token) pairs drawn without replacement from the joint
  (``core.beam_step``); a drawn pair ending in EOS finishes. With a forest (drawn by the draft's beam sampling, its
  joint Q kept per depth), each layer is DSBD's exact verification (``core.verify_layer``'s decisions, computed on
  the device without host reads by ``core.verify_static``: recursive rejection sampling without replacement, so the
  W outputs are W draws without replacement from the target joint): while the new beams are all forest nodes the
  next layer runs on their logits. The beams' law is target beam sampling
  whatever the draft (with ``dynamic_width`` the paper's rule picks each drafted layer's width from P and Q).

Then the nodes the new beams hang from (leaves and passed forest nodes) are kept and moved down in slot order to
the first free slots (:class:`StepResult` says which slots move), except that the leaves already in vLLM's token
list never move (a pruned one stays as a dead node), so vLLM's token at every slot stays true. What goes back to
vLLM is the row ``[kept nodes after vLLM's last token] + [new leaf 0]``: vLLM appends it, counts ``len(row) - 1``
accepted drafts and rolls back the rest, which lands exactly on the new layout. When vLLM scheduled (or, after a
preemption, recomputed) only some of the leaves, the step waits: the logits of the computed leaves are kept and the
row is the next leaves (:meth:`BeamRequest.partial`); the forest is dropped.

Then the request is *re-laid out* (:meth:`BeamRequest._relayout`, DESIGN.md §2): the live beams' common prefix
leaves the trie and becomes linear context after the prompt (slots ``[prompt_len, base)``, position = slot, attended
causally like the prompt), every dead node (on no live beam: pruned beams, finished beams' tokens) is dropped, and
the kept nodes move down in slot order; vLLM's token list of the request is rewritten to match (runner and scheduler,
patch ``beam_scheduler``), so the request holds ``base + live trie`` slots instead of every slot it ever kept, and
forest attention runs over the live trie only. ``VLLM_DSBD_BEAM_RELAYOUT=0`` turns it off (for comparisons).

What vLLM outputs for the request is not its token list (trie slots) but its *settled prefix*
(:meth:`BeamRequest.settle`, after every step): the longest common prefix of the live beams and the ``n`` best
finished beams so far. Every beam the request can still return is one of those or descends from a live beam, so a
settled token is never retracted (a finished beam that drops out of the ``n`` best never comes back). When the
search ends, the rest of the best beam follows.

This module imports no vLLM.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsbd.core import rng
from vllm_dsbd.core.params import BatchParams

from . import beam_sampling, reads

from vllm_dsbd.config import BEAM_KEY  # SamplingParams.extra_args[BEAM_KEY]: the beam request's settings (a dict)

MAX_BACKOFF = 16  # the most beam steps drafting pauses for after failed forests (see BeamRequest.draft_skip)
_BEAM_FIELDS = ("width", "max_tokens", "length_penalty", "ignore_eos", "eos_token_id", "n", "depth", "dynamic_width")


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

    @staticmethod
    def parse(value: Any, max_width: int) -> "BeamParams":
        """Validated settings; ``ValueError`` naming ``extra_args['dsbd_beam'][key]`` otherwise."""
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
            raise ValueError(f"{name}['width'] = {width} is above the engine's DSBD width {max_width} "
                             "(start the engine with a larger 'width')")
        width = integer("width", 1, max_width)
        n = integer("n", 1, width, required=False)
        lp = value.get("length_penalty", 1.0)
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"{name}['length_penalty'] must be a finite number, got {lp!r}")
        ign, dyn = value.get("ignore_eos", False), value.get("dynamic_width", False)
        for key, v in (("ignore_eos", ign), ("dynamic_width", dyn)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}[{key!r}] must be true or false, got {v!r}")
        return BeamParams(width=width, max_tokens=integer("max_tokens", 1), length_penalty=float(lp),
                          ignore_eos=ign, eos_token_id=integer("eos_token_id", 0, required=False), n=n,
                          depth=integer("depth", 0, required=False), dynamic_width=dyn)

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
    stepped: bool = False  # a beam step was made (False: only some leaves are in, see BeamRequest.partial)
    draft_nodes: int = 0  # forest nodes this pass verified
    layers_passed: int = 0  # forest layers whose target beams were all draft nodes (another beam step ran on them)
    widths: list[int] = field(default_factory=list)  # T > 0: K of every verified layer that had drafts
    # a re-layout changed vLLM's token list of the request: its output tokens are now these (linear prefix, then the
    # trie up to leaf 0), and ``dropped`` dead slots are gone (see BeamRequest._relayout)
    tokens: list[int] | None = None
    dropped: int = 0


@dataclass
class TopRows:
    """What a deterministic beam step (T = 0) reads of logits rows: each row's ``2W`` best tokens and their
    log-probabilities (float32 ``log_softmax`` of the logits, then ``topk``: vLLM's beam search gets the same from its
    sampler), as host lists. The runner computes them on the logits' device for every such request of a step and
    copies them over at once (:func:`top_rows`), so no logits row leaves the device."""

    vals: list[list[float]]
    idx: list[list[int]]

    def __len__(self) -> int:
        return len(self.vals)

    def __getitem__(self, rows: slice) -> "TopRows":
        return TopRows(self.vals[rows], self.idx[rows])

    def pick(self, rows: list[int]) -> "TopRows":
        return TopRows([self.vals[r] for r in rows], [self.idx[r] for r in rows])

    @staticmethod
    def cat(parts: list["TopRows"]) -> "TopRows":
        return TopRows([v for p in parts for v in p.vals], [i for p in parts for i in p.idx])


def top_rows(logits: torch.Tensor, ks: list[int], counts: list[int]) -> reads.Reader[list[TopRows]]:
    """The :class:`TopRows` of consecutive groups of logits rows ([sum counts, V], on any device): group g has
    ``counts[g]`` rows and keeps its rows' ``ks[g]`` best tokens. One ``log_softmax`` and one ``topk`` for all rows
    (both exact per row: a row's results do not depend on the other rows), one read (a reader: ``engine/reads.py``)."""
    V = logits.shape[-1]
    kk = min(max(ks, default=1), V)
    vals, idx = torch.topk(torch.log_softmax(logits.float(), dim=-1), kk, dim=-1)
    host, = yield [torch.stack([vals.double(), idx.double()])]  # float32 values and token ids are exact in float64
    v_l, i_l = host[0].tolist(), host[1].long().tolist()
    out, at = [], 0
    for k, n in zip(ks, counts):
        k = min(k, V)
        out.append(TopRows([r[:k] for r in v_l[at : at + n]], [r[:k] for r in i_l[at : at + n]]))
        at += n
    return out


@dataclass
class BeamForest:
    """A draft forest hanging off the live beams, stored after the trie: node c at slot ``base + len(trie) + c``, in
    depth-major order (``beam_drafter``). Its nodes are numbered after the trie's (``len(trie) + c``)."""

    tokens: list[int]
    parents: list[int]  # node number of the parent (a leaf of the trie for depth 1)
    depths: list[int]  # depth below the prompt, as the trie's
    drafted: list[bool]  # the draft model's K/V of the node are in its slot (the draft ran on it)
    layers: list[int] = field(default_factory=list)  # forest depth of the node (1 = child of a live beam)
    slots: list[int] = field(default_factory=list)  # the parent's index among the beams its depth was drawn from
    # T > 0: per forest depth, log Q over (parent index, token) ([S * V] float32 on the draft logits' device, S = beams
    # drawn from, or more with -inf past them): the draft joint that depth's nodes were drawn from without
    # replacement, in node order (= draw order)
    q: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Live:
    node: int  # trie index of the beam's last token (-1: the prompt)
    score: float  # float64 cumulative raw log-probability (what vLLM reports and ranks by)
    sample_score: float  # the beam-sampling score log P (T > 0)


class BeamRequest:
    """The trie and live beams of one beam request."""

    def __init__(self, params: BeamParams, prompt_len: int, temperature: float, seed: int, top_k: int = 0,
                 top_p: float = 1.0, tau: float = 0.9, min_width: int = 1, relayout: bool = True):
        self.params = params
        self.relayout = relayout  # re-layout after every step (False: dead slots stay as holes, the prefix in the trie)
        self.tau, self.min_width = tau, min_width  # the engine's dynamic-width rule (``dynamic_width`` requests)
        self.top_k, self.top_p = top_k, top_p  # on the flattened joint (T > 0 only, as in core.joint)
        self.prompt_len = prompt_len
        self.temperature = temperature
        self.seed = seed
        # linear context: the prompt, then the live beams' common prefix moved out of the trie by a re-layout
        self.base = prompt_len  # slots [0, base) are linear (position = slot); trie node j is at slot base + j
        self.prefix: list[int] = []  # tokens of slots [prompt_len, base)
        self.prefix_logprobs: list[float] = []
        self.draft_gap: int | None = None  # first linear slot >= prompt_len whose draft K/V are missing (None: none)
        self.tokens: list[int] = []  # trie node tokens, node j at slot base + j
        self.parents: list[int] = []  # -1: child of the linear context's last token
        self.depths: list[int] = []  # 1-based, below the prompt (the prefix's tokens are depths 1..len(prefix))
        self.logprobs: list[float] = []  # raw log-probability of the node's token after its parent
        self.has_draft: list[bool] = []  # the draft model's K/V of the node are in its slot
        self.forest: BeamForest | None = None  # drafted after the last step, verified by the next
        # drafting backs off while forests fail: after a forest that passed no layer, the next `draft_skip` steps
        # are not drafted for (1, 2, 4, .. up to MAX_BACKOFF steps; back to every step when a layer passes)
        self.draft_skip = 0
        self._backoff = 0
        self.live: list[_Live] = [_Live(-1, 0.0, 0.0)]
        self.finished: list[Finished] = []
        self.steps = 0
        # what the beam step reads of the leaves computed so far this step: T = 0 their TopRows, T > 0 their logits
        # rows (on the logits' device)
        self.leaf_rows: list = []
        # leaves that are in vLLM's token list (leaf fixed - 1 is its last token): their slots cannot move
        self.fixed = 1
        self.peak_blocks = 0  # the most KV blocks the request owned at a step (the runner's count, for metrics)
        self.settled = 0  # tokens of the settled prefix handed to vLLM as the request's output (settle())

    # layout --------------------------------------------------------------------------------------------------
    @property
    def first_leaf_slot(self) -> int:
        """Slot of leaf 0 (= vLLM's last token, not yet computed at the start of a step)."""
        node = self.live[0].node
        return self.base - 1 if node < 0 else self.base + node

    @property
    def num_leaves(self) -> int:
        return len(self.live)

    def position(self, slot: int) -> int:
        """RoPE position of the token at ``slot`` (linear context, trie node or forest node)."""
        B, n = self.base, len(self.tokens)
        if slot < B:
            return slot
        return self.prompt_len - 1 + (self.depths[slot - B] if slot < B + n else self.forest.depths[slot - B - n])

    def node_parents(self) -> list[int]:
        """Parent of every node after the prompt (trie, then forest): ``attention.ForestBatch``'s parent list."""
        return self.parents + (self.forest.parents if self.forest is not None else [])

    def leaf_tokens(self, start: int) -> list[int]:
        return [self.tokens[b.node] for b in self.live[start:] if b.node >= 0]

    def first_without_draft(self) -> int:
        """The first trie node whose draft-model K/V are missing (``len(trie)`` when none is)."""
        return next((j for j, ok in enumerate(self.has_draft) if not ok), len(self.has_draft))

    def resumed(self) -> None:
        """After a preemption: the request's K/V are gone (recomputed from vLLM's token list); so is the forest."""
        self.forest = None
        self.has_draft = [False] * len(self.tokens)

    # the step ------------------------------------------------------------------------------------------------
    def rows_of(self, logits: torch.Tensor | TopRows) -> torch.Tensor | TopRows:
        """What a beam step reads of logits rows ([m, V], any device): T = 0 their :class:`TopRows` (the ``2W`` best
        tokens; given as such by the runner, computed here otherwise), T > 0 the float32 rows themselves."""
        if isinstance(logits, TopRows):
            return logits
        if self.temperature <= 0.0:
            return reads.run(top_rows(logits, [2 * self.params.width], [logits.shape[0]]))[0]
        return logits.float()

    def partial(self, logits: torch.Tensor | TopRows) -> StepResult | None:
        """Records the next computed leaves (their logits rows [m, V] on any device, or their :class:`TopRows` at
        T = 0); returns the row that moves on to the leaves still missing, or None when every leaf is now in (call
        :meth:`step`)."""
        rows = self.rows_of(logits)
        if len(rows):
            self.leaf_rows.append(rows)
        m = sum(len(r) for r in self.leaf_rows)
        if m >= self.num_leaves:
            return None
        self.forest = None  # not every leaf was scheduled, so neither was the forest after them
        if m < self.fixed:
            raise RuntimeError(f"DSBD beams: {m} leaf logits after a pass that computed leaf {self.fixed - 1}")
        nxt = self.leaf_tokens(m)  # leaves m.. (never the prompt: a first step has one leaf)
        # vLLM computed leaves < m; the row makes leaf m its new last token and leaves m+1.. the drafts
        row = [self.tokens[b.node] for b in self.live[self.fixed : m + 1]]
        self.fixed = m + 1
        return StepResult(row=row, next_drafts=nxt[1:])

    def step(self, eos_score_token: int | None, forest_logits: torch.Tensor | TopRows | None = None) -> StepResult:
        """One beam step over the collected leaves, then (a forest verified) more steps while the target's new beams
        are all forest nodes, whose logits this pass computed (``forest_logits``: [F, V] on any device, or their
        :class:`TopRows` at T = 0; the first F forest nodes, the ones vLLM scheduled). ``eos_score_token``: the EOS
        id vLLM's length penalty looks at (the tokenizer's, even when EOS is ignored). :func:`step_beams` steps
        several requests at once."""
        return reads.run(step_beams([(self, eos_score_token, forest_logits)]))[0]

    def _begin(self, eos_score_token: int | None, forest_logits) -> "_Step":
        parts, self.leaf_rows = self.leaf_rows, []
        logits = TopRows.cat(parts) if self.temperature <= 0.0 else torch.cat(parts)  # [Wl, V] or Wl rows
        forest, self.forest = self.forest, None
        self._eos_score = eos_score_token
        self._start = self.live[0].node  # leaf 0's node: the trie before it never moves
        p = self.params
        if forest is None or forest_logits is None or not len(forest_logits):
            forest, forest_logits = None, None
        else:
            forest_logits = self.rows_of(forest_logits)
        return _Step(self, logits, forest, forest_logits, None if p.ignore_eos else p.eos_token_id)

    def _end(self, st: "_Step") -> StepResult:
        nodes = 0
        if st.forest is not None:
            nodes = len(st.flogits)
            self._backoff = 0 if st.passed else min(max(2 * self._backoff, 1), MAX_BACKOFF)
            self.draft_skip = self._backoff
        out = self._apply(st.cands)
        out.stepped, out.draft_nodes, out.layers_passed, out.widths = True, nodes, st.passed, st.widths
        return out

    def _graft(self, forest: BeamForest, F: int) -> int:
        """Adds the forest's first F nodes (the ones vLLM scheduled) to the node lists (node ``len(trie) + c`` at its
        slot); the ones that end up on no beam are dropped by :meth:`_apply`. Returns ``len(trie)`` before."""
        n0 = len(self.tokens)
        self.tokens += forest.tokens[:F]
        self.parents += forest.parents[:F]
        self.depths += forest.depths[:F]
        self.logprobs += [0.0] * F
        self.has_draft += forest.drafted[:F]
        return n0

    def _verify_layers(self, cands, forest: BeamForest, top: TopRows, eos: int | None):
        """T = 0: while the target's W new beams are all nodes of the forest, they become the live beams (their
        logits' best tokens are known) and the target's next beam step runs on them. Returns the last candidates
        and the layers passed."""
        F = len(top)
        n0 = self._graft(forest, F)
        index = {(forest.parents[c], forest.tokens[c]): n0 + c for c in range(F)}
        passed = 0
        while cands and self.steps < self.params.max_tokens:
            nodes = [index.get((self.live[b].node, t)) for b, t, *_ in cands]
            if None in nodes:
                break
            for nd, (_, _, _, v, _) in zip(nodes, cands):
                self.logprobs[nd] = v
            self.live = [_Live(nd, cum, ss) for nd, (_, _, cum, _, ss) in zip(nodes, cands)]
            cands = self._search(top.pick([nd - n0 for nd in nodes]), eos)
            self.steps += 1
            passed += 1
        return cands, passed

    def _search(self, top: TopRows, eos: int | None) -> list[tuple[int, int, float, float, float]]:
        W = self.params.width
        cands = []
        for b, beam in enumerate(self.live):
            for v, t in zip(top.vals[b], top.idx[b]):
                if (c := self._pair(b, t, v, beam.score + v, eos)) is not None:
                    cands.append(c)
        cands = sorted(cands, key=lambda c: c[2], reverse=True)  # stable, as vLLM's sorted(..., reverse=True)
        return cands[:W]

    def _pair(self, b: int, t: int, v: float, sample_score: float, eos: int | None):
        """Live beam b extended by token t (raw log-probability v): a pair ending in EOS finishes the beam (None);
        any other is a candidate ``(beam, token, cumulative raw score, v, sampling score)``."""
        beam = self.live[b]
        if eos is not None and t == eos:
            self._finish(beam, [t], [v], beam.score + v, "stop")
            return None
        return (b, t, beam.score + v, v, sample_score)

    def batch_params(self, device=None) -> BatchParams:
        """The request's settings as the core takes them (one row, on ``device``): its temperature, top-k / top-p on
        the joint, width, seed and the dynamic-width rule; EOS is handled here, not in the core (``eos=-1``)."""
        return beam_params([self], device)

    def _apply(self, cands) -> StepResult:
        """Keeps the nodes the new beams hang from, compacted after the fixed leaves, appends the new leaves, and
        builds the row for vLLM."""
        B, old = self.base, self.live
        done = not cands or self.steps >= self.params.max_tokens
        if done:  # the last step: the new beams are final ("length"); nothing more is scheduled
            for b, t, cum, v, _ in cands:
                self._finish(old[b], [t], [v], cum, "length")
            self.live = []
            start = self._start
            # vLLM appends one token before the scheduler stops the request (patch beam_scheduler); any id will do
            return StepResult(row=[self.tokens[start] if start >= 0 else 0], finished=True)
        # nodes before `lo` are in vLLM's token list (the trie before this step's leaves and the `fixed` leaves): they
        # stay where they are, dead ones as holes; the kept nodes after them (leaves and forest nodes that a new beam
        # hangs from) move down in slot order, so parents stay before children
        lo = self._start + self.fixed
        keep: set[int] = set()
        for b, *_ in cands:
            nd = old[b].node
            while nd >= lo and nd not in keep:
                keep.add(nd)
                nd = self.parents[nd]
        new_index = {nd: lo + k for k, nd in enumerate(sorted(keep))}
        moves = [(B + nd, B + dst) for nd, dst in new_index.items() if nd != dst]
        arrays = (self.tokens, self.parents, self.depths, self.logprobs, self.has_draft)
        for nd, dst in sorted(new_index.items()):
            for arr in arrays:
                arr[dst] = arr[nd]
            par = self.parents[dst]
            self.parents[dst] = new_index.get(par, par)
        base = lo + len(keep)
        for arr in arrays:
            del arr[base:]
        row_kept = self.tokens[lo:base]
        self.fixed = 1
        live = []
        for b, t, cum, v, ss in cands:
            par = old[b].node
            par = new_index.get(par, par)
            self.tokens.append(t)
            self.parents.append(par)
            self.depths.append(1 if par < 0 else self.depths[par] + 1)
            self.logprobs.append(v)
            self.has_draft.append(False)
            live.append(_Live(len(self.tokens) - 1, cum, ss))
        self.live = live
        first = self.tokens[live[0].node]
        out = StepResult(row=row_kept + [first], moves=moves, next_drafts=self.leaf_tokens(1))
        if self.relayout:
            self._relayout(out)
        return out

    def _relayout(self, out: StepResult) -> None:
        """After a step: the live beams' common prefix (their common ancestors above the leaves) leaves the trie for
        the linear context, and the dead nodes (on no live beam) are dropped; the kept nodes move down in slot order
        (a prefix token at depth d to slot ``prompt_len + d - 1``, where its RoPE position already is). ``out``
        gets the K/V moves (composed with the step's own, from where each node's K/V are now) and, when vLLM's
        token list changes, the request's new output tokens (``prefix + trie up to leaf 0``), which the runner and
        the scheduler put in place of the old (patch ``beam_relayout``). The leaves have no K/V yet (leaf 0 is vLLM's
        last token, the others its next drafts), so they move for free. Beams, scores and positions are unchanged."""
        W = len(self.live)
        through: dict[int, int] = {}  # node -> live beams whose path runs through it
        for b in self.live:
            nd = b.node
            while nd >= 0:
                through[nd] = through.get(nd, 0) + 1
                nd = self.parents[nd]
        leaves = {b.node for b in self.live}
        path, nd = [], self.live[0].node
        while nd >= 0:
            path.append(nd)
            nd = self.parents[nd]
        pre = [nd for nd in reversed(path)]
        c = 0
        while c < len(pre) and through[pre[c]] == W and pre[c] not in leaves:
            c += 1
        pre = pre[:c]
        in_pre = set(pre)
        kept = sorted(nd for nd in through if nd not in in_pre)
        dropped = len(self.tokens) - len(pre) - len(kept)
        if not pre and not dropped:
            return
        B = self.base
        old_tokens = self.prefix + self.tokens[: self.live[0].node + 1]  # vLLM's output tokens now
        src_of = {dst: src for src, dst in out.moves}  # where the K/V of the node at a slot are before this step
        moves = []
        for k, nd in enumerate(pre):  # the prefix token at depth d goes to slot P + d - 1 = B + k
            moves.append((src_of.get(B + nd, B + nd), B + k))
            if not self.has_draft[nd] and self.draft_gap is None:
                self.draft_gap = B + k
        nb = B + c  # the new base
        new_index = {nd: k for k, nd in enumerate(kept)}
        moves += [(src_of.get(B + nd, B + nd), nb + k) for nd, k in new_index.items() if nd not in leaves]
        out.moves = [(s, d) for s, d in moves if s != d]
        self.prefix += [self.tokens[nd] for nd in pre]
        self.prefix_logprobs += [self.logprobs[nd] for nd in pre]
        arrays = (self.tokens, self.parents, self.depths, self.logprobs, self.has_draft)
        for arr in arrays:
            arr[:] = [arr[nd] for nd in kept]
        self.parents[:] = [new_index.get(par, -1) for par in self.parents]  # a parent in the prefix is its last node
        for b in self.live:
            b.node = new_index[b.node]
        self.base = nb
        out.dropped = dropped
        new_tokens = self.prefix + self.tokens[: self.live[0].node + 1]
        if new_tokens != old_tokens:
            out.tokens = new_tokens

    def _path(self, node: int) -> tuple[list[int], list[float]]:
        toks, lps = [], []
        while node >= 0:
            toks.append(self.tokens[node])
            lps.append(self.logprobs[node])
            node = self.parents[node]
        return self.prefix + toks[::-1], self.prefix_logprobs + lps[::-1]

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

    def settle(self) -> list[int]:
        """The tokens settled since the last call (after a step): the longest common prefix of the live beams and
        the ``n`` best finished beams, past the ``settled`` tokens already handed out; once the search is over, the
        rest of the best beam. Every beam the request can still return extends the settled prefix."""
        s = self.settled
        if not self.live:
            best = self.best()
            new = best[0].tokens[s:] if best else []
        else:
            seqs = [f.tokens[s:] for f in self.best()]
            for b in self.live:  # the live beam's tokens deeper than s
                toks, node = [], b.node
                while node >= 0 and self.depths[node] > s:
                    toks.append(self.tokens[node])
                    node = self.parents[node]
                seqs.append(self.prefix[s:] + toks[::-1])
            new = seqs[0]
            for q in seqs[1:]:
                k = 0
                while k < len(new) and k < len(q) and new[k] == q[k]:
                    k += 1
                new = new[:k]
        self.settled += len(new)
        return list(new)

    def payload(self) -> dict[str, Any]:
        """What the finished request carries to the front end (``RequestOutput.kv_transfer_params``)."""
        return {BEAM_KEY: [{"token_ids": f.tokens, "cum_logprob": f.cum_logprob, "logprobs": f.logprobs,
                            "finish_reason": f.finish_reason} for f in self.best()],
                "dsbd_beam_steps": self.steps, "dsbd_trie_slots": self.base - self.prompt_len + len(self.tokens)}


def beam_params(beams: list[BeamRequest], device=None) -> BatchParams:
    """The settings of beam requests as the core takes them (one row each, on ``device``; their host facts computed
    before they move): temperature, top-k / top-p on the joint, width, seed and the dynamic-width rule; EOS is
    handled by the requests, not in the core (``eos=-1``)."""
    ws = [b.params.width for b in beams]
    p = BatchParams.make(len(beams), temperature=[b.temperature for b in beams], top_k=[b.top_k for b in beams],
                         top_p=[b.top_p for b in beams], width=ws, seed=[b.seed for b in beams], eos=-1,
                         min_width=[min(b.min_width, w) for b, w in zip(beams, ws)], tau=[b.tau for b in beams],
                         dynamic=[b.params.dynamic_width for b in beams])
    return p if device is None else p.to(device)



@dataclass
class _Step:
    """One request's beam step in progress (:func:`step_beams`)."""

    beam: BeamRequest
    logits: Any  # the leaves' TopRows (T = 0) or float32 logits rows [Wl, V] on the device (T > 0)
    forest: BeamForest | None
    flogits: Any  # the scheduled forest nodes' rows, as ``logits``
    eos: int | None
    cands: list = field(default_factory=list)
    passed: int = 0
    widths: list[int] = field(default_factory=list)
    # T > 0 with a forest: the layer being verified, its beams' rows and drafts (forest node numbers c), the trie's
    # length before the forest was grafted
    layer: int = 1
    rows: torch.Tensor | None = None
    drafts: list[int] = field(default_factory=list)
    n0: int = 0


def step_beams(items: list[tuple[BeamRequest, int | None, Any]]) -> reads.Reader[list[StepResult]]:
    """:meth:`BeamRequest.step` of several beam requests whose leaves are all in (``(request, eos_score_token,
    forest_logits)`` each); a reader (``engine/reads.py``). T = 0 steps are host work on their rows' best tokens; the
    T > 0 steps' device work runs for all of them together (``beam_sampling``): one beam-sampling draw for the
    requests without a forest and, side by side with it (one read for both), the verified layers of the requests
    with one (:func:`_sample_layers`)."""
    steps = [b._begin(eos, flogits) for b, eos, flogits in items]
    plain = []
    for st in steps:
        b = st.beam
        if b.temperature <= 0.0:
            st.cands = b._search(st.logits, st.eos)
            b.steps += 1
            if st.forest is not None:
                st.cands, st.passed = b._verify_layers(st.cands, st.forest, st.flogits, st.eos)
        elif st.forest is None:
            plain.append(st)
    yield from reads.gather(_sample_plain(plain) if plain else None,
                            _sample_layers([st for st in steps if st.beam.temperature > 0.0 and st.forest is not None]))
    return [st.beam._end(st) for st in steps]


def _sample_plain(plain: list[_Step]) -> reads.Reader[None]:
    """T > 0 without a forest: one beam-sampling step of every such request at once."""
    beams = [st.beam for st in plain]
    dev = plain[0].logits.device
    pairs, _ = yield from beam_sampling.sample([st.logits for st in plain],
                                               [[x.sample_score for x in b.live] for b in beams],
                                               [[True] * len(b.live) for b in beams], beam_params(beams, dev),
                                               [b.prompt_len + b.steps for b in beams], rng.Stream.TARGET_DRAW)
    for st, ps in zip(plain, pairs):
        st.cands = [c for p in ps if (c := st.beam._pair(p.beam, p.token, p.logprob, p.score, st.eos)) is not None]
        st.beam.steps += 1


# all of a step's verified layers in one read of the device (``beam_sampling.verify_forests``); False: one read per
# layer (``beam_sampling.verify`` on the requests still passing, stopping when none passes). The runner sets it with
# the other static paths (``sampler.static_default``: on a device, not on the CPU, unless VLLM_DSBD_STATIC_VERIFY
# says otherwise); the tests compare the two.
STATIC_LAYERS = True


def _sample_layers(steps: list[_Step]) -> reads.Reader[None]:
    """T > 0 with a forest: DSBD's exact layer-by-layer verification (DESIGN.md §1; ``beam_sampling``). Layer d's
    target joint P (over the request's current beams) and the draft joint Q its depth-d nodes were drawn from give K
    outputs that are K draws without replacement from P (K = W, or the dynamic-width rule from P and Q only), so each
    layer is exactly one step of target beam sampling. While every new beam is a forest node (its logits are in the
    forest's rows), the next layer runs on them; the first layer that has a beam outside the forest, or no drafts
    (the bonus layer), ends the request's pass. Sets each step's last candidates, layers passed and widths of
    drafted layers. The device work runs for every request at once: all layers in one call and one read
    (``STATIC_LAYERS``, where whether a layer passed is decided on the device too), or one call per layer."""
    for st in steps:
        st.n0 = st.beam._graft(st.forest, len(st.flogits))
        st.rows = st.logits
    if not steps:
        return
    if STATIC_LAYERS:
        results = yield from beam_sampling.verify_forests(
            [_plan(st) for st in steps], beam_params([st.beam for st in steps], steps[0].logits.device))
        for st, layers in zip(steps, results):
            passed = False
            for n, (pairs, k) in enumerate(layers):
                st.drafts = _layer_drafts(st)
                passed = _take(st, pairs, k, rows=False)
                if passed != (n + 1 < len(layers)):
                    raise RuntimeError(f"DSBD beams: layer {n + 1} of a static verification "
                                       f"{'passed' if passed else 'ended'} on the host, not on the device")
        return
    active = list(steps)
    while active:
        layers = []
        for st in active:
            b, f, V = st.beam, st.forest, st.rows.shape[-1]
            st.drafts = _layer_drafts(st)
            layers.append(beam_sampling.Layer(
                logits=st.rows, scores=[x.sample_score for x in b.live],
                drafts=[f.slots[c] * V + f.tokens[c] for c in st.drafts],
                logq=f.q[f.layers[st.drafts[0]] - 1] if st.drafts else None, position=b.prompt_len + b.steps,
                dynamic=b.params.dynamic_width))
        pairs, ks = yield from beam_sampling.verify(layers, beam_params([st.beam for st in active],
                                                                       active[0].rows.device))
        active = [st for st, ps, k in zip(active, pairs, ks) if _take(st, ps, k)]


def _layer_drafts(st: _Step) -> list[int]:
    """The forest nodes (numbers c, in draw order) of the layer the step verifies next."""
    return [c for c in range(len(st.flogits)) if st.forest.layers[c] == st.layer]


def _plan(st: _Step) -> beam_sampling.Plan:
    """A step's forest as ``beam_sampling.verify_forests`` takes it."""
    b, f, V = st.beam, st.forest, st.logits.shape[-1]
    by_depth: dict[int, list[int]] = {}
    for c in range(len(st.flogits)):
        by_depth.setdefault(f.layers[c], []).append(c)
    drafts = [by_depth.get(d, []) for d in range(1, max(by_depth, default=0) + 1)]
    return beam_sampling.Plan(
        leaves=st.logits, scores=[x.sample_score for x in b.live], nodes=st.flogits, drafts=drafts,
        joint=[[f.slots[c] * V + f.tokens[c] for c in ds] for ds in drafts], logq=f.q[: len(drafts)],
        position=b.prompt_len + b.steps, layers=b.params.max_tokens - b.steps, dynamic=b.params.dynamic_width,
        eos=-1 if st.eos is None else st.eos)


def _take(st: _Step, pairs: list, k: int, rows: bool = True) -> bool:
    """Applies one verified layer's outputs (``st.drafts`` its drafts) to the request: EOS pairs finish beams, the
    others are the step's candidates. Returns whether the layer passed (drafts there, a candidate, every candidate a
    draft, a step left): then the drafts become the live beams, scored by the candidates they are (the others dead
    slots), and (``rows``) their logits rows the next layer's."""
    b, f, V = st.beam, st.forest, st.logits.shape[-1]
    node_of = {f.slots[c] * V + f.tokens[c]: st.n0 + c for c in st.drafts}
    cands, nodes = [], []
    for p in pairs:
        if (c := b._pair(p.beam, p.token, p.logprob, p.score, st.eos)) is not None:
            cands.append(c)
            nodes.append(node_of.get(p.beam * V + p.token))
    b.steps += 1
    if st.drafts:
        st.widths.append(k)
    st.cands = cands
    if not st.drafts or not cands or None in nodes or b.steps >= b.params.max_tokens:
        return False
    st.passed += 1
    # the layer passed: the next layer's beams are forest nodes; its parent slots are this depth's nodes (what the
    # deeper drafts were drawn from), the ones that are not beams stay in as dead slots
    live = [_Live(st.n0 + c, -math.inf, -math.inf) for c in st.drafts]
    slot_of = {st.n0 + c: i for i, c in enumerate(st.drafts)}
    for nd, (_, _, cum, v, ss) in zip(nodes, cands):
        b.logprobs[nd] = v
        live[slot_of[nd]] = _Live(nd, cum, ss)
    b.live = live
    if rows:
        st.rows = st.flogits[torch.tensor(st.drafts, device=st.flogits.device)]
    st.layer += 1
    return True
