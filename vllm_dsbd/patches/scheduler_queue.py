"""Patch: a DSBD worker learns, with each step's scheduler output, how many requests still wait to be scheduled.

The cost model keeps every request at its floor of its pace without forests (``cost.request_floors``: no request is
slowed by the others' forests) only while no request waits: then the batch's time is its slowest request's (an
offline batch's end, a server's latency), while under a queue a slot freed early is refilled at once and the batch's
tokens per second is what counts (``shapes._choose_depths``). vLLM's ``SchedulerOutput`` has no field for the queue,
and the worker sees only that output.

How: wrap ``Scheduler._update_after_schedule`` (the last call of ``schedule``, scheduler.py:1190); on a DSBD engine
set ``scheduler_output.dsbd_waiting = len(waiting) + len(skipped_waiting)`` after the original (an attribute of the
dataclass instance: it travels with the output, in process or pickled to worker processes). Other engines: the
original, untouched.

When it can go: vLLM's scheduler output carries its queue length (or a speculative method may read the scheduler).
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "scheduler_queue"
MODULE = "vllm.v1.core.sched.scheduler"
ATTR = "dsbd_waiting"  # SchedulerOutput attribute read by the DSBD runner (engine/runner.py, execute_model)


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def _update_after_schedule(self, scheduler_output):
            orig(self, scheduler_output)
            if uses_dsbd(self.vllm_config):
                setattr(scheduler_output, ATTR, len(self.waiting) + len(self.skipped_waiting))

        return _update_after_schedule

    wrap_method(PATCH_ID, mod.Scheduler, "_update_after_schedule", make)
