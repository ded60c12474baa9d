"""Start-up probes of the target's (and the draft's) pass time by token count, run once by the worker after vLLM's
warm-up: the knee of ``verify_budget="auto"`` (``load.py``: the target through vLLM's ``_dummy_run``, the drafter's
dummy pass off) and the cost model's table (``cost.py``: target and draft models called directly under a dummy
forward context, each with its LM head over every token); per size one warm-up pass, then the
least of ``REPEATS`` timed passes (noise only adds time); the cost table's sizes are timed in ``COST_ROUNDS`` rounds
and made non-decreasing. With tensor parallelism rank 0 decides when to stop and its
table is every rank's (the passes are collective). Details: docs/design/cost-model.md §3.6.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from . import cost, load

logger = logging.getLogger("vllm.vllm_dsbd.engine")

REPEATS = 3
STOP_RATIO = 2 * load.KNEE_RATIO
COST_STOP_RATIO = 8.0  # the cost table's sizes go on until a pass takes this many times a one-token pass
COST_MAX_TOKENS = 1024  # ... or this many tokens (the table's last slope goes on past its end)
COST_ROUNDS = 3  # the cost table's sizes are timed in turn this many times (each keeps its least time)


def _tp_group():
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _times(run: Callable[[int], None], device, sizes: list[int], stop_ratio: float,
           rounds: int = 1) -> dict[int, float]:
    """{tokens: seconds} of ``run(n)``, rank 0's on every rank, until a size takes over ``stop_ratio`` x the first.
    ``rounds`` > 1: after the first round (which finds the sizes) the sizes are timed again in turn, so that a burst of
    load on shared cores slows one round of every size rather than every timing of one size; each size keeps its least
    time."""
    group = _tp_group()
    times: dict[int, float] = {}

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(REPEATS):
            _sync(device)
            t0 = time.perf_counter()
            run(n)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    with torch.inference_mode():
        for n in sizes:
            run(n)
            times[n] = timed(n)
            stop = times[n] > stop_ratio * times[sizes[0]]
            if group is not None:
                stop = group.broadcast_object(stop, src=0)
            if stop:
                break
        for _ in range(rounds - 1):
            for n in list(times):
                times[n] = min(times[n], timed(n))
    if group is not None:
        times = group.broadcast_object(times, src=0)
    return times


def monotone(times: dict[int, float]) -> dict[int, float]:
    """The least non-decreasing table under ``times`` (a pass over more tokens never costs less; a size timed slower
    than a larger one was slowed by noise): each size takes the least time of itself and every larger size."""
    out, low = {}, float("inf")
    for n in sorted(times, reverse=True):
        low = min(low, times[n])
        out[n] = low
    return dict(sorted(out.items()))


def forward_times(runner, sizes: list[int], stop_ratio: float = STOP_RATIO, rounds: int = 1) -> dict[int, float]:
    """{tokens: seconds} of the target's forward pass through vLLM's ``runner._dummy_run`` (the knee's table), rank
    0's on every rank."""
    drafter = runner.drafter
    drafter.dummy_run = lambda *args, **kwargs: None  # the target alone (an attribute of our drafter, removed below)
    try:
        return _times(lambda n: runner._dummy_run(n, skip_eplb=True), runner.device, sizes, stop_ratio, rounds)
    finally:
        del drafter.dummy_run


def model_times(model, vllm_config, device, sizes: list[int], stop_ratio: float = COST_STOP_RATIO,
                rounds: int = 1, head_hidden: int | None = None) -> dict[int, float]:
    """{tokens: seconds} of one pass of ``model`` (the target or the draft) over n tokens with its LM head over every
    token, called directly under a dummy forward context (no attention metadata, as vLLM's dummy passes: short
    contexts; without ``_dummy_run``'s own per-call work, which on a CPU made SmolLM2's one-token pass 68 ms where a
    whole engine step takes about 11), rank 0's on every rank. ``head_hidden``: the model is an EAGLE-3 head, whose
    rows take a hidden state of that size; a target returning auxiliary hidden states returns a tuple."""
    from vllm.forward_context import set_forward_context

    def run(n: int) -> None:
        ids = torch.zeros(n, dtype=torch.int32, device=device)
        pos = torch.zeros(n, dtype=torch.int64, device=device)
        kw = ({"inputs_embeds": None} if head_hidden is None else
              {"hidden_states": torch.zeros(n, head_hidden, dtype=vllm_config.model_config.dtype, device=device)})
        with set_forward_context(None, vllm_config, num_tokens=n):
            hidden = model(input_ids=ids, positions=pos, **kw)
        model.compute_logits(hidden[0] if isinstance(hidden, tuple) else hidden)

    return _times(run, device, sizes, stop_ratio, rounds)


def measure_budget(runner) -> tuple[int, dict[int, float]]:
    """(the ``"auto"`` budget, the measured table) of this runner's engine."""
    times = forward_times(runner, load.probe_sizes(int(runner.max_num_tokens)))
    knee = load.knee(times)
    budget = load.auto_budget(knee, runner.dsbd_cfg.forest_slots + 1)
    table = ", ".join(f"{n}: {1e3 * t:.2f}" for n, t in sorted(times.items()))
    logger.info("DSBD load-aware speculation: target forward ms by tokens {%s}; knee %d tokens (time <= %.2f x one "
                "token's), verify budget %d tokens per step", table, knee, load.KNEE_RATIO, budget)
    return budget, times


def measure_costs(runner) -> cost.CostTable:
    """The cost model's table of this runner's engine: target and draft pass times (with LM heads) by tokens, each
    the least of ``COST_ROUNDS`` rounds and made non-decreasing (:func:`monotone`). Draft-free sources have no draft
    pass: their draft table is 0 (their host work is what the online correction measures, ``step_clock.py``)."""
    sizes = load.probe_sizes(min(int(runner.max_num_tokens), COST_MAX_TOKENS))
    drafter = runner.drafter
    target = monotone(model_times(runner.model, runner.vllm_config, runner.device, sizes, rounds=COST_ROUNDS))
    if drafter.model is None:
        return cost.CostTable.from_times(target, {n: 0.0 for n in target})
    return cost.CostTable.from_times(
        target, monotone(model_times(drafter.model, drafter.vllm_config, drafter.device, sizes, rounds=COST_ROUNDS,
                                     head_hidden=drafter.head_hidden() if getattr(drafter, "head", False) else None)))
