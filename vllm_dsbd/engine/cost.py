"""The cost model: each step, the draft shape of every request that maximises expected tokens per second.

From (a) a table of target and draft pass times by token count (:class:`CostTable`: measured at start-up by
``load_probe.py``, or pinned in the config) and (b) each request's per-layer pass rate estimated from its **earlier**
steps (:class:`Acceptance`, a smoothed count with a prior), :func:`choose_shapes` picks the depths of a step's
requests, down to 0 (no draft) where drafting does not pay, and also N, the nodes per depth (a plain request's from
1, a beam request's from W, up to its own): for a T = 0 beam request the rate at every N' <= N is read from the
N'-subforests of the forests it verified (:func:`passed_by_width`), for the others from its forests at each N'; a
request switched off tries again at an optimistic rate (:meth:`Acceptance.try_rate`, :class:`PassRates`), within the
engine's budget of probes (:class:`Exploration`), and a new request starts from its source's engine-wide rate. The
choice is made before any coin of the step is drawn and depends only on the past, so every output law stays exact; every
tensor-parallel rank computes the same choice (the table is rank 0's, the estimates come from verification results
every rank has). The estimates live in ``acceptance.py`` (re-exported here). Imports neither vLLM nor torch.
The rule: docs/design/cost-model.md §3.6; settings: docs/usage/configuration.md.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .batch_end import End

# the estimates and the candidate they make, re-exported: ``cost.Acceptance`` etc. as before the split
from .acceptance import (AGING, MAX_WAIT, MEMORY, POOL_MEMORY, PRIOR_RATE, PRIOR_WEIGHT, PROBE_BURST,  # noqa: F401
                         PROBE_SHARE, Acceptance, Candidate, Exploration, PassRates, Subforest, passed_by_width,
                         upper_rate, width_grid)

__all__ = ["FLOOR", "LAST_FLOOR", "Acceptance", "Candidate", "CostTable", "Exploration", "PassRates", "Subforest",
           "choose", "choose_shapes", "draft_seconds", "end_excludes", "expected_tokens", "floors_exclude",
           "none_can_pay", "passed_by_width", "prompt_row_limit", "request_floors", "upper_rate", "width_grid"]

DRAFT = "model"  # the source name of the draft model's forests (PassRates, the metrics' ``source`` label)
FLOOR = 0.95  # the engine's shapes keep every request at this share of its tokens per second without forests at least
# ... and the request with the most tokens left (an offline batch's last to finish) at this share (request_floors)
LAST_FLOOR = 0.99
MAX_SWEEPS = 4  # the most rounds of the per-request refinement of nodes per depth (choose_shapes)
# a request's prompt rows (the recycle source's LM head over its prompt) cost at most this share of its time without
# forests (prompt_row_limit)
PROMPT_SHARE = 0.05


def _interp(points: tuple[tuple[int, float], ...], n: int) -> float:
    """Piecewise-linear in the token count; the first time below the table; past its end the last slope (>= 0)."""
    k = bisect.bisect_left(points, (n,))  # the first point of at least n tokens ((n,) sorts before (n, t))
    if k < len(points) and points[k][0] == n:
        return points[k][1]
    if k == 0:
        return points[0][1]
    if k == len(points):
        if len(points) == 1:
            return points[0][1]
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n1)
    (n0, t0), (n1, t1) = points[k - 1], points[k]
    return t0 + (t1 - t0) * (n - n0) / (n1 - n0)


def _points(times: Mapping, what: str) -> tuple[tuple[int, float], ...]:
    try:
        pts = sorted((int(n), float(t)) for n, t in times.items())
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"DSBD cost model: {what} must map token counts to times, got {times!r}") from None
    if not pts or any(n < 1 or not t >= 0.0 for n, t in pts):
        raise ValueError(f"DSBD cost model: {what} must map token counts >= 1 to times >= 0, got {times!r}")
    return tuple(pts)


@dataclass(frozen=True, slots=True)
class CostTable:
    """Seconds of one target pass and of one draft pass by the tokens they run (each with its LM head), and a fixed
    cost per step (``step``: what a step costs besides both; pinned, or measured while serving by
    ``step_clock.StepClock``; 0 when unknown, which only makes drafting look dearer), plus ``draft_step``: what a step
    in which any request drafts costs beyond its passes (the host work of drafting and verifying forests), and
    ``node``: what each forest node costs beyond the table's target tokens (forest attention's recompute, the
    drafter's and verifier's work per node: ~2.5 ms on 2 CPU cores where the start-up table says less); both 0 unless
    measured while serving (``step_clock.StepClock``)."""

    target: tuple[tuple[int, float], ...]
    draft: tuple[tuple[int, float], ...]
    step: float = 0.0
    draft_step: float = 0.0
    node: float = 0.0

    @classmethod
    def from_times(cls, target: Mapping, draft: Mapping, step: float = 0.0) -> CostTable:
        """From ``{tokens: seconds}`` tables."""
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not step >= 0.0:
            raise ValueError(f"DSBD cost model: the step time must be a number >= 0, got {step!r}")
        return cls(_points(target, "target"), _points(draft, "draft"), float(step))

    @classmethod
    def from_config(cls, d: Mapping) -> CostTable:
        """From the config's pinned table ``{"target_ms": {tokens: ms}, "draft_ms": {...}, "step_ms": ms}``."""
        unknown = sorted(set(d) - {"target_ms", "draft_ms", "step_ms"})
        if unknown or "target_ms" not in d or "draft_ms" not in d:
            raise ValueError("DSBD config: a pinned 'cost_model' is {'target_ms': {tokens: ms}, 'draft_ms': {tokens: "
                             f"ms}} and optionally 'step_ms': ms, got {dict(d)!r}")
        if not isinstance(d["target_ms"], Mapping) or not isinstance(d["draft_ms"], Mapping):
            raise ValueError(f"DSBD config: 'cost_model' tables must be mappings, got {dict(d)!r}")
        ms = 1e-3
        step = d.get("step_ms", 0.0)
        return cls.from_times({n: t * ms for n, t in _points(d["target_ms"], "target_ms")},
                              {n: t * ms for n, t in _points(d["draft_ms"], "draft_ms")},
                              step * ms if isinstance(step, (int, float)) and not isinstance(step, bool) else step)

    def target_time(self, n: int) -> float:
        return _interp(self.target, n)

    def draft_time(self, n: int) -> float:
        """A draft pass over n tokens; no pass (n = 0) costs nothing."""
        return _interp(self.draft, n) if n > 0 else 0.0

    def describe(self) -> str:
        def fmt(pts):
            return "{" + ", ".join(f"{n}: {1e3 * t:.2f}" for n, t in pts) + "}"

        return (f"target ms by tokens {fmt(self.target)}, draft ms by tokens {fmt(self.draft)}, "
                f"step {1e3 * self.step:.2f} ms" + (f", drafting step +{1e3 * self.draft_step:.2f} ms"
                                                      if self.draft_step else "")
                + (f", forest node +{1e3 * self.node:.3f} ms" if self.node else ""))


