"""``cost.choose_shapes``' step sums as they were until 2026-12-06, the reference the running sums are checked against
(``tests/unit/test_cost.py``) and timed against (``benchmarks/engine/choose_shapes_time.py``)."""
from __future__ import annotations

import math

from vllm_dsbd.engine import cost


class FsumStep(cost._Step):
    """``_Step`` with ``math.fsum`` over every request's expected tokens and a scan for a drafting request at each
    ratio (O(requests) a call)."""

    def draft_seconds(self) -> float:
        t = self.table
        draft = sum(t.draft_time(n) for n in self.passes) + t.node * (self.tokens - self.leaves)
        return draft + (t.draft_step if any(w > 0 and d > 0 for w, d in self.shapes) else 0.0)

    def ratio(self) -> float:
        return math.fsum(self.expect) / (self.table.step + self.table.target_time(self.tokens) + self.draft_seconds())


_INTERP = cost._interp  # the shipped one (a timing run puts full_interp in its place)


def full_interp(points, n: int) -> float:
    """``cost._interp`` with the list of the table's sizes built at every call, as it was (the same values)."""
    sizes = [p[0] for p in points]  # noqa: F841  (the old code's per-call work, kept for the timing)
    return _INTERP(points, n)
