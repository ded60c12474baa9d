"""Dynamic width: the paper's acceptance-count model, computed from the layer's P_d and Q_d only.

Model (Qin et al., ``get_num_acc_prob``): m drafts, each drawn from q~ (Q_d restricted to the valid parents, not
renormalised), are checked in turn; the target starts at R_1 = P_d, becomes the residual norm(max(R_i - q~, 0)) after a
rejection and resets to P_d after an acceptance. With alpha_i = sum min(R_i, q~) (acceptance chance of the i-th draft
after i-1 straight rejections) and beta_i = prod_{j<i}(1 - alpha_j) alpha_i (first acceptance at draft i):
    Pr[N_i = 0] = prod_{j<=i} (1 - alpha_j),     Pr[N_i = k] = sum_{j<=i} beta_j Pr[N_{i-j} = k-1].
Width K_d = the largest k with Pr[N_m >= k] >= tau, clamped to [min_width, W] and to the support of P_d.
(The authors' code subtracts q~ twice per step in this model; we subtract once, as their verification loop does.)
The choice never looks at the layer's coin flips, which is what keeps each layer exact given its width.
"""
from __future__ import annotations

import torch


def acceptance_count_law(p: torch.Tensor, q: torch.Tensor, m: int) -> torch.Tensor:
    """Pr[N_i = k] for i, k = 0..m under the model. p, q: [R, J] (q may have mass < 1).

    Returns [m + 1, R, m + 1] float64: entry [i, r, k] = Pr[N_i = k] for request r."""
    R = p.shape[0]
    p = p.double()
    q = q.double()
    alpha = torch.zeros(R, m, dtype=torch.float64, device=p.device)
    cur = p
    for i in range(m):
        alpha[:, i] = torch.minimum(cur, q).sum(-1)
        res = (cur - q).clamp(min=0)
        tot = res.sum(-1, keepdim=True)
        cur = torch.where(tot > 1e-12, res / tot.clamp(min=1e-300), cur)
    none_yet = torch.cumprod(1 - alpha, dim=1)  # [R, m]: no acceptance among the first i drafts
    beta = alpha * torch.cat([torch.ones(R, 1, dtype=alpha.dtype, device=p.device), none_yet[:, :-1]], dim=1)
    # law[i][k] = Pr[N_i = k]
    law = [torch.zeros(R, m + 1, dtype=torch.float64, device=p.device) for _ in range(m + 1)]
    law[0][:, 0] = 1.0
    for i in range(1, m + 1):
        law[i][:, 0] = none_yet[:, i - 1]
        for k in range(1, i + 1):
            acc = torch.zeros(R, dtype=torch.float64, device=p.device)
            for j in range(1, i + 1):
                acc = acc + beta[:, j - 1] * law[i - j][:, k - 1]
            law[i][:, k] = acc
    return torch.stack(law)


def choose_width(p: torch.Tensor, q: torch.Tensor, num_drafts: torch.Tensor, width: torch.Tensor,
                 min_width: torch.Tensor, tau: torch.Tensor, max_drafts: int | None = None) -> torch.Tensor:
    """K_d per request. p, q: [R, J] target joint and draft joint restricted to valid parents; num_drafts, width,
    min_width: [R] int64; tau: [R] float32; ``max_drafts``: max(num_drafts) when the caller knows it on the host (no
    read of the tensor). Returns [R] int64 in [min_width, width] (and <= support of p)."""
    if max_drafts is not None:
        m = max_drafts
    else:
        m = int(num_drafts.max()) if num_drafts.numel() else 0
    if m == 0:
        k = torch.zeros_like(width)
    else:
        laws = acceptance_count_law(p, q, m)  # [m + 1, R, m + 1]
        law = laws[num_drafts.clamp(max=m), torch.arange(p.shape[0], device=p.device)]  # [R, m + 1]: N_{num_drafts}
        at_least = torch.flip(torch.cumsum(torch.flip(law, [1]), 1), [1])  # [R, m + 1]: Pr[N >= k]
        ok = at_least >= tau.double()[:, None]
        ks = torch.arange(m + 1, device=p.device)
        k = torch.where(ok, ks[None, :], 0).max(dim=1).values
    support = (p > 0).sum(-1)
    k = torch.maximum(k, min_width)
    return torch.minimum(torch.minimum(k, width), support)
