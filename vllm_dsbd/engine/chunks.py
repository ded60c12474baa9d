"""How many plain requests one chunk of verification takes, so that its float32 working set stays under
:data:`VERIFY_BUDGET` elements (``sampler.verify``; the bound half of docs/design/memory.md §3.8, the account being
``memory.profile_step``). Imports nothing of the package: the sampler and the memory account both use it.
"""
from __future__ import annotations

# float32 elements one chunk of plain requests' verification may hold at once (2 ** 27: 512 MiB)
VERIFY_BUDGET = 1 << 27
# float32 blocks of W * V elements one request holds in verification (``sampler.verify``): the target rows (G + 1), the
# concatenated draft joints (G) and the layers' temporaries (joint, exponentials, residual, masks, top-p's sort), at
# most LAYER_BLOCKS; measured on the CPU (torch's allocator records) at G = 1..3, W = 1..4, a chunk of one request on
# the static path at most 24 blocks besides the 2G + 1, the row-subset path 18 (tests/unit/test_memory.py checks)
LAYER_BLOCKS = 26


def verify_blocks(depth: int) -> int:
    """The W * V float32 blocks one request holds in verification at depth G (see :data:`LAYER_BLOCKS`)."""
    G = max(depth, 1)
    return (G + 1) + G + LAYER_BLOCKS


def verify_chunk(depth: int, width: int, vocab: int, budget: int | None = None) -> int:
    """The most plain requests one verification chunk takes (>= 1): ``budget`` (default :data:`VERIFY_BUDGET`)
    float32 elements over each request's ``verify_blocks(depth) * width * vocab``."""
    budget = VERIFY_BUDGET if budget is None else budget
    return max(1, budget // (verify_blocks(depth) * max(width, 1) * max(vocab, 1)))