def expected_tokens(rate: float, depth: int) -> float:
    """Expected tokens (beam requests: beam steps) one pass emits with a forest of ``depth`` layers, each passed with
    probability ``rate`` given the one before: ``1 + a + ... + a^depth``."""
    return sum(rate ** k for k in range(depth + 1))


def _greedy(cands: Sequence[Candidate], table: CostTable, scale: Sequence[float] | None = None,
            end: End | None = None) -> list[int]:
    """The depths at each candidate's ``width`` (see :func:`choose_shapes`); with ``scale`` (1 / each request's
    floor), the best of the prefixes that keep every request at its floor of its rate in the minimal step
    (:func:`_keeps_floor`) and, with ``end``, the batch's end at ``LAST_FLOOR`` (:func:`_keeps_end`), over two orders
    of the increments: by value, and with every request's first layer first (a floor binds where a request without a
    forest would be slowed by the others')."""
    items = [(float("inf") if c.pinned else c.rate ** k / c.width, k, i)
             for i, c in enumerate(cands) if c.width > 0 for k in range(1, c.depth + 1)]
    items.sort(key=lambda it: (-it[0], it[1], it[2]))
    best, ratio, free = _best_prefix(cands, table, items, scale, end)
    if best != free:  # the floor binds: also the first layers first (pinned ones stay in front)
        firsts = sorted(items, key=lambda it: (it[0] != float("inf"), it[1] > 1))
        alt, alt_ratio, _ = _best_prefix(cands, table, firsts, scale, end)
        if alt_ratio > ratio * (1 + 1e-9):
            items, best = firsts, alt
    out = [0] * len(cands)
    for _, k, i in items[:best]:
        out[i] = max(out[i], k)
    return out


