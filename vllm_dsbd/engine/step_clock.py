"""Online correction of the cost model's table from the steps the engine actually ran (``cost_model: "auto"``).

The start-up table times the target and draft passes alone; a step that drafts also pays host work the table does not
see (drafting and verifying forests, forest attention outside vLLM's kernels), so at batch 1 on a CPU the model drafted
where drafting lost. Each step the runner reports its wall time (from ``execute_model`` to the end of drafting) with
what the table predicted for it; :class:`StepClock` keeps moving averages of the surplus over steps without and with
drafting, and :meth:`StepClock.corrected` adds their difference to the table as ``draft_step``, the extra cost of a
step in which any request drafts. Only timings of past steps
enter, so every output law stays exact; the choices now depend on timings, so seeded outputs reproduce only with a
pinned table (the correction is off then) and only without tensor parallelism (ranks' clocks differ: off there too).
Imports neither vLLM nor torch.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from .cost import CostTable

ALPHA = 0.1  # weight of the newest step in the moving averages
MIN_STEPS = 3  # steps of a kind measured before its average is used
WARMUP = 8  # decode steps not measured after start-up (one-time costs: first allocations, first forests)


@dataclass
class StepClock:
    """Moving averages of measured minus predicted step seconds: ``bare`` over steps where no request drafted,
    ``drafting`` over steps where one did. The runner calls :meth:`start` as a step begins (its scheduled tokens;
    None: a step with a prefill, not measured; the first ``warmup`` decode steps are not measured either),
    :meth:`planned` when the cost model chose the next forests, and :meth:`finish` once they are drafted, which
    returns the corrected table."""

    bare: float = 0.0
    drafting: float = 0.0
    n_bare: int = 0
    n_drafting: int = 0
    warmup: int = WARMUP
    _t0: float | None = None
    _tokens: int = 0
    _draft: float = 0.0
    _drafted: bool = False

    def observe(self, seconds: float, predicted: float, drafted: bool) -> None:
        surplus = seconds - predicted
        if drafted:
            self.n_drafting += 1
            self.drafting = surplus if self.n_drafting == 1 else self.drafting + ALPHA * (surplus - self.drafting)
        else:
            self.n_bare += 1
            self.bare = surplus if self.n_bare == 1 else self.bare + ALPHA * (surplus - self.bare)

    def start(self, tokens: int | None) -> None:
        if tokens is not None and self.warmup > 0:
            self.warmup, tokens = self.warmup - 1, None
        self._t0 = None if tokens is None else time.perf_counter()
        self._tokens, self._draft, self._drafted = tokens or 0, 0.0, False

    def planned(self, draft_seconds: float, drafted: bool) -> None:
        self._draft, self._drafted = draft_seconds, drafted

    def finish(self, table: CostTable) -> CostTable:
        if self._t0 is not None:
            predicted = table.step + table.target_time(self._tokens) + self._draft
            self.observe(time.perf_counter() - self._t0, predicted, self._drafted)
            self._t0 = None
        return self.corrected(table)

    def corrected(self, table: CostTable) -> CostTable:
        """``table`` with a drafting step's measured extra (``draft_step`` += drafting - bare surplus, not below 0; the
        bare surplus counts as 0 until ``MIN_STEPS`` bare steps were measured, the drafting one is used from
        ``MIN_STEPS`` drafting steps on). The surplus every step has is not added to ``step``: a fixed cost per step
        spread over a forest's tokens would make drafting look cheaper, and as the table's own ``step`` of 0 the
        correction errs only towards drafting less."""
        base = self.bare if self.n_bare >= MIN_STEPS else 0.0
        extra = max(0.0, self.drafting - base) if self.n_drafting >= MIN_STEPS else 0.0
        return dataclasses.replace(table, draft_step=table.draft_step + extra) if extra else table
