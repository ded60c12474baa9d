"""Per-request pass-rate estimates and the engine's exploration budget, the inputs of the cost model's choice
(``cost.py``), split from it by role: :class:`Acceptance` (a request's rate from its **earlier** forests, a smoothed
count with a prior, per N'; its tries after idle steps), :class:`PassRates` (each source's engine-wide rate per kind of
request and N), :class:`Subforest` / :func:`passed_by_width` (what a T = 0 beam forest's N'-subforests would have
passed), :class:`Exploration` (the probes' budget) and :class:`Candidate` (a request as a step's choice sees it).
Only the past enters, so every output law stays exact. Imports neither vLLM nor torch; ``cost`` re-exports every name.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

PRIOR_RATE = 0.6  # a new request's per-layer pass rate, before it has verified any forest
PRIOR_WEIGHT = 2.0  # how many layers' worth of evidence the prior counts for
MEMORY = 16.0  # the most layers of evidence kept (older evidence is scaled down): the estimate follows the text
MAX_WAIT = 32  # the most steps a switched-off request waits before it may try drafting again
AGING = 1.0 - 1.0 / MEMORY  # a try trusts a request's evidence less by this factor per step it went without a forest
POOL_MEMORY = 256.0  # the most layers of engine-wide evidence kept per (source, N) (PassRates)
PROBE_SHARE = 0.03  # the share of steps the exploration budget lets hold a probe (a try or a forest at the prior)
PROBE_BURST = 1.0  # the most probes it saves up (a fresh engine may probe at once)


def width_grid(low: int, high: int) -> list[int]:
    """The nodes per depth the model weighs for a request that may draft from ``low`` (a beam request's W, a plain
    request's 1) to ``high``: from ``low`` up by factors of about sqrt(2), and ``high`` (4, 6, 8, 11, 16 for W = 4,
    N = 16)."""
    out, w = [], low
    while w < high:
        out.append(w)
        w = max(w + 1, round(w * math.sqrt(2)))
    return out + [high]


@dataclass(frozen=True, slots=True)
class Subforest:
    """What a verified T = 0 beam forest says about smaller forests (:func:`passed_by_width`): the request's width
    and the forest's nodes per depth, each scheduled node's forest depth and parent (its forest index; -1 for a
    depth-1 node), nodes depth-major and each depth in the draft's rank order, and per passed layer the forest
    indices of the target's new beams."""

    width: int
    nodes: int
    layers: tuple[int, ...]
    parents: tuple[int, ...]
    beams: tuple[tuple[int, ...], ...]


def passed_by_width(layers: Sequence[int], parents: Sequence[int], beams: Sequence[Sequence[int]],
                    widths: Sequence[int]) -> dict[int, int]:
    """Layers the w-subforest of a verified T = 0 beam forest passes, for every w in ``widths`` (at most the
    forest's nodes per depth; arguments as :class:`Subforest`'s).

    The w-subforest is the forest the draft would have drawn with w nodes per depth: its depth-d nodes are the draft's
    w best children of its depth-(d - 1) nodes. The forest's depth-d nodes that are children of those hold every
    child ranking above any of them, so they are the best such children and the w-subforest's depth-d nodes are their
    first w; a layer passes when the target's new beams (the same whatever the forest: T = 0 beams are the target's)
    are all among them. Where fewer than w such children were drafted the subforest's depth d is not fully known: the
    layer counts only if the beams are among the known ones, and no deeper layer is read. So the count is exact at
    depth 1 and never above what the w-subforest would pass deeper (up to exact ties of draft scores)."""
    by_depth: dict[int, list[int]] = {}
    for c, d in enumerate(layers):
        by_depth.setdefault(d, []).append(c)
    out = {}
    for w in widths:
        keep: set[int] | None = None  # the w-subforest's nodes one depth up (None: the live beams)
        n = 0
        for d, tgt in enumerate(beams, start=1):
            kids = [c for c in by_depth.get(d, []) if keep is None or parents[c] in keep]
            top = set(kids[:w])
            if not top.issuperset(tgt):
                break
            n += 1
            if len(kids) < w:
                break
            keep = top
        out[w] = n
    return out