def _best_prefix(cands: Sequence[Candidate], table: CostTable, items: list,
                 scale: Sequence[float] | None, end: End | None = None) -> tuple[int, float, int]:
    """The length of the prefix of ``items`` ((value, depth k, candidate) increments; a candidate's in depth order)
    with the most expected tokens per second, and that rate; the pinned prefix at least; with ``scale`` (1 / each
    request's floor), only prefixes that keep every request at its floor of its rate in that pinned prefix's step,
    and with ``end`` the batch's end (:func:`_keeps_end`, checked only where a prefix would win). Third: the best
    length without the floor."""
    forced = sum(1 for it in items if it[0] == float("inf"))
    tokens = base = sum(c.leaves for c in cands)
    expect = float(len(cands))
    passes: dict[int, int] = {}  # draft pass -> tokens
    draft = 0.0
    seconds = table.step + table.target_time(tokens)
    best, best_ratio = 0, (expect / seconds if forced == 0 else -1.0)
    free, free_ratio = best, best_ratio
    least = _Least(scale) if scale is not None else None  # every candidate's expected tokens over its floor, the least
    ref = seconds  # the pinned prefix's step (the bare one without pinned requests)
    depths = [0] * len(cands)
    rates = [c.rate for c in cands]
    for m, (_, k, i) in enumerate(items, start=1):
        depths[i] = k
        c = cands[i]
        expect += c.rate ** k
        tokens += c.width
        p, x = (0, c.catch_up) if k == 1 else (k - 1, c.width)
        old = passes.get(p, 0)
        draft += table.draft_time(old + x) - table.draft_time(old)
        passes[p] = old + x
        seconds = (table.step + table.draft_step + table.target_time(tokens) + draft + table.node * (tokens - base))
        ratio = expect / seconds
        if least is not None and not c.pinned:  # a pinned request keeps its minimal step's tokens
            least.add(i, c.rate ** k)
        if m < forced:
            continue
        if ratio > free_ratio * (1 + 1e-9):
            free, free_ratio = m, ratio
        if m == forced:
            ref = seconds
        elif least is not None and not _keeps_floor(least.min(), ref, seconds):
            continue
        if ratio > best_ratio * (1 + 1e-9) and (end is None or _keeps_end(end, rates, depths, ref, seconds)):
            best, best_ratio = m, ratio
    return best, best_ratio, free


def _keeps_floor(least: float, ref: float, seconds: float) -> bool:
    """Whether a step of ``seconds`` keeps every request at its floor of its rate in a step of ``ref`` seconds that
    expects 1 token of each (a request's tokens per second against the minimal step's: plain vLLM's where no request
    is pinned); ``least``: the least over the requests of expected tokens over floor."""
    return least * ref >= seconds * (1 - 1e-12)


def _keeps_end(end: End, rates: Sequence[float], depths: Sequence[int], ref: float, seconds: float) -> bool:
    """Whether a step of ``seconds`` moves the batch's end (:class:`End`) at ``LAST_FLOOR`` of the minimal step's
    pace (``ref`` seconds, one token)."""
    return _keeps_floor(end.tokens(rates, depths) / LAST_FLOOR, ref, seconds)


def _two_least(vals: list[float]) -> tuple[float, int, float, int]:
    """The least of ``vals`` and its index, the least of the others and its index (inf, -1 for one value)."""
    i = min(range(len(vals)), key=vals.__getitem__)
    j = min((k for k in range(len(vals)) if k != i), key=vals.__getitem__, default=-1)
    return vals[i], i, vals[j] if j >= 0 else float("inf"), j


