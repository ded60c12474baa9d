"""Language models given as explicit probability tables: every law they induce is computable. For tests and
benchmarks (a draft/target pair whose agreement is set by a mixing weight)."""
from __future__ import annotations

import torch


class NGramLM:
    """next-token logits = log table[last (order - 1) tokens]. table: [V] * (order - 1) + [V] probabilities."""

    def __init__(self, table: torch.Tensor):
        self.table = table.double()
        self.order = table.dim()
        self.vocab = table.shape[-1]
        self.calls = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        ctx = ids[:, -(self.order - 1):] if self.order > 1 else ids[:, :0]
        t = self.table
        for i in range(ctx.shape[1]):
            t = t[ctx[:, i]] if i == 0 else t[torch.arange(ids.shape[0]), ctx[:, i]]
        return torch.log(t).float() if self.order > 1 else torch.log(t).float().expand(ids.shape[0], -1)

    def probs(self, context: list[int]) -> torch.Tensor:
        t = self.table
        for x in context[-(self.order - 1):] if self.order > 1 else []:
            t = t[x]
        return t


def random_table(vocab: int, order: int = 2, *, concentration: float = 1.0, zeros: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Dirichlet-like random conditional tables [V]*order; ``zeros`` is the fraction of entries forced to 0
    (at least one entry per row stays positive)."""
    shape = [vocab] * order
    x = torch._standard_gamma(torch.full(shape, concentration, dtype=torch.float64), generator=generator) + 1e-12
    if zeros > 0:
        keep = torch.rand(shape, generator=generator, dtype=torch.float64) >= zeros
        keep[..., 0] |= ~keep.any(-1)
        x = x * keep
    return x / x.sum(-1, keepdim=True)


def draft_of(target: torch.Tensor, mix: float, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """A draft table agreeing with ``target`` by ``mix`` in [0, 1]: mix * target + (1 - mix) * random."""
    other = random_table(target.shape[-1], target.dim(), generator=generator)
    return mix * target + (1 - mix) * other
