"""Online correction of the cost model's table from the steps the engine actually ran (``cost_model: "auto"``).

The start-up table times the target and draft passes and a dummy step's forest work (``forest_probe.py``); real steps
cost what those leave out (host work around the forests, the batch's own contexts and sampling), so before this
correction the model drafted on a CPU where drafting lost. A forest planned in step t costs twice outside its passes:
its drafting (the drafter's host work) in step t's window, and its verification (forest attention's recompute, the
verifier) in step t + 1's, since a step's window runs from ``execute_model`` (the target pass over the forests planned
the step before) to the end of drafting the next ones. Each window is classed by what it holds (verified forests,
drafted forests: four kinds) and its surplus over the table's passes kept per kind; :meth:`StepClock.corrected` sets
in the table, as ``draft_step`` (in place of the start-up probe's, ``forest_probe.py``, once measured), what a step
that drafts costs over both windows: ``(drafted and verified) - neither``, or
``(drafted only) + (verified only) - 2 neither`` where a request drafts now and then (``neither`` from the other three
where it is not measured: the surpluses add up), and to ``step`` what every step costs beyond its passes
(``neither``: the engine's own work per step, 12.1 ms on an H100 beside a 1.4 ms target pass; a step that emits more
tokens spreads it over them, which is what drafting buys). Each window's forest nodes (drafted plus verified) are
kept too, and the surplus of windows with forests is fitted as fixed + per node (:meth:`StepClock.node_cost`): then
``draft_step`` is the fixed part and ``node`` the cost per planned forest node, so a forest larger than the measured
ones costs more. Per kind the median of the last
``WINDOW`` surpluses (every sample weighs alike; a slow outlier moves nothing), none older than ``HORIZON`` measured
steps: a measurement that switched drafting off expires, and the next forests measure it again. Only timings of past
steps enter, so every output law stays exact; the choices now depend on timings, so seeded outputs reproduce only with
a pinned table (the correction is off then) and only without tensor parallelism (ranks' clocks differ: off there too).

The same windows also answer, per batch size, whether forests pay at all (:meth:`StepClock.forests_lose`): the tokens
per second of the windows with forests (drafted or verified) against those of the bare windows, both measured at the
same batch size (a power-of-two bucket of its requests) and queue state (requests waiting or not: a queue's steps hold
its prefills and preemptions' recomputes) over their last ``WINDOW`` samples; the runner then drafts no
forest at that size but, under a queue, within the engine's probe budget (``shapes.py``), so a batch whose forests lose
runs at nearly vLLM's own speed however the table errs (issue "On vLLM's fast path", item 7); where only forests were
measured at a batch size, a bare probe (``BARE_PROBE`` steps without forests, at most once per ``PROBE_GAP`` measured
steps and batch-size bucket, outside the probe budget: a short run must reach the verdict) measures the other side.
Windows of plain requests and of beam requests are kept apart, and a window with both is not kept: a plain request's
window counts its tokens, a beam request's its beam steps (every live beam one token longer; one beam step of W beams is
not W tokens of plain requests, and beam forests cost what plain ones do not: a verdict from one kind says nothing of
the other). The surpluses are kept apart the same way (a mixed window counts as plain): a batch of beam requests takes
the table corrected by beam windows alone (``corrected(table, BEAM)``), where its forests' measured cost, or the
start-up probe's until they are measured, never plain forests' (after plain traffic whose host-drafted forests cost
nothing over the table, beam forests were priced at nothing: results/beam-verdict-2026-12-07). Imports neither vLLM nor
torch.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from .cost import CostTable

MIN_STEPS = 3  # windows of a kind measured before its median is used
WARMUP = 8  # decode steps not measured after start-up (one-time costs: first allocations); none drafts a forest
FOREST_WARMUP = 2  # the engine's first windows with forests, not measured (the first forests' one-time costs)
WINDOW = 32  # the most recent surpluses kept per kind of window
HORIZON = 256  # measured steps after which a surplus expires

MIN_REGIME = 4  # windows of each regime measured at a batch size before forests_lose can say they lose
BARE_PROBE = MIN_REGIME + 1  # steps of a bare probe: its first window still verifies the forests planned before it
PROBE_GAP = 64  # measured steps before a batch-size bucket is probed again (its bare windows not recorded, or expired)
PLAIN, BEAM = "plain", "beam"  # the kinds of request whose windows are kept apart (regimes)
NEITHER, DRAFTED, VERIFIED, BOTH = 0, 1, 2, 3  # a window's kind: (verified forests) * 2 + (drafted forests)
KINDS = ("neither", "drafted", "verified", "both")


@dataclass
class StepClock:
    """Surpluses (measured minus predicted seconds) of the measured step windows, by kind: whether the window verified
    forests (planned the step before) and whether it drafted forests (planned in it). The runner calls :meth:`start`
    as a step begins (:func:`measured_tokens`: its scheduled tokens, or None, a step with a prefill, not measured; the
    first ``warmup`` decode steps are not measured either, and draft no forest: :meth:`warming`; nor are the engine's
    first ``forest_warmup`` windows with forests; and whether requests wait), :meth:`planned` when the cost model
    chose the next forests, and :meth:`finish` once they are drafted, which returns the corrected table."""

    warmup: int = WARMUP
    forest_warmup: int = FOREST_WARMUP
    steps: int = 0  # windows measured
    # kind of request (PLAIN: plain or mixed windows; BEAM: beam requests' alone) -> by kind of window, (step, seconds)
    surpluses: dict = field(default_factory=dict)
    _t0: float | None = None
    _tokens: int = 0
    _draft: float = 0.0
    forests: dict = field(default_factory=dict)  # kind of request -> (step, forest nodes, seconds) of windows
    _drafted: bool = False
    _verified: bool = False
    _next_verified: bool = False  # the last plan drafted: the next window verifies its forests
    _nodes: int = 0  # forest nodes the window drafts (planned in it)
    _verified_nodes: int = 0  # forest nodes the window verifies (planned the step before)
    _next_nodes: int = 0
    # (kind of request, batch-size bucket, queued) -> ([bare windows], [windows with forests]) of
    # (step, seconds, emitted)
    regimes: dict = field(default_factory=dict)
    _reqs: int = 0  # requests of the window
    _emitted: int = 0  # what the window emitted: tokens of plain requests, beam steps of beam requests
    _kinds: set = field(default_factory=set)  # the kinds of request the window emitted for (one: it is recorded)
    _probed: dict = field(default_factory=dict)  # regime (_bucket_of) -> the measured step its last bare probe began
    _queued: bool = False  # requests wait to be scheduled in this step (start): the regimes are kept apart by it

    def surplus_of(self, kind: str) -> tuple:
        """``kind``'s surpluses by kind of window: (step, seconds) each."""
        if (got := self.surpluses.get(kind)) is None:
            got = self.surpluses[kind] = tuple(deque(maxlen=WINDOW) for _ in KINDS)
        return got

    def _forest(self, kind: str) -> deque:
        """``kind``'s windows with forests: (step, forest nodes, seconds) each."""
        if (got := self.forests.get(kind)) is None:
            got = self.forests[kind] = deque(maxlen=WINDOW)
        return got

    def observe(self, seconds: float, predicted: float, drafted: bool, verified: bool, nodes: int = 0,
                kind: str = PLAIN) -> None:
        """One window's time against the table's prediction; ``nodes``: the forest nodes it drafted and verified
        (0: not counted; the per-node cost is then not measured); ``kind``: the requests' (a beam forest costs what a
        plain one does not: its corrections are its own)."""
        self.steps += 1
        self.surplus_of(kind)[2 * verified + drafted].append((self.steps, seconds - predicted))
        if nodes > 0:
            self._forest(kind).append((self.steps, nodes, seconds - predicted))

    def start(self, tokens: int | None, reqs: int = 0, queued: bool = False) -> None:
        """A step begins: its scheduled tokens (None: not measured), its requests, and whether requests wait to be
        scheduled (its regime's queue state, :meth:`_bucket_of`)."""
        self._queued = queued
        if tokens is not None and self.warmup > 0:
            self.warmup, tokens = self.warmup - 1, None
        self._t0 = None if tokens is None else time.perf_counter()
        self._reqs, self._emitted, self._kinds = reqs, 0, set()
        self._tokens, self._draft, self._drafted, self._nodes = tokens or 0, 0.0, False, 0
        self._verified, self._next_verified = self._next_verified, False
        self._verified_nodes, self._next_nodes = self._next_nodes, 0

    def planned(self, draft_seconds: float, drafted: bool, nodes: int = 0) -> None:
        """The model chose the next forests: their draft passes' predicted seconds (without the table's
        ``draft_step`` and ``node``: what the surplus measures), whether any, their nodes."""
        self._draft, self._drafted, self._next_verified = draft_seconds, drafted, drafted
        self._nodes = self._next_nodes = nodes if drafted else 0

    def emitted(self, tokens: int, kind: str = PLAIN) -> None:
        """The window's requests of ``kind`` emitted ``tokens``: tokens of plain requests (``PLAIN``), beam steps of
        beam requests (``BEAM``, every live beam one token longer). A window that emitted for both kinds is not
        recorded in the regimes."""
        self._emitted += tokens
        self._kinds.add(kind)

    def finish(self, table: CostTable) -> CostTable:
        if (self._drafted or self._verified) and self.forest_warmup > 0:  # the engine's first windows with forests
            self.forest_warmup, self._t0 = self.forest_warmup - 1, None
        if self._t0 is not None:
            seconds = time.perf_counter() - self._t0
            predicted = table.step + table.target_time(self._tokens) + self._draft
            self.observe(seconds, predicted, self._drafted, self._verified, self._nodes + self._verified_nodes,
                         BEAM if self._kinds == {BEAM} else PLAIN)
            if len(self._kinds) == 1 and self._reqs > 0 and self._emitted > 0:
                pair = self.regimes.setdefault(self._bucket_of(self._reqs, *self._kinds),
                                               (deque(maxlen=WINDOW), deque(maxlen=WINDOW)))
                pair[self._drafted or self._verified].append((self.steps, seconds, self._emitted))
            self._t0 = None
        return self.corrected(table)

    def needs_bare(self, reqs: int, kind: str = PLAIN) -> bool:
        """Whether, at a batch of ``reqs`` requests of ``kind``, windows with forests are measured and bare ones are
        not, and the bucket was not probed in the last ``PROBE_GAP`` measured steps (a bare probe, :meth:`bare_probe`,
        then measures what the batch does without forests)."""
        bucket = self._bucket_of(reqs, kind)
        pair = self.regimes.get(bucket)
        if pair is None or self.steps - self._probed.get(bucket, -PROBE_GAP) < PROBE_GAP:
            return False
        return len(self._live(pair[1])) >= MIN_REGIME and len(self._live(pair[0])) < MIN_REGIME

    def bare_probe(self, reqs: int, kind: str = PLAIN) -> int:
        """A bare probe begins at a batch of ``reqs`` requests of ``kind``: the steps it lasts (``BARE_PROBE``)."""
        self._probed[self._bucket_of(reqs, kind)] = self.steps
        return BARE_PROBE

    def _bucket_of(self, reqs: int, kind: str) -> tuple:
        """The regimes' key of a batch of ``reqs`` requests of ``kind`` in this step: its batch-size bucket and
        whether requests wait (the step's queue state, :meth:`start`). Under a queue a step holds the queue's
        prefills and, with the KV cache full, preemptions' recomputes, and the batch's drain (no queue) passes
        through the same sizes: one verdict for both flipped with the windows that fell in it
        (results/kv-pressure-2026-12-08)."""
        return kind, _bucket(reqs), self._queued

    def _live(self, q: deque) -> deque:
        """``q`` without its samples older than ``HORIZON`` measured steps."""
        while q and q[0][0] <= self.steps - HORIZON:
            q.popleft()
        return q

    def forests_lose(self, reqs: int, kind: str = PLAIN) -> bool:
        """Whether, at a batch of ``reqs`` requests of ``kind``, the windows with forests emitted fewer tokens (beam
        steps) per second than the bare windows (each over its last samples not expired, ``MIN_REGIME`` of each at
        least; else False)."""
        return self.verdict(reqs, kind) is False

    def forests_pay(self, reqs: int, kind: str = PLAIN) -> bool:
        """Whether, at a batch of ``reqs`` requests of ``kind``, forests are measured not to lose (see
        :meth:`forests_lose`; False while either side is unmeasured)."""
        return self.verdict(reqs, kind) is True

    def recycles_prompt(self, reqs: int, beam: bool) -> bool:
        """Whether a request's prompt rows are recycled (an LM head over them, ``source_drafter.prompt_rows``) in a
        batch of ``reqs`` requests: where forests of its kind (a beam request's: beam forests) are measured to pay
        there: beam forests may lose where plain ones pay, and a request's prompt rows are then an LM head for
        nothing."""
        return self.forests_pay(reqs, BEAM if beam else PLAIN)

    def verdict(self, reqs: int, kind: str = PLAIN) -> bool | None:
        """At a batch of ``reqs`` requests of ``kind``: True where the windows with forests emitted at least the bare
        windows' tokens (beam steps) per second, False where fewer, None until ``MIN_REGIME`` of each are live."""
        pair = self.regimes.get(self._bucket_of(reqs, kind))
        if pair is None:
            return None
        rates = []
        for q in map(self._live, pair):
            if len(q) < MIN_REGIME:
                return None
            rates.append(sum(t for _, _, t in q) / sum(s for _, s, _ in q))
        return rates[1] >= rates[0]

    def warming(self) -> bool:
        """Whether the engine is still in its first ``WARMUP`` decode steps, which draft no forest: they are not
        measured, and forests there would cost what the table does not know yet (their cost is measured after them,
        ``FOREST_WARMUP`` windows later)."""
        return self.warmup > 0

    def median(self, kind: int, req: str = PLAIN) -> tuple[float, int]:
        """(the median surplus of a kind of window of ``req`` requests over its samples not expired, their count)."""
        q = self.surplus_of(req)[kind]
        while q and q[0][0] <= self.steps - HORIZON:
            q.popleft()
        return (statistics.median(s for _, s in q), len(q)) if q else (0.0, 0)

    def _medians(self, req: str = PLAIN) -> list[tuple[float, int]]:
        return [self.median(k, req) for k in range(len(KINDS))]

    def extra(self, req: str = PLAIN) -> float:
        """See :meth:`_extra` (0 until measured)."""
        got = self._extra(req)
        return 0.0 if got is None else got

    def _extra(self, req: str = PLAIN) -> float | None:
        """What a step that drafts costs beyond its passes (None until measured; never below 0): over the windows that
        drafted and verified, or the sum of those that did one of them; each minus the windows that did neither;
        both estimates weighed by their windows where both exist. Without ``MIN_STEPS`` windows that did neither,
        their surplus is the additive model's ``drafted + verified - both`` where those are measured, else 0 (which
        only makes drafting look dearer)."""
        _, (d, nd), (v, nv), (b, nb) = medians = self._medians(req)
        base = self._bare(medians)
        est = []
        if nb >= MIN_STEPS:
            est.append((nb, b - base))
        if min(nd, nv) >= MIN_STEPS:
            est.append((min(nd, nv), d + v - 2 * base))
        if not est:
            return None
        return max(0.0, sum(w * x for w, x in est) / sum(w for w, _ in est))

    def base(self, req: str = PLAIN) -> float:
        """What every step costs beyond the table (never below 0): the median surplus of the windows that neither
        drafted nor verified, or the additive model's ``drafted + verified - both`` where those are measured and bare
        windows are not; 0 until measured (which only makes drafting look dearer)."""
        return max(0.0, self._bare(self._medians(req)))

    @staticmethod
    def _bare(medians) -> float:
        """The bare windows' surplus from the (median, count) of every kind (see :meth:`base`; may be below 0)."""
        (base, n0), (d, nd), (v, nv), (b, nb) = medians
        if n0 < MIN_STEPS:
            base = d + v - b if min(nd, nv, nb) >= MIN_STEPS else 0.0
        return base

    def node_cost(self, req: str = PLAIN) -> tuple[float, float] | None:
        """(a drafting step's fixed extra, each forest node's extra) from the windows that drafted or verified forests
        (``nodes`` each: those it drafted plus those it verified), their surplus over the bare windows' fitted as
        ``fixed + per_node * nodes`` by medians (Theil-Sen: the median slope over pairs of windows with different
        node counts, then the median intercept; a slow outlier moves neither); where every window held the same
        count, all of it per node (a larger forest then costs more, never less, than measured); both never below 0.
        A node is counted in two windows (drafted, then verified), so a planned node costs twice the fitted slope.
        None until ``MIN_STEPS`` such windows are measured."""
        forest = self._forest(req)
        while forest and forest[0][0] <= self.steps - HORIZON:
            forest.popleft()
        if len(forest) < MIN_STEPS:
            return None
        base = self._bare(self._medians(req))
        pts = [(x, y - base) for _, x, y in forest]
        slopes = [(y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(pts) for x1, y1 in pts[i + 1:] if x1 != x0]
        if slopes:
            per = max(0.0, statistics.median(slopes))
            fixed = statistics.median(y - per * x for x, y in pts)
            if fixed >= 0.0:
                return fixed, 2.0 * per
        return 0.0, 2.0 * max(0.0, statistics.median(y / x for x, y in pts))

    def corrected(self, table: CostTable, req: str = PLAIN) -> CostTable:
        """``table`` with a drafting step's measured extra as ``draft_step`` and ``node`` (:meth:`node_cost`, else
        :meth:`extra` and no per-node part; the table's own, the start-up probe's, until forests are measured: the
        measurement replaces them, upwards or downwards) and every step's measured surplus added to ``step``
        (:meth:`base`): a bare step is then predicted at what it measured and a drafting step at what its windows
        measured, so the choice weighs both steps' measured costs (with the surplus charged nowhere, a bare step on an
        H100 looked 9x cheaper than it was: results/gpu/2026-11-27, run 3). The surpluses are measured over the table's
        passes and ``step`` alone (the runner's :meth:`planned` seconds leave ``draft_step`` and ``node`` out).
        ``req``: from the windows of that kind of request alone (plain: plain and mixed windows; beam: beam requests'
        alone), so that beam forests are priced at what beam windows measured, never at plain forests' cost."""
        base, fit, measured = self.base(req), self.node_cost(req), self._extra(req)
        if fit is not None:  # forests' node counts measured: a fixed part and a part per node (node_cost)
            extra, node = fit
        elif measured is not None:
            extra, node = measured, 0.0
        else:  # forests not measured yet: the table's own (the start-up probe's, forest_probe.py)
            extra, node = table.draft_step, table.node
        if not base and extra == table.draft_step and node == table.node:
            return table
        return dataclasses.replace(table, step=table.step + base, draft_step=extra, node=node)

    def summary(self) -> dict:
        """The medians and counts by kind of window (``dsbd_load``'s ``clock``), and the extra they give: plain
        requests' (plain and mixed windows) at the top, beam requests' under ``"beam"``."""
        out = self._summary(PLAIN)
        out["steps"], out["beam"] = self.steps, self._summary(BEAM)
        return out

    def _summary(self, req: str) -> dict:
        fit, forest = self.node_cost(req), self._forest(req)
        out = {"draft_step": self.extra(req) if fit is None else fit[0], "step": self.base(req),
               "node": 0.0 if fit is None else fit[1],
               "forest_nodes": statistics.median(x for _, x, _ in forest) if forest else 0}
        for k, name in enumerate(KINDS):
            out[name], out[f"n_{name}"] = self.median(k, req)
        return out


def measured_tokens(scheduler_output) -> int | None:
    """The tokens a step's window is measured at (``StepClock.start``): the step's scheduled tokens, or None where
    it holds a prefill, a new request's or a resumed one's (a preempted request's recompute: hundreds of tokens the
    table's extrapolation prices badly, falling at random into either regime of the verdict,
    results/kv-pressure-2026-12-08). Reads vLLM's ``SchedulerOutput``."""
    so = scheduler_output
    return None if so.scheduled_new_reqs or so.scheduled_cached_reqs.resumed_req_ids else so.total_num_scheduled_tokens


def _bucket(reqs: int) -> int:
    """The batch-size bucket of ``reqs`` requests: the largest power of two not above it."""
    return 1 << (max(reqs, 1).bit_length() - 1)