class _Least:
    """Each candidate's expected tokens (1 + the ``rate^k`` of its layers so far) over its floor and their minimum, in
    O(log n) an update (a heap with stale entries popped: the values only grow)."""

    def __init__(self, scale: Sequence[float]):
        self.scale = scale
        self.vals = list(scale)
        self.heap = [(v, i) for i, v in enumerate(self.vals)]
        heapq.heapify(self.heap)

    def add(self, i: int, gain: float) -> None:
        if gain > 0.0:  # (a floor of 0: an infinite scale)
            self.vals[i] += gain * self.scale[i]
            heapq.heappush(self.heap, (self.vals[i], i))

    def min(self) -> float:
        heap, vals = self.heap, self.vals
        while heap[0][0] != vals[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][0]


_EXP = 1074  # every finite float is an integer multiple of 2^-1074
_DEN = 1 << _EXP


def _exact(x: float) -> int:
    """``x`` as an exact integer multiple of 2^-1074 (a float's denominator is a power of 2)."""
    n, d = x.as_integer_ratio()
    return n << (_EXP + 1 - d.bit_length())


class _Step:
    """A step's expected tokens and time for the candidates' current shapes, one request's shape changed at a time:
    running sums, so a change and :meth:`ratio` cost O(depth), not O(requests). The expected tokens' sum is kept
    exactly (an integer count of 2^-1074) and rounded once: the float ``math.fsum`` of the requests' values, bit for
    bit, whatever the order of the changes."""

    def __init__(self, cands: Sequence[Candidate], shapes: list[tuple[int, int]], table: CostTable):
        self.cands, self.table, self.shapes = cands, table, shapes
        self.rates = [dict(((c.width, c.rate),) + c.options) for c in cands]
        self.tokens = self.leaves = sum(c.leaves for c in cands)
        self.passes = [0] * max([c.depth for c in cands] + [1])  # draft pass -> tokens
        self.expect = [1.0] * len(cands)
        self._one = _exact(1.0)
        self._exp = [self._one] * len(cands)  # ``expect`` exactly
        self._sum = len(cands) * self._one  # their sum, exactly
        self._drafting = 0  # requests with a forest
        self._memo: dict[tuple[int, int, int], tuple[float, int]] = {}  # (i, N', d) -> its expected tokens
        self._target_t: dict[int, float] = {}  # the table's times by tokens, looked up once
        self._draft_t: dict[int, float] = {0: 0.0}
        for i, s in enumerate(shapes):
            self._add(i, s, 1)

    def _add(self, i: int, shape: tuple[int, int], sign: int) -> None:
        w, d = shape
        if d <= 0 or w <= 0:
            if sign > 0:
                self._sum += self._one - self._exp[i]
                self.expect[i], self._exp[i] = 1.0, self._one
            return
        self._drafting += sign
        self.tokens += sign * w * d
        passes = self.passes
        passes[0] += sign * self.cands[i].catch_up
        for p in range(1, d):
            passes[p] += sign * w
        if sign > 0:
            if (got := self._memo.get((i, w, d))) is None:
                e = expected_tokens(self.rates[i][w], d)
                got = self._memo[i, w, d] = (e, _exact(e))
            self._sum += got[1] - self._exp[i]
            self.expect[i], self._exp[i] = got

    def set(self, i: int, shape: tuple[int, int]) -> None:
        self._add(i, self.shapes[i], -1)
        self.shapes[i] = shape
        self._add(i, shape, 1)

    def draft_seconds(self) -> float:
        """The step's draft passes, and its drafting-step cost if any request drafts, and its forest nodes' cost."""
        t, memo = self.table, self._draft_t
        for n in self.passes:
            if n not in memo:
                memo[n] = t.draft_time(n)
        draft = sum(memo[n] for n in self.passes) + t.node * (self.tokens - self.leaves)
        return draft + (t.draft_step if self._drafting else 0.0)

    def seconds(self) -> float:
        n = self.tokens
        if (target := self._target_t.get(n)) is None:
            target = self._target_t[n] = self.table.target_time(n)
        return self.table.step + target + self.draft_seconds()

    def ratio(self) -> float:
        return (self._sum / _DEN) / self.seconds()


