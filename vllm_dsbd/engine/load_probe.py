"""The start-up probe of ``verify_budget="auto"`` (``load.py``): the target's forward time at 1, 2, 4, ... tokens.

Run once by the worker after vLLM's warm-up, through vLLM's ``_dummy_run`` with the drafter's dummy pass off; per size
the least of ``REPEATS`` timed passes. With tensor parallelism rank 0 decides when to stop and its table is every rank's
(the passes are collective). Details: docs/design.md §3.6.
"""
from __future__ import annotations

import logging
import time

import torch

from . import load

logger = logging.getLogger("vllm.vllm_dsbd.engine")

REPEATS = 3
STOP_RATIO = 2 * load.KNEE_RATIO


def _tp_group():
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def forward_times(runner, sizes: list[int]) -> dict[int, float]:
    """{tokens: seconds} of the target's forward pass (``runner._dummy_run``), rank 0's on every rank."""
    group = _tp_group()
    drafter = runner.drafter
    drafter.dummy_run = lambda *args, **kwargs: None  # the target alone (an attribute of our drafter, removed below)
    times: dict[int, float] = {}
    try:
        with torch.inference_mode():
            for n in sizes:
                runner._dummy_run(n, skip_eplb=True)
                best = float("inf")
                for _ in range(REPEATS):
                    _sync(runner.device)
                    t0 = time.perf_counter()
                    runner._dummy_run(n, skip_eplb=True)
                    _sync(runner.device)
                    best = min(best, time.perf_counter() - t0)
                times[n] = best
                stop = best > STOP_RATIO * times[sizes[0]]
                if group is not None:
                    stop = group.broadcast_object(stop, src=0)
                if stop:
                    break
    finally:
        del drafter.dummy_run
    if group is not None:
        times = group.broadcast_object(times, src=0)
    return times


def measure_budget(runner) -> tuple[int, dict[int, float]]:
    """(the ``"auto"`` budget, the measured table) of this runner's engine."""
    times = forward_times(runner, load.probe_sizes(int(runner.max_num_tokens)))
    knee = load.knee(times)
    budget = load.auto_budget(knee, runner.dsbd_cfg.num_speculative_slots + 1)
    table = ", ".join(f"{n}: {1e3 * t:.2f}" for n, t in sorted(times.items()))
    logger.info("DSBD load-aware speculation: target forward ms by tokens {%s}; knee %d tokens (time <= %.2f x one "
                "token's), verify budget %d tokens per step", table, knee, load.KNEE_RATIO, budget)
    return budget, times
