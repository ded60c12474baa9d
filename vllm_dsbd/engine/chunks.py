"""How many plain requests one chunk of verification takes, so that its float32 working set stays under a budget of
elements (``sampler.verify``; the bound half of docs/design/memory.md §3.8, the account being ``memory.profile_step``):
:data:`VERIFY_BUDGET` on the CPU, a share of the free memory on a GPU (:func:`verify_budget`). Imports nothing of the
package: the sampler and the memory account both use it.
"""
from __future__ import annotations

import torch

# float32 elements one chunk of plain requests' verification may hold at once on the CPU (2 ** 27: 512 MiB)
VERIFY_BUDGET = 1 << 27
# float32 blocks of W * V elements one request holds in verification (``sampler.verify``): the target rows (G + 1), the
# concatenated draft joints (G) and the layers' temporaries (joint, exponentials, residual, masks, top-p's sort), at
# most LAYER_BLOCKS; measured on the CPU (torch's allocator records) at G = 1..3, W = 1..4, a chunk of one request on
# the static path at most 24 blocks besides the 2G + 1, the row-subset path 18 (tests/unit/test_memory.py checks)
LAYER_BLOCKS = 26


# VERIFY_BUDGET on a device: this share of its free memory after the weights (before the KV cache), within
# [MIN_VERIFY_BUDGET, MAX_VERIFY_BUDGET] elements (an 80 GB GPU with 60 GB free: 2 ** 28.2, capped at 2 ** 28)
FREE_FRACTION = 0.02
MIN_VERIFY_BUDGET = 1 << 24
MAX_VERIFY_BUDGET = 1 << 28


def verify_budget(device) -> int:
    """The float32 elements one chunk of verification may hold on ``device``: :data:`VERIFY_BUDGET` on the CPU; on a
    GPU :data:`FREE_FRACTION` of its free memory now, within [:data:`MIN_VERIFY_BUDGET`, :data:`MAX_VERIFY_BUDGET`]
    (the runner's ``profile_run`` asks once, after the weights are loaded)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return VERIFY_BUDGET
    free, _ = torch.cuda.mem_get_info(dev)
    return int(min(MAX_VERIFY_BUDGET, max(MIN_VERIFY_BUDGET, free * FREE_FRACTION // 4)))


def verify_blocks(depth: int, penalties: bool = False) -> int:
    """The W * V float32 blocks one request holds in verification at depth G (see :data:`LAYER_BLOCKS`); with
    ``penalties`` the chunk's penalized copy of its logits rows too (at most 1 + G * W rows: G + 1 blocks; the sparse
    counts are bounded apart, ``penalties.PENALTY_BUDGET``)."""
    G = max(depth, 1)
    return (G + 1) + G + LAYER_BLOCKS + ((G + 1) if penalties else 0)


def verify_chunk(depth: int, width: int, vocab: int, budget: int | None = None, penalties: bool = False) -> int:
    """The most plain requests one verification chunk takes (>= 1): ``budget`` (default :data:`VERIFY_BUDGET`)
    float32 elements over each request's ``verify_blocks(depth, penalties) * width * vocab``."""
    budget = VERIFY_BUDGET if budget is None else budget
    return max(1, budget // (verify_blocks(depth, penalties) * max(width, 1) * max(vocab, 1)))
