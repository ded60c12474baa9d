"""Language models given as explicit probability tables: every law they induce is computable. For tests and
benchmarks (a draft/target pair whose agreement is set by a mixing weight)."""
from __future__ import annotations

import torch


class NGramLM:
    """next-token logits = log table[last (order - 1) tokens]. table: [V] * (order - 1) + [V] probabilities."""

    def __init__(self, table: torch.Tensor, jitter: float = 0.0):
        self.table = table.double()
        self.jitter = jitter  # > 0: add a tiny deterministic function of the whole sequence (breaks exact score ties)
        self.order = table.dim()
        self.vocab = table.shape[-1]
        self.calls = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if ids.shape[1] < self.order - 1:
            raise ValueError(f"an order-{self.order} table needs sequences of >= {self.order - 1} tokens")
        if self.order == 1:
            return torch.log(self.table).float().expand(ids.shape[0], -1)
        ctx = ids[:, ids.shape[1] - (self.order - 1):]
        logits = torch.log(self.table[tuple(ctx.T)])
        if self.jitter:
            weights = torch.tensor([(7919 ** t) % 1_000_003 for t in range(ids.shape[1])], dtype=torch.float64)
            h = (ids.double() + 1) @ weights  # [B]
            v = torch.arange(self.vocab, dtype=torch.float64)
            logits = logits + self.jitter * torch.frac(torch.sin(h[:, None] * 12.9898 + v * 78.233) * 43758.5453)
        return logits.float()

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
