"""Load-aware speculation: the most each request of a step may draft, from the batch alone (the cost model,
``cost.py``, chooses each request's depth, and a T = 0 beam request's N, within it).

Verifying costs the target almost nothing under the device's compute knee and real time past it, so a step has a
verified-token budget and every request's draft shape shrinks, level by level (depth first), as the batch grows
(:func:`plan`). The plan depends only on the batch's shapes and the budget, never on a draw, an acceptance or a timing:
every tensor-parallel rank computes the same, and every output law is unchanged (a forest's shape is fixed before its
coins are drawn). ``"auto"`` with the cost model off: the knee of a start-up timing table (``load_probe.py``), never
below one request's full step; with it on, no budget. Imports neither vLLM nor torch. The levels, the plan and the
probe: docs/design/cost-model.md §3.6; settings: docs/usage/configuration.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["KNEE_RATIO", "Level", "Shape", "auto_budget", "knee", "levels", "plan", "probe_sizes"]

KNEE_RATIO = 1.25  # the knee: the most tokens whose forward time is at most KNEE_RATIO x that of one token


@dataclass(frozen=True, slots=True)
class Shape:
    """What one request of the step may schedule: ``leaves`` tokens besides its forest (1: a plain request's root;
    W: a beam request's live leaves), at most ``width`` forest nodes per depth and ``depth`` depths (as configured:
    the engine's depth, the request's width, a beam request's N). ``pinned``: it always drafts this full shape
    (counted, never cut)."""

    leaves: int
    width: int
    depth: int
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Level:
    """The draft limits of one request in one step: at most ``width`` nodes per depth, ``depth`` depths
    (``Level(0, 0)``: no forest); ``beam_nodes``: a T = 0 beam request's N for this step, chosen by the cost model
    (None: its own)."""

    width: int
    depth: int
    beam_nodes: int | None = None

    def nodes(self, shape: Shape) -> int:
        """Forest nodes ``shape`` may draft at this level."""
        if shape.pinned:
            return shape.width * shape.depth
        return min(self.width, shape.width) * min(self.depth, shape.depth)

    def tokens(self, shape: Shape) -> int:
        """Tokens ``shape`` schedules at this level (leaves + forest nodes)."""
        return shape.leaves + self.nodes(shape)


def levels(width: int, depth: int) -> list[Level]:
    """The levels from the full shape down to no forest: ``(depth, width) ... (1, 1)``, then ``(0, 0)``."""
    return [Level(w, d) for d in range(depth, 0, -1) for w in range(width, 0, -1)] + [Level(0, 0)]


def plan(shapes: Sequence[Shape], budget: int | None) -> list[Level]:
    """The level of every request of a step (order of ``shapes``) within ``budget`` scheduled tokens (None: every
    request at its full shape): the highest level at which the whole batch fits, then requests in order one level up."""
    if not shapes:
        return []
    top = Level(max(s.width for s in shapes), max(s.depth for s in shapes))
    if budget is None:
        return [top] * len(shapes)
    ladder = levels(top.width, top.depth)
    at = len(ladder) - 1
    for k, lv in enumerate(ladder):
        if sum(lv.tokens(s) for s in shapes) <= budget:
            at = k
            break
    out = [ladder[at]] * len(shapes)
    if at == 0:
        return out
    up, total = ladder[at - 1], sum(ladder[at].tokens(s) for s in shapes)
    for i, s in enumerate(shapes):
        extra = up.tokens(s) - out[i].tokens(s)
        if total + extra <= budget:
            out[i] = up
            total += extra
    return out


def probe_sizes(max_tokens: int) -> list[int]:
    """Token counts the start-up probe times: 1, 2, 4, ... up to ``max_tokens`` (which is included)."""
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max(1, max_tokens)]


def knee(times: Mapping[int, float], ratio: float = KNEE_RATIO) -> int:
    """The knee of a forward-time table {tokens: seconds} (which must hold 1): the largest n such that every probed
    m <= n took at most ``ratio`` x the time of 1 token. Sizes past the first one over the line do not count (a
    later one under it is noise)."""
    if 1 not in times:
        raise ValueError(f"the forward-time table must hold 1 token, got sizes {sorted(times)}")
    base, best = times[1], 1
    for n in sorted(times):
        if times[n] > ratio * base:
            break
        best = n
    return best


def auto_budget(measured_knee: int, full_step: int) -> int:
    """The budget of ``verify_budget="auto"``: the measured knee, but never less than ``full_step`` (one request's
    tokens at its full configured shape), so that a lone request always drafts what was configured."""
    return max(measured_knee, full_step)
