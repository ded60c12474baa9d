"""The batch's end (``batch_end``, ``cost.choose_shapes(..., left=)``) in a real vLLM 0.26.0 engine: while no request
waits, the runner hands the cost model every request's tokens left, and the model's choice moves the batch's end
(the order statistic of the requests' gains) at ``LAST_FLOOR`` of the minimal step's pace on every step it prices;
on tied requests it declines forests that the floors alone would take.

Tiny random Llama target, the default draft-free sources, width 2, depth 3, a pinned cost table shaped as SmolLM2's on
this CPU (the target pass grows with its tokens: forests cost what they add; pinned so that the choices, and the calls
where the rule bites, are the same on every machine, where a measured table is the machine's), four requests with the
same ``max_tokens`` (tied: the end moves past one token only where all four pass). Every cost-model call is recorded
with what the floors alone choose on the same inputs. Checked: on every call with the end in force, the chosen shapes
keep the end (its tokens from ``End``, the step's time from the model's own ``_Step``); on at least one such call the
floors alone chose more forests (the rule bit) and their shapes fail that check (planted: the rule before 321bf40);
forests were drafted in the run (``dsbd_load``'s depths), so nothing passes vacuously; and the greedy tokens equal
plain vLLM's.
"""
from __future__ import annotations

from engine_utils import dsbd_llm, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.engine import cost  # noqa: E402
from vllm_dsbd.engine.batch_end import End  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [10, 20, 30, 10, 20, 30], [100, 101, 102, 100, 101], [7, 8, 9, 10, 7, 8, 9]]
MAX_TOKENS = 40
TABLE = {"target_ms": {"1": 27, "8": 33, "16": 40, "32": 60, "64": 102, "256": 356}, "draft_ms": {"1": 0, "256": 0}}


def _rate(c: cost.Candidate, width: int) -> float:
    return dict(((c.width, c.rate),) + c.options)[width]


def _keeps_end(cands, table, shapes, left) -> tuple[float, float]:
    """(the end's tokens per second under ``shapes``, ``LAST_FLOOR`` of the minimal step's: one token)."""
    end = End(left, [c.tried for c in cands])
    tokens = end.tokens([_rate(c, w) for c, (w, _) in zip(cands, shapes)], [d for _, d in shapes])
    minimal = cost._Step(cands, [(c.width, 0) for c in cands], table).seconds()
    return tokens / cost._Step(cands, shapes, table).seconds(), cost.LAST_FLOOR / minimal


def test_the_end_holds_and_declines_forests_on_tied_requests(monkeypatch):
    target, _ = tiny_pair()
    params = vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with dsbd_llm(target, max_num_seqs=len(PROMPTS)) as llm:  # plain vLLM (no speculative config)
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    calls = []
    choose = cost.choose_shapes

    def traced(cands, table, floor=None, left=None):
        got = choose(cands, table, floor, left)
        calls.append((list(cands), table, left, got, choose(cands, table, floor) if left else None))
        return got

    monkeypatch.setattr(cost, "choose_shapes", traced)
    spec = {"method": "dsbd", "width": 2, "num_speculative_tokens": 3, "cost_model": TABLE}
    with dsbd_llm(target, max_num_seqs=len(PROMPTS), speculative_config=spec) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        depths = llm.collective_rpc("dsbd_load")[0]["depths"]
    monkeypatch.undo()
    assert got == want
    assert sum(c for d, c in depths.items() if d > 0) > 0, depths  # forests were drafted
    in_force = [(cands, table, left, shapes, alone) for cands, table, left, shapes, alone in calls
                if left and not any(c.pinned or c.probe for c in cands)]
    assert in_force, calls
    bit = broken = 0
    for cands, table, left, shapes, alone in in_force:
        pace, floor = _keeps_end(cands, table, shapes, left)
        assert pace >= floor * (1 - 1e-9), (cands, left, shapes)
        bit += sum(d > 0 for _, d in alone) > sum(d > 0 for _, d in shapes)
        pace, floor = _keeps_end(cands, table, alone, left)
        broken += pace < floor * (1 - 1e-9)
    print(f"{len(calls)} cost-model calls, {len(in_force)} with the end in force, {bit} where it declined forests, "
          f"{broken} where the floors alone break the end; depths {depths}")
    assert bit > 0, [(left, [(c.rate, c.tried, c.options) for c in cands], shapes, alone)
                     for cands, _, left, shapes, alone in in_force[:6]]
    assert broken > 0  # planted: the floors alone, on the same steps, fail the check above