def prompt_row_limit(table: CostTable, reqs: int, remaining: int, head_share: float) -> int | None:
    """The most prompt rows of a request the recycle source takes (an LM head over each, source_drafter.prompt_rows)
    in a step of ``reqs`` requests: as many as cost at most ``PROMPT_SHARE`` of the request's share of its
    ``remaining`` tokens' steps without forests (``table.step + target(reqs)`` over ``reqs``, each token), a row
    priced at ``head_share`` (the LM head's share of the target's parameters) of the table's marginal target token
    (its last two points). Whatever the rows give back, they slow the request by at most that share; None (no limit)
    where the table's marginal token is free."""
    (n0, t0), (n1, t1) = table.target[-2:] if len(table.target) > 1 else ((0, 0.0), table.target[-1])
    row = head_share * (t1 - t0) / max(n1 - n0, 1)
    if row <= 0.0:
        return None
    bare = (table.step + table.target_time(max(reqs, 1))) / max(reqs, 1)
    return max(0, int(PROMPT_SHARE * remaining * bare / row))


def request_floors(remaining: Sequence[int]) -> list[float]:
    """Each request's floor while none waits (:func:`choose_shapes`), from the tokens it has left (``max_tokens``
    less its output, or the context left): ``max(FLOOR, LAST_FLOOR * R_i / R_max)``. With no request waiting an
    offline batch ends with its last request, at about ``R_i T / E_i`` for the one with the most left; so that one
    keeps ``LAST_FLOOR`` of its pace (``R_i T / E_i <= R_max T_min / LAST_FLOOR`` for every i: the batch's projected
    end stays within 1% of plain vLLM's), and one with less left may be slowed down to that bound, never below
    ``FLOOR``. Forests that pay for every request still pass: the floor is each one's own tokens per second."""
    most = max(remaining, default=0)
    if most <= 0:
        return [FLOOR] * len(remaining)
    return [max(FLOOR, LAST_FLOOR * (max(r, 0) / most)) for r in remaining]


def _target_falls(table: CostTable) -> bool:
    """Whether the table's target times ever fall with more tokens (a pinned table may): the bounds
    (:func:`none_can_pay`, :func:`floors_exclude`) then do not hold."""
    pts = table.target
    return any(b[1] < a[1] for a, b in zip(pts, pts[1:]))


def none_can_pay(cands: Sequence[Candidate], table: CostTable) -> bool:
    """Whether no forest of any shape the candidates allow can make the step faster than none (then
    :func:`choose_shapes` chooses depth 0 for every candidate, which it returns at once). A bound, cheap where the
    model would try every request's every shape (O(R) tries and more at R requests: ~8 ms a step at R = 128 on 2 CPU
    cores, results/cost-host-2026-12-06): a forest of ``m`` layers over all requests adds at most the ``m`` largest
    ``rate^k`` among the candidates' layers (each candidate at its highest rate over its N') to the bare step's
    expected tokens, and costs at least the drafting step, ``m`` nodes (``node`` each) and the bare step's target pass
    (draft passes and target tokens only add); where that bound stays below the bare step's tokens per second for
    every ``m``, no forest pays. Never with a pinned candidate (it drafts whatever the model says); False where the
    table's target times ever fall (a pinned table may)."""
    if not cands or any(c.pinned for c in cands):
        return not cands
    if _target_falls(table):
        return False
    leaves = sum(c.leaves for c in cands)
    bare = table.step + table.target_time(leaves)
    if not bare > 0.0:
        return False
    expect = float(len(cands))
    floor = expect / bare * (1.0 - 1e-6)  # the bare step's tokens per second, less a margin for rounding
    gains = []
    for c in cands:
        if c.width > 0:
            r = max([c.rate] + [x for _, x in c.options])
            gains += [r ** k for k in range(1, c.depth + 1)]
    gains.sort(reverse=True)
    fixed = bare + table.draft_step
    for m, g in enumerate(gains, start=1):
        expect += g
        if expect / (fixed + table.node * m) >= floor:
            return False
    return True