def _decay(pt: list[float], memory: float = MEMORY) -> None:
    """Evidence beyond ``memory`` layers tried is scaled down (``pt``: [passed, tried])."""
    if pt[1] > memory:
        scale = memory / pt[1]
        pt[0], pt[1] = pt[0] * scale, memory


def _rate(passed: float, tried: float) -> float:
    return (PRIOR_RATE * PRIOR_WEIGHT + passed) / (PRIOR_WEIGHT + tried)


def upper_rate(passed: float, tried: float) -> float:
    """An upper confidence bound of a pass rate: the estimate plus one standard deviation of a rate measured over
    the evidence (prior included), :func:`rate_bound` of ``_rate(passed, tried)``. With no evidence 0.95; it shrinks
    as layers are tried and grows again as a switched-off request's evidence ages."""
    return rate_bound(_rate(passed, tried), tried)


def rate_bound(a: float, tried: float) -> float:
    """A rate ``a`` estimated on ``tried`` layers (and the prior's weight) plus one standard deviation,
    ``a + sqrt(a (1 - a) / (PRIOR_WEIGHT + tried))``, at most 1 (:func:`upper_rate`, ``batch_end.End.hope``)."""
    return min(1.0, a + math.sqrt(max(a * (1.0 - a), 0.0) / (PRIOR_WEIGHT + tried)))


@dataclass
class PassRates:
    """The engine-wide pass rate of every forest source by nodes per depth N: layers passed per layer tried over
    every request's verified forests (``POOL_MEMORY`` layers per (source, N), older evidence scaled down). A request
    the model switched off tries again at least at this rate (:meth:`Acceptance.candidate`), so a source that passes
    for the other requests is drafted again for this one. ``source``: any key naming the source (``DRAFT``: the draft
    model) and, where a layer's pass means different things, the kind of request (the runner: (source, "plain" or
    "beam"))."""

    counts: dict[tuple[Hashable, int], list[float]] = field(default_factory=dict)  # (source, N) -> [passed, tried]

    def observe(self, source: Hashable, nodes: int, passed: int, depth: int) -> None:
        """A verified forest of ``nodes`` per depth and ``depth`` layers that passed ``passed`` of them."""
        if depth <= 0 or nodes <= 0:
            return
        pt = self.counts.setdefault((source, nodes), [0.0, 0.0])
        pt[0] += passed
        pt[1] += min(passed + 1, depth)
        _decay(pt, POOL_MEMORY)

    def rate(self, source: Hashable, nodes: int) -> float | None:
        """The measured rate of ``source`` at ``nodes`` per depth, or the best at fewer (a larger forest passes at
        least as often); None where no forest of at most ``nodes`` was verified."""
        got = self.estimate(source, nodes)
        return None if got is None else got[0]

    def estimate(self, source: Hashable, nodes: int) -> tuple[float, float] | None:
        """:meth:`rate` and the layers tried behind it."""
        got = [(_rate(*pt), pt[1]) for (s, n), pt in self.counts.items() if s == source and n <= nodes and pt[1] > 0]
        return max(got) if got else None


