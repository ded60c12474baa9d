"""What an engine step dispatches outside the target's forward pass: aten operations (each one a kernel launch on a
GPU) and host reads of tensor values (each one a wait for the device there): the CPU proxy of a step's device
overhead (issue "On vLLM's fast path"; ``tests/engine/test_engine_bare_step.py``, ``benchmarks/engine/step_ops.py``).

:func:`count_steps` wraps a running in-process engine core's ``step_fn`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): each
call runs under a ``TorchDispatchMode`` that counts operations, with the reading ``Tensor`` methods wrapped
(``item``, ``tolist``, ``cpu``, ``numpy``, ``bool(t)``, ``nonzero``), and the model runner's ``_model_forward``
(vLLM's and DSBD's target pass alike) run with both switched off. Every step's counts are kept with what it
scheduled, so callers compare like with like (decode steps with nothing drafted, say).
"""
from __future__ import annotations

import collections
import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")


@dataclass
class Step:
    ops: int  # aten operations dispatched outside the target's forward
    reads: int  # host reads (READS)
    reqs: int  # requests scheduled
    tokens: int  # tokens scheduled (requests + their draft tokens)
    prefill: bool  # a new request or a prompt chunk in the step
    drafts: int  # draft tokens scheduled
    proposed: int  # draft tokens proposed for the next step (the runner's ``propose_draft_token_ids``)
    op_names: collections.Counter = field(default_factory=collections.Counter)
    read_names: collections.Counter = field(default_factory=collections.Counter)
    read_sites: collections.Counter = field(default_factory=collections.Counter)  # "file:line" (``sites=True``)

    @property
    def bare(self) -> bool:
        """A decode step that drafts nothing: every request decodes one token, nothing drafted was scheduled and
        nothing is proposed for the next step."""
        return not self.prefill and self.drafts == 0 and self.tokens == self.reqs and self.proposed == 0


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()
        self.sites: collections.Counter | None = None
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    """The innermost caller outside torch and this module, as "path:line" (path from the package or site root)."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or "/torch/" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    for root in ("/vllm_dsbd/", "/vllm/"):
        if root in name:
            name = root.strip("/") + "/" + name.split(root, 1)[1]
            break
    return f"{name}:{f.f_lineno}"


@contextlib.contextmanager
def _reads_counted(counter: _Counter):
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(self, *a, **k):
            if not counter.paused:
                counter.reads[name] += 1
                if counter.sites is not None:
                    counter.sites[_site()] += 1
            return fn(self, *a, **k)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def count_steps(llm, sites: bool = False):
    """Counts every engine step of ``llm`` (an in-process ``vllm.LLM``) while the block runs; yields the list of
    :class:`Step` it fills. ``sites``: also where each read was made (``Step.read_sites``)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    steps: list[Step] = []
    counter: list[_Counter] = []
    step_fn, schedule_fn, forward_fn = core.step_fn, core.scheduler.schedule, runner._model_forward
    propose_fn = runner.propose_draft_token_ids
    seen: list = []
    proposed: list[int] = []

    def propose(*a, **k):
        out = propose_fn(*a, **k)
        proposed.append(sum(len(x) for x in out) if isinstance(out, list) else -1)
        return out

    def schedule(*a, **k):
        out = schedule_fn(*a, **k)
        seen.append(out)
        return out

    def forward(*a, **k):
        c = counter[-1] if counter else None
        if c is None:
            return forward_fn(*a, **k)
        c.paused += 1
        try:
            with _disable_current_modes():
                return forward_fn(*a, **k)
        finally:
            c.paused -= 1

    def step(*a, **k):
        c = _Counter()
        if sites:
            c.sites = collections.Counter()
        counter.append(c)
        seen.clear()
        proposed.clear()
        try:
            with _reads_counted(c), c:
                return step_fn(*a, **k)
        finally:
            counter.pop()
            if seen and seen[-1].total_num_scheduled_tokens > 0:
                so = seen[-1]
                reqs = len(so.num_scheduled_tokens)
                drafts = sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
                # a prompt chunk: more tokens than the request's own plus its drafts
                chunk = any(n > 1 + len(so.scheduled_spec_decode_tokens.get(r, ())) for r, n in
                            so.num_scheduled_tokens.items())
                steps.append(Step(ops=sum(c.ops.values()), reads=sum(c.reads.values()), reqs=reqs,
                                  tokens=so.total_num_scheduled_tokens, drafts=drafts, proposed=sum(proposed),
                                  prefill=bool(so.scheduled_new_reqs) or chunk, op_names=c.ops, read_names=c.reads,
                                  read_sites=c.sites or collections.Counter()))

    core.step_fn, core.scheduler.schedule, runner._model_forward = step, schedule, forward
    runner.propose_draft_token_ids = propose
    try:
        yield steps
    finally:
        core.step_fn, core.scheduler.schedule, runner._model_forward = step_fn, schedule_fn, forward_fn
        del runner.propose_draft_token_ids