def floors_exclude(cands: Sequence[Candidate], table: CostTable, scale: Sequence[float]) -> bool:
    """Whether no forest keeps every request at its floor (``scale``: 1 / each floor; :func:`choose_shapes` then returns
    the minimal step at once). A bound, O(R) shapes' sums a round, for the steps where floors bind (an offline batch's
    requests at LAST_FLOOR, none of which gains much): any forest costs at least the bare step, the drafting step, a
    node and the target's next token, ``T1``; a request without a forest keeps its floor only while
    ``T <= ref / f_i``, so where ``T1`` breaks that for every request, every request must draft, and the step then
    costs at least the drafting step, its smallest forest's nodes for every request, the target pass over them and the
    draft's pass over their catch-ups, ``Tall``. Then to a fixed point: where request i keeps its floor in a step of
    ``T`` (a lower bound of the step, first ``Tall``) only in shapes (N', d) with at least ``m_i`` nodes beyond its
    smallest forest's, every feasible step costs at least ``Tall`` with ``sum m_i`` nodes more, a new ``T``; where
    some request keeps its floor in no shape at such a ``T``, no shape is feasible (the README job's steps that the
    first round alone let through: tests/unit/test_cost_floor.py). Never with a pinned candidate; False where the
    table's target times ever fall."""
    if not cands or any(c.pinned for c in cands) or _target_falls(table):
        return False
    leaves = sum(c.leaves for c in cands)
    ref = table.step + table.target_time(leaves)
    one = table.step + table.target_time(leaves + 1) + table.draft_step + table.node
    if any(_keeps_floor(x, ref, one) for x in scale):  # a request may go without a forest: no bound
        return False
    if any(c.width <= 0 or c.depth <= 0 for c in cands):  # one cannot draft, and every one must
        return True
    least = [min([c.width] + [w for w, _ in c.options]) for c in cands]
    nodes = sum(least)
    fixed = table.step + table.draft_step + table.draft_time(sum(c.catch_up for c in cands))

    def every(more: int) -> float:  # every request at its smallest forest, and ``more`` nodes besides
        return fixed + table.target_time(leaves + nodes + more) + table.node * (nodes + more)

    # each request's shapes as (nodes beyond its smallest forest's, expected tokens over its floor), fewest nodes first
    shapes = [sorted((w * d - low, expected_tokens(r, d) * x) for w, r in ((c.width, c.rate),) + c.options
                     for d in range(1, c.depth + 1)) for c, x, low in zip(cands, scale, least)]
    more = 0  # nodes that every feasible step holds beyond every request's smallest forest, at least
    while True:
        t = every(more)
        need = 0
        for own in shapes:
            m = next((n for n, g in own if _keeps_floor(g, ref, t)), None)
            if m is None:  # this request keeps its floor in no shape at a step of at least t
                return True
            need += m
        if need <= more:
            return False
        more = need


def end_excludes(cands: Sequence[Candidate], table: CostTable, end: End) -> bool:
    """Whether no forest moves the batch's end (:class:`batch_end.End`) at ``LAST_FLOOR`` of the minimal step's pace
    (:func:`choose_shapes` then returns the minimal step at once). A bound, O(R): while a request with the most left
    goes without a forest the end moves 1 token, so any forest must cost at most the minimal step over ``LAST_FLOOR``;
    with every such request drafting, the step costs at least the drafting step, their smallest forests' nodes, the
    target pass over them and the draft's pass over their catch-ups, and the end moves at most :meth:`End.bound` (each
    at its highest rate, judged as :meth:`End.hope` does, and full depth). Never with a pinned candidate; False where
    the table's target times ever fall."""
    if any(c.pinned for c in cands) or _target_falls(table):
        return False
    leaves = sum(c.leaves for c in cands)
    ref = table.step + table.target_time(leaves)
    one = table.step + table.target_time(leaves + 1) + table.draft_step + table.node
    if _keeps_floor(1.0 / LAST_FLOOR, ref, one):  # a forest beside the tied requests may pay: no bound
        return False
    tied = [cands[i] for i in end.tied]
    if any(c.width <= 0 or c.depth <= 0 for c in tied):
        return True
    nodes = sum(min([c.width] + [w for w, _ in c.options]) for c in tied)
    every = (table.step + table.draft_step + table.draft_time(sum(c.catch_up for c in tied))
             + table.target_time(leaves + nodes) + table.node * nodes)
    most = end.bound([[c.rate] + [r for _, r in c.options] for c in cands], [c.depth for c in cands])
    return not _keeps_floor(most / LAST_FLOOR, ref, every)


