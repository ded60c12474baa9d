"""The peak of CPU memory allocated by torch while a function runs, from torch's own allocator records.

``torch.profiler.profile(profile_memory=True)`` makes torch's CPU allocator report every allocation and free made while
the profiler is on, each with its size and the running total of the bytes those allocations still hold
(``c10::ProfiledCPUMemoryReporter``: blocks allocated before the profiler started are not counted, nor their frees).
:func:`peak_bytes` returns the largest such total less the total before the function's first allocation: the most
bytes the function's own tensors held at once. It counts
every tensor torch allocates on the CPU in this process (the engine core runs in process in the engine tests), not
only DSBD's.
"""
from __future__ import annotations

import warnings

import torch
from torch.profiler import ProfilerActivity, profile


def _allocations(prof) -> list[tuple[int, int, int]]:
    """(start ns, size: + alloc / - free, running total) of every CPU allocation record, in time order."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        f = node.extra_fields
        if isinstance(f, torch._C._profiler._ExtraFields_Allocation) and f.device.type == "cpu":
            out.append((node.start_time_ns, f.alloc_size, f.total_allocated))
    out.sort(key=lambda e: e[0])
    return out


def peak_bytes(fn, *args, **kwargs):
    """(fn's result, the peak bytes of CPU memory torch allocated while it ran and still held at that moment)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn(*args, **kwargs)
    events = _allocations(prof)
    if not events:
        return out, 0
    # the reporter's running total (after each record) less what it held before the first record: the total counts
    # every block allocated under any profiler and still held (an earlier measurement's result, say); records with the
    # same start time can come out of the event tree in either order, so no re-summation of the sizes
    t0 = events[0][0]
    base = min(total - size for t, size, total in events if t == t0)
    return out, max(total for *_, total in events) - base
