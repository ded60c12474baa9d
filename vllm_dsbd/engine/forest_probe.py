"""Start-up probe of what a step with forests costs beyond its passes: the cost table's ``draft_step`` and ``node``.

The start-up table (``load_probe.measure_costs``) times the target's and the draft's passes alone. A step with forests
also drafts them (the drafter's loops), recomputes forest attention in every layer, and verifies them (with the
recycle source's harvest beside it): a table without that work priced a forest at its target tokens alone, so each
batch size's first forests were drafted at a loss until the step clock had measured them
(results/first-call-2026-12-06). This probe runs that work once at start-up, after vLLM's warm-up, on dummy greedy
plain requests with full-width, full-depth forests from the engine's own drafter (a draft model's loops on random
draft logits: its passes are in the table; or the draft-free sources' widest forests), at ``REQUESTS`` batch sizes at
a context of ``CONTEXT`` tokens: drafting, one layer's forest recompute times the layers, verification (and the
harvest). Each part's least of ``load_probe.REPEATS`` timed runs after one warm-up run (which also pays one-time
costs such as a kernel's compilation); ``node`` is the slope per forest node between the two sizes, ``draft_step``
what is left at the first. Greedy requests are the cheapest to verify and forest attention grows with the context
(results/forest-probe-2026-12-06): the probe prices forests low rather than high, for a table that overprices forests
declines them and so never measures them, where one that underprices them drafts a few and measures them. The step
clock (``step_clock.py``) replaces both by what the steps themselves measure once it has measured forests, upwards or
downwards; the table only prices the forests before that. On one rank only (the clock's condition too). Reuses the
profiling run's dummy step (``memory.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from . import cost
from .load_probe import REPEATS, _sync

logger = logging.getLogger("vllm.vllm_dsbd.engine")

REQUESTS = (1, 8)  # the batch sizes probed (each at most max_num_seqs)
CONTEXT = 256  # each dummy request's context tokens, a short prompt and answer (at most max_model_len less its forest)


def _states(num: int, width: int, vocab: int, cfg):
    """``num`` greedy plain requests (no top-k or top-p, no penalties or rules: the cheapest verification), each with
    the widest draft-free sources where the engine has them (``memory._full_sources``)."""
    from .memory import _full_sources
    from .state import RequestState

    out = [RequestState(req_id=f"dsbd-probe-{i}", seed=i, width=width, temperature=0.0, top_k=0, top_p=1.0, eos=-1,
                        max_tokens=None) for i in range(num)]
    if cfg.free_sources:
        for st in out:
            st.sources = _full_sources(cfg, vocab)
    return out


def _attention(runner, pending: list, gen: torch.Generator):
    """A callable running every attention layer's forest recompute over ``pending`` at ``CONTEXT`` tokens, on a dummy
    cache holding every block it reads (``memory.forest_attention_run``), or None where no layer recomputes."""
    from .memory import forest_attention_run

    nodes = sum(1 + len(pf.tokens) for pf in pending if pf is not None)
    blocks = -(-(CONTEXT + nodes) // runner.cache_config.block_size)
    return forest_attention_run(runner, pending, gen, CONTEXT, blocks, blocks, True)


def _step(runner, reqs: int, vocab: int, gen: torch.Generator) -> tuple[tuple[float, float, float], int]:
    """((drafting, forest attention, verification) seconds, forest nodes) of one step's forest work at ``reqs``
    requests: each part's least of ``REPEATS`` timed runs after a warm-up run."""
    from .memory import _forests, verify_dummy, verify_plan

    cfg, dev = runner.dsbd_cfg, runner.device
    best, nodes = [float("inf")] * 3, 0

    def now():
        _sync(dev)
        return time.perf_counter()

    for k in range(REPEATS + 1):
        states = _states(reqs, cfg.width, vocab, cfg)
        t0 = now()
        pending = _forests(runner, states, vocab, gen)  # the drafter's loops (a draft model's passes: random logits)
        t1 = now()
        attend = _attention(runner, pending, gen)
        plan, first = verify_plan(states, pending, CONTEXT)
        nodes = first - reqs
        # the target's logits of every row: the table's (its LM head over every token), not timed
        logits = torch.randn(first, vocab, device=dev, generator=gen) * 4
        t2 = now()
        if attend is not None:
            attend()
        t3 = now()
        verify_dummy(runner, logits, plan, vocab)
        t4 = now()
        if k > 0:  # the first run pays one-time costs (allocations, a kernel's compilation)
            best = [min(b, t) for b, t in zip(best, (t1 - t0, t3 - t2, t4 - t3))]
    return tuple(best), nodes


@torch.inference_mode()
def measure_forest_work(runner) -> tuple[float, float] | None:
    """(a step's fixed seconds of forest work, seconds per forest node) of this runner's engine (module docstring), or
    None where it drafts no forest or runs on several ranks."""
    cfg = runner.dsbd_cfg
    if not cfg.drafting or runner.parallel_config.world_size != 1:
        return None
    dev = runner.device
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = runner.model_config.get_hidden_size()
    vocab = runner.model.compute_logits(torch.zeros(1, hidden, dtype=runner.dtype, device=dev)).shape[-1]
    sizes = sorted({min(r, runner.scheduler_config.max_num_seqs) for r in REQUESTS})
    start = time.perf_counter()
    points = [_step(runner, r, vocab, gen) for r in sizes]
    took = time.perf_counter() - start
    (p0, n0), (p1, n1) = points[0], points[-1]
    t0, t1 = sum(p0), sum(p1)
    per = max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
    fixed = max(0.0, t0 - per * n0)
    logger.info("DSBD cost model: a step's forest work measured at start-up (ms of drafting + forest attention in "
                "every layer + verification) %s; %.2f ms a step + %.3f ms a forest node (probe %.1f s)", ", ".join(
                    f"{r} requests {n} nodes " + " + ".join(f"{1e3 * t:.2f}" for t in p)
                    for r, (p, n) in zip(sizes, points)), 1e3 * fixed, 1e3 * per, took)
    return fixed, per


def with_forest_work(table: cost.CostTable, runner) -> cost.CostTable:
    """``table`` with the probe's ``draft_step`` and ``node`` (:func:`measure_forest_work`; unchanged where None)."""
    got = measure_forest_work(runner)
    return table if got is None else dataclasses.replace(table, draft_step=got[0], node=got[1])
