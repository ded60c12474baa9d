"""The recycle source's prompt rows are priced (``cost.prompt_row_limit``, ``source_drafter.prompt_rows(limit=...)``):
a request takes at most as many prompt rows as cost ``cost.PROMPT_SHARE`` of its remaining tokens' time without
forests, so that whatever the rows give back, they slow it by at most that share.

Checked on the CPU's start-up table of the README job (SmolLM2-135M: a row is the LM head's 21% of a marginal target
token) and on flat and nearly flat hypothetical tables (a GPU's shape, not measured here): the limit is the largest
row count within the share (one more row is over it), its requests' rows are the prompt's last ones, and where the
table's marginal token is free there is no limit.
Planted: the rows before the limit (every prompt row) spend several times the share at 8 requests on the CPU table.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import cost, source_drafter
from vllm_dsbd.engine.cost import PROMPT_SHARE, CostTable, prompt_row_limit

CPU = CostTable(target=((1, 0.02821), (8, 0.03241), (16, 0.04077), (32, 0.06127), (64, 0.10417), (128, 0.18740),
                        (256, 0.36934)), draft=((1, 0.0),), step=0.008)
GPU = CostTable(target=((1, 0.0064), (32, 0.0064), (256, 0.0064)), draft=((1, 0.0),))
HEAD = 49152 * 576 / 134_515_008  # SmolLM2-135M: its (tied) LM head's share of the parameters


def _row(table, share):
    (n0, t0), (n1, t1) = table.target[-2:]
    return share * (t1 - t0) / (n1 - n0)


def _budget(table, reqs, remaining):
    return PROMPT_SHARE * remaining * (table.step + table.target_time(reqs)) / reqs


@pytest.mark.parametrize("reqs,remaining", [(1, 32), (1, 48), (4, 32), (8, 48), (8, 256), (64, 16), (3, 0)])
def test_the_limit_is_the_most_rows_within_the_share(reqs, remaining):
    n = prompt_row_limit(CPU, reqs, remaining, HEAD)
    row, budget = _row(CPU, HEAD), _budget(CPU, reqs, remaining)
    assert n * row <= budget * (1 + 1e-12) < (n + 1) * row, (n, row, budget)


def test_readme_job_numbers_and_the_planted_unpriced_rows():
    one, eight = prompt_row_limit(CPU, 1, 48, HEAD), prompt_row_limit(CPU, 8, 48, HEAD)
    print(f"rows at 1 request: {one}, at 8: {eight}")
    assert eight < one <= 300  # a batch's share of each step is smaller
    # planted: the README job's code prompts (161-301 tokens) recycled whole spend 3x-6x the share at 8 requests
    for prompt in (161, 205, 252, 301):
        assert (prompt - 1) * _row(CPU, HEAD) > 3 * _budget(CPU, 8, 48)
        assert min(prompt - 1, eight) * _row(CPU, HEAD) <= _budget(CPU, 8, 48)


def test_a_free_marginal_token_sets_no_limit():
    assert prompt_row_limit(GPU, 32, 256, 0.06) is None
    flat = CostTable(target=((1, 0.0064), (256, 0.0065)), draft=((1, 0.0),))
    assert prompt_row_limit(flat, 32, 256, 0.06) > source_drafter.PROMPT_ROWS  # a nearly flat (hypothetical) table


def test_prompt_rows_takes_the_prompts_last_rows_within_the_limit():
    P, c = 40, 0  # one request prefilling its whole prompt of 40 tokens in this pass
    batch = SimpleNamespace(token_ids_cpu=np.arange(100, 164, dtype=np.int64)[None, :], num_prompt_tokens=[P])
    state = SimpleNamespace(sources=None, beam=None, max_tokens=8)
    plan = [SimpleNamespace(state=state)]
    cfg = DSBDConfig()
    whole = source_drafter.prompt_rows(plan, batch, [0], [c], [P], cfg)
    assert [r for _, r, _ in whole] == list(range(P - 1))  # every row but the last (the root's)
    for n in (0, 5, 39, 100):
        got = source_drafter.prompt_rows(plan, batch, [0], [c], [P], cfg, limit=lambda st, p, n=n: n)
        assert [r for _, r, _ in got] == list(range(P - 1))[max(0, P - 1 - n):], n
        assert all(t == [100 + r - 1, 100 + r] if r else t == [100] for _, r, t in got)
    assert source_drafter.prompt_rows(plan, batch, [0], [c], [P], cfg, limit=lambda st, p: None) == whole
    assert cost.prompt_row_limit is prompt_row_limit
