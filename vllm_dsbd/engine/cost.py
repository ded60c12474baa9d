"""The cost model: each step, the draft depth of every request that maximises expected tokens per second.

From (a) a table of target and draft pass times by token count (:class:`CostTable`: measured at start-up by
``load_probe.py``, or pinned in the config) and (b) each request's per-layer pass rate estimated from its **earlier**
steps (:class:`Acceptance`, a smoothed count with a prior), :func:`choose` picks the depths of a step's requests,
down to 0 (no draft) where drafting does not pay. The choice is made before any coin of the step is drawn and
depends only on the past, so every output law stays exact; every tensor-parallel rank computes the same choice (the
table is rank 0's, the estimates come from verification results every rank has). Imports neither vLLM nor torch.
The rule: docs/design.md §3.6; settings: docs/usage/configuration.md.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Acceptance", "Candidate", "CostTable", "choose", "expected_tokens"]

PRIOR_RATE = 0.6  # a new request's per-layer pass rate, before it has verified any forest
PRIOR_WEIGHT = 2.0  # how many layers' worth of evidence the prior counts for
MEMORY = 16.0  # the most layers of evidence kept (older evidence is scaled down): the estimate follows the text
MAX_WAIT = 32  # the most steps a switched-off request waits before it may try drafting again


def _interp(points: tuple[tuple[int, float], ...], n: int) -> float:
    """Piecewise-linear in the token count; the first time below the table; past its end the last slope (>= 0)."""
    sizes = [p[0] for p in points]
    k = bisect.bisect_left(sizes, n)
    if k < len(points) and sizes[k] == n:
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
    cost per step (``step``: what a step costs besides both, 0 when unknown, which only makes drafting look
    dearer)."""

    target: tuple[tuple[int, float], ...]
    draft: tuple[tuple[int, float], ...]
    step: float = 0.0

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
                f"step {1e3 * self.step:.2f} ms")


def expected_tokens(rate: float, depth: int) -> float:
    """Expected tokens (beam requests: beam steps) one pass emits with a forest of ``depth`` layers, each passed with
    probability ``rate`` given the one before: ``1 + a + ... + a^depth``."""
    return sum(rate ** k for k in range(depth + 1))


@dataclass
class Acceptance:
    """One request's per-layer pass rate, from the forests it verified in earlier steps: ``(prior + passed) /
    (prior weight + tried)``, a layer tried when the layer before it passed. Evidence beyond ``MEMORY`` layers is
    scaled down. A request the model switched off may try again (at the prior's rate, if that is higher) after
    ``wait`` steps without a forest; ``wait`` doubles (to ``MAX_WAIT``) after such a try passes no layer and is 1 again
    after any layer passes."""

    passed: float = 0.0
    tried: float = 0.0
    idle: int = 0  # steps in a row the model chose no forest for this request
    wait: int = 1
    trying: bool = False  # its current forest is a try at the prior's rate

    def rate(self) -> float:
        return (PRIOR_RATE * PRIOR_WEIGHT + self.passed) / (PRIOR_WEIGHT + self.tried)

    def planning_rate(self) -> float:
        """The rate this step's choice uses: the estimate, or the prior's rate after ``wait`` idle steps."""
        r = self.rate()
        return max(r, PRIOR_RATE) if self.idle >= self.wait else r

    def chose(self, depth: int) -> None:
        """The model chose ``depth`` for this request this step."""
        if depth <= 0:
            self.idle += 1
        else:
            self.trying = self.idle >= self.wait and self.rate() < PRIOR_RATE
            self.idle = 0

    def observe(self, passed: int, depth: int) -> None:
        """A verified forest of ``depth`` layers (the deepest scheduled node's) passed ``passed`` of them."""
        if depth <= 0:
            return
        self.passed += passed
        self.tried += min(passed + 1, depth)
        if self.tried > MEMORY:
            scale = MEMORY / self.tried
            self.passed, self.tried = self.passed * scale, MEMORY
        if passed > 0:
            self.wait = 1
        elif self.trying:
            self.wait = min(2 * self.wait, MAX_WAIT)
        self.trying = False


@dataclass(frozen=True, slots=True)
class Candidate:
    """One decoding request of a step as the model sees it: ``leaves`` tokens besides its forest (1: a plain
    request's root; W: a beam request's live leaves), ``width`` forest nodes per depth, at most ``depth`` depths,
    per-layer pass rate ``rate``, ``catch_up`` tokens in the draft's first pass (its root or leaves). ``pinned``: it
    drafts ``depth`` whatever the model says (a beam request that set its own depth)."""

    leaves: int
    width: int
    depth: int
    rate: float
    catch_up: int = 1
    pinned: bool = False


def choose(cands: Sequence[Candidate], table: CostTable) -> list[int]:
    """The depth of every candidate (order of ``cands``) maximising the step's expected tokens per second.

    Every (request, depth k) increment adds ``rate^k`` expected tokens and ``width`` target tokens, plus its nodes
    in the draft pass that depth needs (pass 0 over the catch-up tokens for k = 1, pass k - 1 over the depth-(k - 1)
    nodes otherwise). Increments are taken in order of ``rate^k / width`` (a request's come in depth order, so every
    prefix is a set of depths); the prefix with the most tokens per second wins (the empty one: no draft anywhere).
    At batch 1 this is ``argmax_d E(d) / cost(d)``."""
    if not cands:
        return []
    items = [(float("inf") if c.pinned else c.rate ** k / c.width, k, i)
             for i, c in enumerate(cands) if c.width > 0 for k in range(1, c.depth + 1)]
    items.sort(key=lambda it: (-it[0], it[1], it[2]))
    forced = sum(1 for it in items if it[0] == float("inf"))
    tokens = sum(c.leaves for c in cands)
    expect = float(len(cands))
    passes: dict[int, int] = {}  # draft pass -> tokens
    draft = 0.0
    best, best_ratio, out = 0, -1.0, [0] * len(cands)
    ratio = expect / (table.step + table.target_time(tokens))
    if forced == 0:
        best_ratio = ratio
    for m, (_, k, i) in enumerate(items, start=1):
        c = cands[i]
        expect += c.rate ** k
        tokens += c.width
        p, x = (0, c.catch_up) if k == 1 else (k - 1, c.width)
        old = passes.get(p, 0)
        draft += table.draft_time(old + x) - table.draft_time(old)
        passes[p] = old + x
        ratio = expect / (table.step + table.target_time(tokens) + draft)
        if m >= forced and ratio > best_ratio * (1 + 1e-9):
            best, best_ratio = m, ratio
    for _, k, i in items[:best]:
        out[i] = max(out[i], k)
    return out