@dataclass
class Acceptance:
    """One request's per-layer pass rate, from the forests it verified in earlier steps: ``(prior + passed) /
    (prior weight + tried)``, a layer tried when the layer before it passed. Evidence beyond ``MEMORY`` layers is
    scaled down. A request the model switched off tries again after ``wait`` steps without a forest, at an optimistic
    rate (:meth:`try_rate`: the upper confidence bound of its evidence aged by the steps it went without a forest, or
    the source's engine-wide rate, :class:`PassRates`), so a source that passes more than the prior is found, and one
    that failed long ago is measured again; ``wait`` doubles (to ``MAX_WAIT``) after such a try passes no layer and
    is 1 again after any layer passes. The same count is kept per nodes per depth N' (``by_width``): for a T = 0 beam
    request read from the N'-subforests of its forests (:func:`passed_by_width`), for the others from the forests it
    verified at each N'."""

    passed: float = 0.0
    tried: float = 0.0
    idle: int = 0  # steps in a row the model chose no forest for this request
    wait: int = 1
    trying: bool = False  # its current forest is a try at an optimistic rate
    by_width: dict[int, list[float]] = field(default_factory=dict)  # N' -> [passed, tried] of its N'-forests
    subforests: bool = False  # its counts per N' are read off subforests (a T = 0 beam request)

    def rate(self) -> float:
        return _rate(self.passed, self.tried)

    def planning_rate(self, pool: float | None = None) -> float:
        """The rate this step's choice uses: the estimate, or after ``wait`` idle steps (a try) an optimistic one
        (:meth:`try_rate`)."""
        return self.try_rate(self.passed, self.tried, pool) if self.idle >= self.wait else self.rate()

    def try_rate(self, passed: float, tried: float, pool: float | None = None) -> float:
        """The rate of a try on evidence (``passed``, ``tried``): the upper confidence bound of the evidence aged by
        ``AGING`` per idle step (:func:`upper_rate`; the longer a request went without a forest, the less its old
        evidence is trusted), or ``pool`` (the source's engine-wide rate), or the estimate, whichever is highest."""
        g = AGING ** self.idle
        return max(upper_rate(passed * g, tried * g), _rate(passed, tried), pool or 0.0)

    def width_rate(self, width: int) -> float:
        """The estimate at ``width`` nodes per depth: its own count's, or a smaller width's where that is higher (a
        larger forest holds a smaller one's nodes: it passes at least as often). A width without a count takes the
        rate of the nearest larger width with one (a smaller forest passes at most as often); above every width with
        one, the prior's, or for a request whose forests tell only their own width (not a T = 0 beam request's, whose
        tries draft the full N) the upper bound of the largest one's count if higher (:func:`upper_rate`: it may pass
        more), so a width never drafted is tried where it could pay."""
        own = self.by_width.get(width)
        if own is not None:
            rate = _rate(*own)
        elif larger := [w for w in self.by_width if w > width]:
            rate = _rate(*self.by_width[min(larger)])
        else:
            smaller = [w for w in self.by_width if w < width]
            rate = PRIOR_RATE
            if smaller and not self.subforests:
                rate = max(rate, upper_rate(*self.by_width[max(smaller)]))
        return max([rate] + [_rate(*pt) for w, pt in self.by_width.items() if w < width])

    def fresh(self) -> bool:
        """No forest of this request was verified yet."""
        return self.tried == 0 and not self.by_width

    def candidate(self, leaves: int, width: int, depth: int, pinned: bool = False, low: int | None = None,
                  pool: float | None = None, explore: bool = True, pool_tried: float = 0.0) -> Candidate:
        """This request as this step's choice sees it (:class:`Candidate`, ``catch_up`` = ``leaves``). ``low``: the
        fewest nodes per depth it may draft (a beam request's W, a plain request's 1): the model may then choose any
        N' of ``width_grid(low, width)``, each at :meth:`width_rate`; after ``wait`` idle steps (a try) only
        ``width``, at :meth:`planning_rate` with the upper bound of its count at ``width``. ``pool``: the source's
        engine-wide rate at ``width`` (:class:`PassRates`); a request with no forest verified yet plans at it (the
        source as the engine measured it; every N' alike) where it exists, at the prior where not, and tries after
        ``wait`` idle steps as any other request. Tries and forests at the prior are probes (``Candidate.probe``,
        spending the engine's :class:`Exploration` budget); a try only where ``explore`` (the budget is open),
        otherwise it plans at its estimate. A forest at the prior is not held back (only until the source's first
        forest of its kind is verified: then the engine-wide rate exists). ``Candidate.tried``: the layers behind its
        rate, its own, or the engine-wide rate's (``pool_tried``) where it plans at that."""
        trying = self.idle >= self.wait and explore
        if self.fresh() and pool is not None and not trying:
            grid = [] if low is None or low >= width else list(reversed(width_grid(low, width)))[1:]
            return Candidate(leaves, width, depth, pool, leaves, pinned, tuple((w, pool) for w in grid),
                             tried=pool_tried)
        probe = trying or self.fresh()
        if low is None or low >= width:
            rate = self.try_rate(self.passed, self.tried, pool) if trying else self.rate()
            return Candidate(leaves, width, depth, rate, leaves, pinned, probe=probe, tried=self.tried)
        if trying:  # a try: the full width, whose forest informs the smaller ones
            own = self.by_width.get(width, (self.passed, self.tried))
            rate = max(self.try_rate(*own, pool), self.width_rate(width))
            return Candidate(leaves, width, depth, rate, leaves, pinned, probe=True, tried=self.tried)
        rates = [(w, self.width_rate(w)) for w in reversed(width_grid(low, width))]
        return Candidate(leaves, width, depth, rates[0][1], leaves, pinned, tuple(rates[1:]), probe=probe,
                         tried=self.tried)

    def chose(self, depth: int, trying: bool | None = None) -> None:
        """The model chose ``depth`` for this request this step (``trying``: its candidate was a try; by default
        whether it waited ``wait`` idle steps)."""
        if depth <= 0:
            self.idle += 1
        else:
            self.trying = self.idle >= self.wait if trying is None else trying
            self.idle = 0

    def observe(self, passed: int, depth: int, sub: Subforest | None = None, nodes: int | None = None) -> None:
        """A verified forest of ``depth`` layers (the deepest scheduled node's) passed ``passed`` of them; ``sub``
        (T = 0 beam requests): what its subforests would have passed, counted per N' of ``width_grid(W, N)``;
        ``nodes`` (the others): its nodes per depth, where the request may draft other widths."""
        if depth <= 0:
            return
        self.passed += passed
        self.tried += min(passed + 1, depth)
        pt = [self.passed, self.tried]
        _decay(pt)
        self.passed, self.tried = pt
        got = {}
        if sub is not None and sub.width <= sub.nodes:
            self.subforests = True
            got = passed_by_width(sub.layers, sub.parents, sub.beams, width_grid(sub.width, sub.nodes)[:-1])
            got[sub.nodes] = passed  # the forest itself
        elif nodes is not None:
            got = {nodes: passed}
        for w, n in got.items():
            pt = self.by_width.setdefault(w, [0.0, 0.0])
            pt[0] += n
            pt[1] += min(n + 1, depth)
            _decay(pt)
        if passed > 0:
            self.wait = 1
        elif self.trying:
            self.wait = min(2 * self.wait, MAX_WAIT)
        self.trying = False


