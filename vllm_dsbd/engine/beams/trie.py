"""One beam request's trie, its draft forest and its answer (:class:`BeamRequest`;
the story: docs/design/beams.md §3.3).

The batched step that drives it is ``step.py``; this module imports no vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.requests import BEAM_KEY, BeamParams

from .. import reads
from ..cost import Subforest
from .groups import group_search
from .sampling import TopRows, top_rows
from .stops import StopRule

MAX_BACKOFF = 16  # the most beam steps drafting pauses for after failed forests (see BeamRequest.draft_skip)
class RowTop:
    """Row ``b`` of a step's :class:`TopRows` (a token's 2W best alternatives), kept by reference: listed as (token,
    log-probability) pairs only for the beams a request returns, not for every trie node at every step."""

    __slots__ = ("rows", "b")

    def __init__(self, rows: TopRows, b: int):
        self.rows, self.b = rows, b

    @staticmethod
    def listed(t: "RowTop | list | None") -> list[tuple[int, float]] | None:
        return list(zip(t.rows.idx[t.b], t.rows.vals[t.b])) if isinstance(t, RowTop) else t


@dataclass
class Finished:
    tokens: list[int]
    cum_logprob: float
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS, a stop token id or a stop string) or "length"
    # T = 0: per token, the 2W best (token, raw log-probability) of the row it was chosen from, best first (the
    # candidates vLLM's beam search saw there); None where not known (T > 0)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    stop_reason: int | str | None = None  # "stop": the EOS or stop token id, or the stop string (stops.StopRule)
    rank: float | None = None  # diverse beam search: the penalised cumulative score it is ranked by (groups.py)


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
    draft_layers: int = 0  # layers of the forest this pass verified (its deepest verified node's)
    widths: list[int] = field(default_factory=list)  # T > 0: K of every verified layer that had drafts
    sub: Subforest | None = None  # T = 0 with a forest: what its smaller subforests would have passed (cost.py)
    # a re-layout changed vLLM's token list of the request: its output tokens are now these (linear prefix, then the
    # trie up to leaf 0), and ``dropped`` dead slots are gone (see BeamRequest._relayout)
    tokens: list[int] | None = None
    dropped: int = 0


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
    nodes: int = 0  # N, the nodes per depth it was drafted with (0: the request's)
    # T > 0: per forest depth, log Q over (parent index, token) ([S * V] float32 on the draft logits' device, S = beams
    # drawn from, or more with -inf past them): the draft joint that depth's nodes were drawn from without
    # replacement, in node order (= draw order)
    q: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LiveBeam:
    node: int  # trie index of the beam's last token (-1: the prompt)
    score: float  # float64 cumulative raw log-probability (what vLLM reports and ranks by)
    sample_score: float  # the beam-sampling score log P (T > 0)


class BeamRequest:
    """The trie and live beams of one beam request."""

    def __init__(self, params: BeamParams, prompt_len: int, temperature: float, seed: int, top_k: int = 0,
                 top_p: float = 1.0, tau: float = 0.9, min_width: int = 1, relayout: bool = True,
                 nodes: int | None = None, stops: StopRule | None = None):
        self.params = params
        self.stops = stops if stops else None  # stop token ids and strings (any temperature; requests.check_request)
        self.grammar = None  # structured outputs (T = 0, no forest): a ``grammar.BeamGrammar``, set by the engine
        # N, the draft forest's nodes per depth (>= width; None: the width): over-drafting, docs/design/beams.md §3.3
        self.nodes = max(params.width, nodes or 0)
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
        self.prefix_top: list = []  # Finished.top of the prefix's tokens
        self.draft_gap: int | None = None  # first linear slot >= prompt_len whose draft K/V are missing (None: none)
        self.tokens: list[int] = []  # trie node tokens, node j at slot base + j
        self.parents: list[int] = []  # -1: child of the linear context's last token
        self.depths: list[int] = []  # 1-based, below the prompt (the prefix's tokens are depths 1..len(prefix))
        self.logprobs: list[float] = []  # raw log-probability of the node's token after its parent
        self.top: list = []  # T = 0: the 2W best (token, log-probability) of the row the node's token came from
        self._rows: TopRows | None = None  # T = 0: the rows of the live beams the last search ranked (row b: beam b)
        self.has_draft: list[bool] = []  # the draft model's K/V of the node are in its slot
        self.forest: BeamForest | None = None  # drafted after the last step, verified by the next
        # drafting backs off while forests fail: after a forest that passed no layer, the next `draft_skip` steps
        # are not drafted for (1, 2, 4, .. up to MAX_BACKOFF steps; back to every step when a layer passes)
        self.draft_skip = 0
        self._backoff = 0
        self.live: list[LiveBeam] = [LiveBeam(-1, 0.0, 0.0)]
        self.live_groups: list[int] | None = None  # diverse beam search: each live beam's group (None: the prompt's)
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
        ``step.step_one``)."""
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

    def begin_step(self, eos_score_token: int | None, forest_logits) -> PendingStep:
        parts, self.leaf_rows = self.leaf_rows, []
        logits = TopRows.cat(parts) if self.temperature <= 0.0 else torch.cat(parts)  # [Wl, V] or Wl rows
        forest, self.forest = self.forest, None
        self._eos_score = eos_score_token
        self._rows = None
        self._start = self.live[0].node  # leaf 0's node: the trie before it never moves
        p = self.params
        if forest is None or forest_logits is None or not len(forest_logits):
            forest, forest_logits = None, None
        else:
            forest_logits = self.rows_of(forest_logits)
        return PendingStep(self, logits, forest, forest_logits, None if p.ignore_eos else p.eos_token_id)

    def end_step(self, st: PendingStep) -> StepResult:
        nodes = layers = 0
        if st.forest is not None:
            nodes = len(st.flogits)
            layers = max(st.forest.layers[:nodes], default=0)
            self._backoff = 0 if st.passed else min(max(2 * self._backoff, 1), MAX_BACKOFF)
            self.draft_skip = self._backoff
        sub = self._subforest(st) if st.forest is not None and self.temperature <= 0.0 else None
        out = self._apply(st.cands)
        out.stepped, out.draft_nodes, out.layers_passed, out.widths = True, nodes, st.passed, st.widths
        out.draft_layers, out.sub = layers, sub
        return out

    def _subforest(self, st: PendingStep) -> Subforest:
        """T = 0: the verified forest's scheduled nodes (depths, parents as forest indices) and the target's beams of
        every passed layer, for the cost model's rate at smaller N (``cost.passed_by_width``)."""
        f, F, n0 = st.forest, len(st.flogits), st.n0
        return Subforest(width=self.params.width, nodes=f.nodes or self.nodes, layers=tuple(f.layers[:F]),
                         parents=tuple(p - n0 if d > 1 else -1 for p, d in zip(f.parents[:F], f.layers[:F])),
                         beams=tuple(map(tuple, st.beams)))

    def graft(self, forest: BeamForest, F: int) -> int:
        """Adds the forest's first F nodes (the ones vLLM scheduled) to the node lists (node ``len(trie) + c`` at its
        slot); the ones that end up on no beam are dropped by :meth:`_apply`. Returns ``len(trie)`` before."""
        n0 = len(self.tokens)
        self.tokens += forest.tokens[:F]
        self.parents += forest.parents[:F]
        self.depths += forest.depths[:F]
        self.logprobs += [0.0] * F
        self.top += [None] * F
        self.has_draft += forest.drafted[:F]
        return n0

    def verify_layers(self, cands, forest: BeamForest, top: TopRows, eos: int | None, trace: list | None = None):
        """T = 0: while the target's W new beams are all nodes of the forest, they become the live beams (their
        logits' best tokens are known) and the target's next beam step runs on them. Returns the last candidates
        and the layers passed; ``trace`` gets the new beams' forest indices of every passed layer."""
        F = len(top)
        n0 = self.graft(forest, F)
        index = {(forest.parents[c], forest.tokens[c]): n0 + c for c in range(F)}
        passed = 0
        while cands and self.steps < self.params.max_tokens:
            nodes = [index.get((self.live[b].node, t)) for b, t, *_ in cands]
            if None in nodes:
                break
            if trace is not None:
                trace.append([nd - n0 for nd in nodes])
            for nd, (b, _, _, v, _) in zip(nodes, cands):
                self.logprobs[nd] = v
                self.top[nd] = self._row_top(b)
            self.live = [LiveBeam(nd, cum, ss) for nd, (_, _, cum, _, ss) in zip(nodes, cands)]
            cands = self.search(top.pick([nd - n0 for nd in nodes]), eos)
            self.steps += 1
            passed += 1
        return cands, passed

    def search(self, top: TopRows, eos: int | None) -> list[tuple[int, int, float, float, float]]:
        """T = 0: the step's W best candidates ``(beam, token, cumulative score, log-probability, sampling score)``
        over each live beam's 2W best tokens, in vLLM's order (stable sort); EOS and stop candidates finish their beam
        (:meth:`pair`). Without stops the 2W * W candidates are ranked as arrays (O(W) Python objects per step)."""
        W = self.params.width
        self._rows = top
        if self.params.num_beam_groups > 1:
            return group_search(self, top, eos)
        if self.stops is None and self.grammar is None and len(top):
            return self._search_arrays(top, eos, W)
        cands, g = [], self.grammar
        for b, beam in enumerate(self.live):
            if g is not None and g.ended(self, b):  # structured outputs (grammar.py): completed as it is
                continue
            for v, t in zip(top.vals[b], top.idx[b]):
                if g is not None and not g.allows(b, t):
                    continue
                if (c := self.pair(b, t, v, beam.score + v, eos)) is not None:
                    cands.append(c)
        cands = sorted(cands, key=self._rank_key(), reverse=True)  # stable, as vLLM's sorted(..., reverse=True)
        return cands[:W]

    def _search_arrays(self, top: TopRows, eos: int | None, W: int) -> list[tuple[int, int, float, float, float]]:
        """:meth:`search` without stops, on arrays: float64 sums (as vLLM's Python floats), EOS candidates finish in
        beam order, the others ranked by a stable descending sort of their keys in candidate order (beam, then rank),
        which is vLLM's ``sorted(..., reverse=True)``."""
        vals = np.asarray(top.vals, dtype=np.float64)
        idx = np.asarray(top.idx, dtype=np.int64)
        cum = np.asarray([b.score for b in self.live], dtype=np.float64)[:, None] + vals
        ok = np.ones(idx.shape, dtype=bool)
        if eos is not None:
            hit = idx == eos
            if hit.any():
                ok = ~hit
                for b, r in zip(*np.nonzero(hit)):
                    b, v = int(b), float(vals[b, r])
                    self._finish(self.live[b], [eos], [v], float(cum[b, r]), "stop", self._row_top(b), eos)
        key = cum
        se, lp = self._eos_score, self.params.length_penalty
        if self.params.rank_by_score and se is not None:
            n = self.prompt_len + self.steps + 1
            key = cum / np.where(idx == se, float((n - 1) ** lp), float(n ** lp))
        flat = np.flatnonzero(ok.ravel())
        order = flat[np.argsort(-key.ravel()[flat], kind="stable")[:W]]
        b_, r_ = np.divmod(order, vals.shape[1])
        c = cum[b_, r_].tolist()
        return list(zip(b_.tolist(), idx[b_, r_].tolist(), c, vals[b_, r_].tolist(), c))

    def _row_top(self, b: int) -> "RowTop | None":
        """Beam b's row as the last search saw it (its 2W best tokens, :class:`RowTop`: listed only for the answer);
        None at T > 0."""
        return None if self._rows is None else RowTop(self._rows, b)

    def _rank_key(self):
        """How a step's candidates are ranked: by cumulative log-probability (vLLM's server loop), or with
        ``rank_by_score`` by vLLM's ``get_beam_search_score`` as ``LLM.beam_search`` ranks them (the candidate's
        length counts the prompt, minus one when its token is EOS; only an EOS candidate kept with ``ignore_eos``
        ranks differently)."""
        eos, lp = self._eos_score, self.params.length_penalty
        if not self.params.rank_by_score or eos is None:
            return lambda c: c[2]
        n = self.prompt_len + self.steps + 1  # tokens of every candidate of this step, prompt included
        return lambda c: c[2] / ((n - 1 if c[1] == eos else n) ** lp)

    def pair(self, b: int, t: int, v: float, sample_score: float, eos: int | None):
        """Live beam b extended by token t (raw log-probability v): a pair ending in EOS, a stop token id or a stop
        string finishes the beam (None);
        any other is a candidate ``(beam, token, cumulative raw score, v, sampling score)``."""
        beam = self.live[b]
        rank = sample_score if self.params.num_beam_groups > 1 else None
        if eos is not None and t == eos:
            self._finish(beam, [t], [v], beam.score + v, "stop", self._row_top(b), t, rank)
            return None
        if self.stops is not None and (why := self.stops.check(lambda k: self._tail(beam.node, k), t)) is not None:
            self._finish(beam, [t], [v], beam.score + v, "stop", self._row_top(b), why, rank)
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
            for b, t, cum, v, ss in cands:
                self._finish(old[b], [t], [v], cum, "length", self._row_top(b), None,
                             ss if self.params.num_beam_groups > 1 else None)
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
        arrays = (self.tokens, self.parents, self.depths, self.logprobs, self.top, self.has_draft)
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
            self.top.append(self._row_top(b))
            self.has_draft.append(False)
            live.append(LiveBeam(len(self.tokens) - 1, cum, ss))
        self.live = live
        first = self.tokens[live[0].node]
        out = StepResult(row=row_kept + [first], moves=moves, next_drafts=self.leaf_tokens(1))
        if self.relayout:
            self._relayout(out)
        return out

    def _relayout(self, out: StepResult) -> None:
        """After a step: the live beams' common prefix leaves the trie for the linear context, dead nodes are dropped,
        kept nodes move down in slot order. ``out`` gets the K/V moves (composed with the step's own) and, when vLLM's
        token list changes, the new output tokens (patch ``beam_scheduler``). Beams, scores and positions are unchanged
        (design §3.3)."""
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
        self.prefix_top += [self.top[nd] for nd in pre]
        arrays = (self.tokens, self.parents, self.depths, self.logprobs, self.top, self.has_draft)
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

    def _path(self, node: int) -> tuple[list[int], list[float], list]:
        toks, lps, tops = [], [], []
        while node >= 0:
            toks.append(self.tokens[node])
            lps.append(self.logprobs[node])
            tops.append(self.top[node])
            node = self.parents[node]
        return self.prefix + toks[::-1], self.prefix_logprobs + lps[::-1], self.prefix_top + tops[::-1]

    def _tail(self, node: int, k: int) -> list[int]:
        """The last (up to) ``k`` generated tokens of the beam ending at trie node ``node`` (stop strings)."""
        toks = []
        while node >= 0 and len(toks) < k:
            toks.append(self.tokens[node])
            node = self.parents[node]
        more = k - len(toks)
        return (self.prefix[-more:] if more > 0 and self.prefix else []) + toks[::-1]

    def _finish(self, beam: LiveBeam, extra: list[int], extra_lp: list[float], cum: float, reason: str,
                extra_top=None, stop_reason: int | str | None = None, rank: float | None = None) -> None:
        toks, lps, tops = self._path(beam.node)
        self.finished.append(Finished(toks + extra, cum, lps + extra_lp, reason, tops + [extra_top], stop_reason,
                                      rank))

    # the answer ------------------------------------------------------------------------------------------------
    def best(self) -> list[Finished]:
        """The n best beams by vLLM's length-normalised score (``get_beam_search_score``: the sequence length
        counts the prompt, minus one when the last token is EOS or a stop token id that finished the beam; diverse beam
        search ranks the penalised cumulative score, ``Finished.rank``, the same way)."""
        eos, lp, P = getattr(self, "_eos_score", None), self.params.length_penalty, self.prompt_len

        def key(f: Finished) -> float:
            by_id = f.finish_reason == "stop" and isinstance(f.stop_reason, int)
            n = P + len(f.tokens) - (1 if f.tokens and (by_id or (eos is not None and f.tokens[-1] == eos)) else 0)
            return (f.cum_logprob if f.rank is None else f.rank) / (n ** lp)

        ranked = sorted(self.finished, key=key, reverse=True)
        return ranked[: self.params.n or self.params.width]

    def settle(self) -> list[int]:
        """The tokens settled since the last call: the longest common prefix of the live beams and the ``n`` best
        finished beams, past the ``settled`` tokens already handed out; once the search is over, the rest of the best
        beam. Every beam the request can still return extends the settled prefix, so a settled token is never
        retracted."""
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
        """What the finished request carries to the front end (``RequestOutput.kv_transfer_params``). Tokens chosen
        from the same row (one beam's, at one step: a trie node's children) share its list of alternatives, listed
        once."""
        listed: dict[Any, Any] = {}

        def top(t):
            key = (id(t.rows), t.b) if isinstance(t, RowTop) else id(t)
            if key not in listed:
                listed[key] = RowTop.listed(t)
            return listed[key]

        return {BEAM_KEY: [{"token_ids": f.tokens, "cum_logprob": f.cum_logprob, "logprobs": f.logprobs,
                            "top_logprobs": [top(t) for t in f.top], "finish_reason": f.finish_reason,
                            "stop_reason": f.stop_reason}
                           for f in self.best()],
                "dsbd_beam_steps": self.steps, "dsbd_trie_slots": self.base - self.prompt_len + len(self.tokens)}


def beam_params(beams: list[BeamRequest], device=None, draws: bool | list[int] = False) -> BatchParams:
    """The core's settings of beam requests (one row each, on ``device``; host facts computed before they move):
    temperature, top-k / top-p on the joint, width, seed, dynamic-width rule; ``eos=-1`` (the requests handle EOS).
    ``draws``: the width is the forest's nodes per depth (the draft's draws per depth: True, each request's ``nodes``;
    a list, those of this forest, e.g. fewer chosen by the cost model) instead of W."""
    ws = list(draws) if isinstance(draws, list) else [b.nodes if draws else b.params.width for b in beams]
    p = BatchParams.make(len(beams), temperature=[b.temperature for b in beams], top_k=[b.top_k for b in beams],
                         top_p=[b.top_p for b in beams], width=ws, seed=[b.seed for b in beams], eos=-1,
                         min_width=[min(b.min_width, w) for b, w in zip(beams, ws)], tau=[b.tau for b in beams],
                         dynamic=[b.params.dynamic_width for b in beams])
    return p if device is None else p.to(device)


@dataclass
class PendingStep:
    """One request's beam step in progress (``step.step_beams``)."""

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
    beams: list[list[int]] = field(default_factory=list)  # T = 0: the new beams' forest indices per passed layer
