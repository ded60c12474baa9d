"""Patch ``scheduler_queue`` on the real vLLM 0.26.0: a DSBD engine's scheduler output carries the requests left
waiting (``dsbd_waiting``), and the cost model keeps its floor per request (``cost.request_floors``: no request slowed
by the others' forests, the one with the most tokens left, read here from vLLM's own request state, at
``cost.LAST_FLOOR``) and the batch's end (``batch_end``, from the same tokens left) exactly on the steps where none
waits; a plain engine's output carries nothing.

Tiny random Llama target, no draft model (the default sources), a pinned cost table (the model chooses every decode
step), ``max_num_seqs`` 2 and 5 requests: the first steps leave 3 waiting, the last ones none. Checked against vLLM's
own queue: each step's value equals ``len(waiting) + len(skipped_waiting)`` read from the scheduler after it ran.
"""
from __future__ import annotations

from engine_utils import dsbd_llm, runner_of, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.engine import cost  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102], [7, 8, 9, 10], [200, 201]]
MAX_TOKENS = [6, 24, 6, 6, 24]
TABLE = {"target_ms": {"1": 10, "256": 10}, "draft_ms": {"1": 1, "256": 1}}


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _left(runner) -> list[int]:
    """Each batch row's tokens left, read from vLLM's own request state: ``max_tokens`` less its output."""
    return [runner.requests[r].sampling_params.max_tokens - len(runner.requests[r].output_token_ids)
            for r in runner.input_batch.req_ids]


def _run(llm, monkeypatch, record_floor: bool):
    """Generates PROMPTS; (every step's (dsbd_waiting or None, vLLM's queue after scheduling), every cost-model call's
    (floor, the runner's waiting, the batch's tokens left))."""
    sched, steps, calls = _scheduler(llm), [], []
    cls = type(sched)
    orig = cls._update_after_schedule

    def update(self, out):
        orig(self, out)
        steps.append((getattr(out, "dsbd_waiting", None), len(self.waiting) + len(self.skipped_waiting)))

    monkeypatch.setattr(cls, "_update_after_schedule", update)
    if record_floor:
        choose, runner = cost.choose_shapes, runner_of(llm)

        def traced(cands, table, floor=None, left=None):
            calls.append((floor, runner._dsbd_waiting, _left(runner), left))
            return choose(cands, table, floor, left)

        monkeypatch.setattr(cost, "choose_shapes", traced)
    params = [vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    monkeypatch.undo()
    return steps, calls


def test_the_floor_holds_while_no_request_waits(monkeypatch):
    target, _ = tiny_pair()
    with dsbd_llm(target, max_num_seqs=2, speculative_config={"method": "dsbd", "cost_model": TABLE}) as llm:
        steps, calls = _run(llm, monkeypatch, True)
    print("steps (dsbd_waiting, vLLM's queue):", steps, "cost model calls (floor, waiting):", calls)
    assert all(got == queue for got, queue in steps), steps  # vLLM's own queue, every step
    assert steps[0][0] == len(PROMPTS) - 2 and steps[-1][0] == 0
    assert {w > 0 for _, w, _, _ in calls} == {True, False}, calls  # the model chose both under a queue and without one
    mixed = 0
    for floor, waiting, left, given in calls:
        if waiting:
            assert floor is None and given is None, calls
            continue
        # the request with the most tokens left keeps LAST_FLOOR of its pace, one with much less FLOOR; the batch's
        # end is priced from the same tokens left
        assert len(floor) == len(left) and floor == cost.request_floors(left) and given == left, (floor, left, given)
        mixed += min(floor) == cost.FLOOR and max(floor) == cost.LAST_FLOOR
    assert mixed > 0, calls  # a step without a queue held a request with much less left beside one with more


def test_a_plain_engine_carries_no_queue(monkeypatch):
    target, _ = tiny_pair()
    with dsbd_llm(target, max_num_seqs=2) as llm:
        steps, _ = _run(llm, monkeypatch, False)
    assert steps and all(got is None for got, _ in steps), steps