def choose_shapes(cands: Sequence[Candidate], table: CostTable, floor: float | Sequence[float] | None = None,
                  left: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The (nodes per depth, depth) of every candidate (order of ``cands``) maximising the step's expected tokens per
    second (depth 0: no forest, reported at the candidate's ``width``).

    First the depths at each candidate's ``width``: every (request, depth k) increment adds ``rate^k`` expected tokens
    and ``width`` target tokens, plus its nodes in the draft pass that depth needs (pass 0 over the catch-up tokens for
    k = 1, pass k - 1 over the depth-(k - 1) nodes otherwise). Increments are taken in order of ``rate^k / width`` (a
    request's come in depth order, so every prefix is a set of depths); the prefix with the most tokens per second
    wins (the empty one: no draft anywhere). At batch 1 this is ``argmax_d E(d) / cost(d)``. With ``options``: the
    same with every such candidate at its j-th largest N' instead, for each j, where strictly faster (draft passes
    are shared: a lone request may not pay for one where all together do); then, while any changes (at most
    ``MAX_SWEEPS`` rounds), each candidate with ``options`` in turn takes the (N', depth) of all its own that makes
    the step fastest with the others' shapes fixed, only where strictly faster (ties keep the shape; among new ones
    the shallower, then the wider): at batch 1 the argmax over every (N', depth).

    ``floor`` (one for all, or one per candidate: the engine's :func:`request_floors`): only shapes under which every
    request i expects at least ``floor[i]`` of its tokens per second in the minimal step (no forest but the pinned
    ones: plain vLLM's step where none is pinned), ``E_i / T >= floor_i / T_min``: no request is slowed by the others'
    forests, and an offline batch's last request, whose time is the batch's, keeps plain vLLM's pace
    (docs/design/cost-model.md §3.6). ``left`` (with ``floor``; the tokens each request has left): also the batch's
    end, the order statistic of every request's gain (:class:`batch_end.End`), at ``LAST_FLOOR`` of the minimal
    step's pace; not with a pinned candidate, nor of a probe (a try, a forest at the prior: the engine's exploration
    budget pays for what it learns, and a request's rate is learnt only from its forests): on a probe's step the
    others' forests stay only where they pay for the end beside the probes' alone (:func:`_probes_alone`)."""
    if not cands:
        return []
    if none_can_pay(cands, table):  # nothing to try (the bound, :func:`none_can_pay`; a floor only removes shapes)
        return [(c.width, 0) for c in cands]
    if floor is not None and not isinstance(floor, Sequence):
        floor = [floor] * len(cands)
    scale = None if floor is None else [1.0 / f if f > 0 else float("inf") for f in floor]  # expected tokens per floor
    if scale is not None and floors_exclude(cands, table, scale):  # no forest keeps every floor (the bound)
        return [(c.width, 0) for c in cands]
    end = (End(left, [c.tried for c in cands]) if scale is not None and left
           and not any(c.pinned or c.probe for c in cands) else None)
    if end is not None and end_excludes(cands, table, end):  # no forest moves the batch's end enough (the bound)
        return [(c.width, 0) for c in cands]
    shapes = [(c.width, d) for c, d in zip(cands, _greedy(cands, table, scale, end))]
    movable = [i for i, c in enumerate(cands) if c.options and not c.pinned and c.width > 0]
    if not movable:
        return _probes_alone(cands, table, shapes, left, scale)
    step = _Step(cands, shapes, table)
    best_ratio = step.ratio()
    for j in range(1, max(len(cands[i].options) for i in movable) + 1):  # every request at its j-th largest N'
        alt = list(cands)
        for i in movable:
            w, r = sorted(cands[i].options, reverse=True)[min(j, len(cands[i].options)) - 1]
            alt[i] = Candidate(cands[i].leaves, w, cands[i].depth, r, cands[i].catch_up)
        trial = _Step(cands, [(a.width, d) for a, d in zip(alt, _greedy(alt, table, scale, end))], table)
        if (r := trial.ratio()) > best_ratio * (1 + 1e-9):
            step, best_ratio = trial, r
    if floor is not None:  # the minimal step, and each request's tokens against its own there (a pinned one's: 1)
        ref = _Step(cands, [(c.width, c.depth if c.pinned else 0) for c in cands], table).seconds()
        if end is not None:
            rates, depths = [step.rates[k][w] for k, (w, _) in enumerate(step.shapes)], [d for _, d in step.shapes]
        gains = [(1.0 if c.pinned else e) * x for c, e, x in zip(cands, step.expect, scale)]
        low = _two_least(gains)
    for _ in range(MAX_SWEEPS):
        changed = False
        for i in movable:
            c = cands[i]
            cur = step.shapes[i]
            best, best_ratio = cur, step.ratio()
            widths = sorted(step.rates[i], reverse=True)
            if floor is not None:
                others = low[2] if i == low[1] else low[0]  # the least over the other requests
            for d in range(c.depth + 1):
                for w in widths if d else [c.width]:
                    if (w, d) == cur:
                        continue
                    step.set(i, (w, d))
                    if (floor is not None
                            and not _keeps_floor(min(others, step.expect[i] * scale[i]), ref, step.seconds())):
                        continue
                    if (r := step.ratio()) > best_ratio * (1 + 1e-9):
                        if end is not None:
                            rates[i], depths[i] = step.rates[i][w], d
                            if not _keeps_end(end, rates, depths, ref, step.seconds()):
                                continue
                        best, best_ratio = (w, d), r
            step.set(i, best)
            if end is not None:
                rates[i], depths[i] = step.rates[i][best[0]], best[1]
            changed |= best != cur
            if floor is not None and best != cur:
                gains[i] = step.expect[i] * scale[i]
                if i in (low[1], low[3]) or gains[i] < low[2]:  # the two least may have moved: found again, O(requests)
                    low = _two_least(gains)
        if not changed:
            break
    return _probes_alone(cands, table, step.shapes, left, scale)


def _probes_alone(cands: Sequence[Candidate], table: CostTable, shapes: list[tuple[int, int]],
                  left: Sequence[int] | None, scale: Sequence[float] | None) -> list[tuple[int, int]]:
    """On a probe's step (no batch's end asked of the whole step: the exploration budget pays for the probes), the
    other requests' forests stay only where they keep the batch's end at ``LAST_FLOOR`` of the pace of the step with
    the probes' forests alone (a probe counted as passing every layer it drafts); else only the probes draft. Not
    with a pinned candidate, nor without floors or ``left``."""
    if (scale is None or not left or any(c.pinned for c in cands) or not any(c.probe for c in cands)
            or not any(d > 0 and not c.probe for c, (_, d) in zip(cands, shapes))):
        return shapes
    alone = [(w, d if c.probe else 0) for c, (w, d) in zip(cands, shapes)]
    end = End(left, [float("inf") if c.probe else c.tried for c in cands])
    step = _Step(cands, list(shapes), table)
    rates = [1.0 if c.probe else step.rates[k][w] for k, (c, (w, _)) in enumerate(zip(cands, shapes))]
    base = end.tokens(rates, [d for _, d in alone])
    ref = _Step(cands, list(alone), table).seconds()
    return shapes if _keeps_floor(end.tokens(rates, [d for _, d in shapes]) / (LAST_FLOOR * base), ref,
                                  step.seconds()) else alone


def draft_seconds(cands: Sequence[Candidate], shapes: Sequence[tuple[int, int]], table: CostTable) -> float:
    """What the table expects the chosen ``shapes`` to cost in draft passes (and the drafting step), in seconds."""
    return _Step(cands, list(shapes), table).draft_seconds() if cands else 0.0


def choose(cands: Sequence[Candidate], table: CostTable) -> list[int]:
    """The depth of every candidate (order of ``cands``): :func:`choose_shapes`'s depths."""
    return [d for _, d in choose_shapes(cands, table)]