@dataclass
class Exploration:
    """The engine's budget of probes: steps in which a request drafts at a rate its own forests do not back (a try
    after ``wait`` idle steps, or a forest at the prior). It earns ``share`` of a probe per step, up to ``burst``, and a
    step that drafts any probe spends one: so at most about ``share`` of the steps hold a probe, however many requests
    are switched off (each try doubles its own wait too). Tries due while it is closed wait for it; in an open step one
    of them tries (``shapes.MAX_TRIES``), the others in later open steps.
    A function of past choices only: every rank keeps the same budget and every law stays exact."""

    share: float = PROBE_SHARE
    burst: float = PROBE_BURST
    credit: float = PROBE_BURST
    probes: int = 0  # steps that drafted a probe
    steps: int = 0

    def open(self) -> bool:
        return self.credit >= 1.0

    def step(self, probed: bool) -> None:
        """A step's choice was made; ``probed``: it drafted a probe."""
        self.steps += 1
        if probed:
            self.credit -= 1.0
            self.probes += 1
        self.credit = min(self.burst, self.credit + self.share)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One decoding request of a step as the model sees it: ``leaves`` tokens besides its forest (1: a plain
    request's root; W: a beam request's live leaves), ``width`` forest nodes per depth, at most ``depth`` depths,
    per-layer pass rate ``rate``, ``catch_up`` tokens in the draft's first pass (its root or leaves). ``pinned``: it
    drafts ``depth`` whatever the model says (a beam request that set its own depth). ``options``: other (nodes per
    depth, rate) it may draft instead, each below ``width`` (a beam request's N' from W up, a plain request's from
    1)."""

    leaves: int
    width: int
    depth: int
    rate: float
    catch_up: int = 1
    pinned: bool = False
    options: tuple[tuple[int, float], ...] = ()
    probe: bool = False  # a try or a forest at the prior: spends the engine's exploration budget (Exploration)
    tried: float = 0.0  # layers of evidence behind ``rate`` (the batch's end judges it optimistically: batch_end)
