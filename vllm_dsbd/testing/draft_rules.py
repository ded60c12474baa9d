"""Draft-set rules for ONE verified layer that emits one token from N sibling drafts (a plain request's layer, K = 1;
docs/design/algorithm.md §1), each exact: the emitted token's law is the target's p, whatever q. Used by
``benchmarks/engine/draft_rules.py`` (which rule accepts most often) and ``tests/unit/test_draft_rules.py`` (each
rule's law, with planted wrong variants). Pure torch, float64, one position: p and q are [V] probability vectors.

Every rule is recursive rejection sampling (RRS) over its drafts in order, with the law each draft was drawn from:
  accept z_j with probability min(1, T(z_j) / Q_j(z_j)); on reject T <- norm(max(T - Q_j, 0)); T starts at p;
  no draft accepted: emit one draw from T. Exact for any Q_j that is the law z_j was drawn from given z_1..z_{j-1}.
Rules (``RULES``):
  iid          N draws from q with replacement, Q_j = q (multi-draft RRS, SpecTr / SpecInfer);
  wor          N draws without replacement, Q_j = q minus z_1..z_{j-1}, renormalised (the engine's rule today);
  greedy       q's top N - 1 tokens (point masses: accepted with probability T(z), on reject z's mass is removed)
               then one token drawn from q off that set, verified against the residual (Hu et al., ICLR'25);
  greedy_zfirst the same set, the sampled draft verified FIRST against p, then the point masses against the residual:
               acceptance p(S) + sum_{x not in S} min(p(x), q'(x)), the most any exact rule gets from this set;
  top          q's top N tokens, all point masses: acceptance p(top N).
Given the drafts the updates of T do not depend on the coins, so Pr[accept | drafts] = 1 - prod_j (1 - a_j) with
a_j = min(1, T_{j-1}(z_j) / Q_j(z_j)) (``rrs``'s third output): a Monte Carlo over drafts with that estimator has far
less variance than counting accepts. ``exact_acceptance`` gives the closed forms (all rules but ``wor``).
"""
from __future__ import annotations

import torch

RULES = ("iid", "wor", "greedy", "greedy_zfirst", "top")


def _top(q: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(q, k).indices if k > 0 else torch.zeros(0, dtype=torch.int64)


def _off(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """q [D, V] with the tokens idx [D, k] removed, renormalised."""
    r = q.scatter(1, idx, 0.0) if idx.shape[1] else q.clone()
    return r / r.sum(1, keepdim=True)


def draw(rule: str, q: torch.Tensor, n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """d draft sets of n tokens each, [d, n] int64, in verification order."""
    V = q.shape[0]
    if rule == "iid":
        return torch.multinomial(q.expand(d, V), n, replacement=True, generator=gen)
    if rule == "wor":  # Gumbel-top-n: the n sequential draws without replacement, in draw order
        g = -torch.log(-torch.log(torch.rand(d, V, dtype=torch.float64, generator=gen)))
        return torch.topk(torch.log(q)[None, :] + g, n, dim=1).indices
    s = _top(q, n - 1 if rule != "top" else n)[None, :].expand(d, -1)
    if rule == "top":
        return s.clone()
    z = torch.multinomial(_off(q[None, :], s[:1]).expand(d, V), 1, generator=gen)
    return torch.cat([s, z], 1) if rule == "greedy" else torch.cat([z, s], 1)


def proposal(rule: str, q: torch.Tensor, drafts: torch.Tensor, j: int) -> torch.Tensor:
    """[D, V] the law draft j was drawn from, given drafts[:, :j] (rows of ``drafts`` from :func:`draw`)."""
    D, n = drafts.shape
    V = q.shape[0]
    qd = q[None, :].expand(D, V)
    point = {"greedy": j < n - 1, "greedy_zfirst": j > 0, "top": True}.get(rule, False)
    if point:
        return torch.zeros(D, V, dtype=q.dtype).scatter(1, drafts[:, j:j + 1], 1.0)
    if rule == "iid":
        return qd
    if rule == "wor":
        return _off(qd, drafts[:, :j])
    if rule == "greedy":
        return _off(qd, drafts[:, : n - 1])
    if rule == "greedy_zfirst":
        return _off(qd, drafts[:, 1:])
    raise ValueError(f"unknown rule {rule!r}")


def rrs(p: torch.Tensor, rule: str, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor | None = None,
        r: torch.Tensor | None = None, laws=None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling of D draft sets against p.

    Args: p [V], q [V]; drafts [D, n]; u [D, n] and r [D] uniforms (the acceptance coins and the residual draw;
    None: no token is drawn, only the acceptance probability); ``laws(j) -> [D, V]`` overrides :func:`proposal`
    (a test plants wrong laws through it).
    Returns (token [D] or None, accepted [D] bool (the token is a draft) or None, Pr[accept | drafts] [D] float64).
    """
    D, n = drafts.shape
    laws = laws or (lambda j: proposal(rule, q, drafts, j))
    t = p[None, :].expand(D, -1).clone()
    miss = torch.ones(D, dtype=torch.float64)
    token = torch.full((D,), -1, dtype=torch.int64)
    done = torch.zeros(D, dtype=torch.bool)
    for j in range(n):
        qj = laws(j)
        z = drafts[:, j:j + 1]
        a = (t.gather(1, z) / qj.gather(1, z)).clamp(max=1.0).squeeze(1)
        if u is not None:
            acc = ~done & (u[:, j] < a)
            token = torch.where(acc, z.squeeze(1), token)
            done = done | acc
        miss = miss * (1.0 - a)
        res = (t - qj).clamp(min=0.0)
        tot = res.sum(1, keepdim=True)
        t = torch.where(tot > 0, res / tot.clamp(min=1e-300), t)  # tot = 0: T <= Q_j, a = 1, T never read again
    if u is None:
        return None, None, 1.0 - miss
    cdf = t.cumsum(1)
    y = torch.searchsorted(cdf, (r * cdf[:, -1])[:, None]).squeeze(1).clamp(max=p.shape[0] - 1)
    token = torch.where(done, token, y)
    return token, (token[:, None] == drafts).any(1), 1.0 - miss


def sample(rule: str, p: torch.Tensor, q: torch.Tensor, n: int, d: int, gen: torch.Generator, laws=None):
    """d independent layers: (token [d], accepted [d], Pr[accept | drafts] [d]); ``laws`` as in :func:`rrs`, given
    the drafts (``laws(drafts, j)``)."""
    drafts = draw(rule, q, n, d, gen)
    u = torch.rand(d, n, dtype=torch.float64, generator=gen)
    r = torch.rand(d, dtype=torch.float64, generator=gen)
    return rrs(p, rule, q, drafts, u, r, laws=None if laws is None else (lambda j: laws(drafts, j)))


def exact_acceptance(rule: str, p: torch.Tensor, q: torch.Tensor, n: int) -> float:
    """Pr[the emitted token is a draft], in closed form (every rule but ``wor``, whose residuals depend on the
    drafts: see :func:`mc_acceptance`)."""
    if rule == "iid":  # the residuals do not depend on which tokens were drawn: deterministic recursion
        t, miss = p.clone(), 1.0
        for _ in range(n):
            beta = float(torch.minimum(t, q).sum())
            miss *= 1.0 - beta
            res = (t - q).clamp(min=0.0)
            if float(res.sum()) <= 0:
                return 1.0
            t = res / res.sum()
        return 1.0 - miss
    if rule == "top":
        return float(p[_top(q, n)].sum())
    if rule in ("greedy", "greedy_zfirst"):
        s = _top(q, n - 1)
        ps, qs = float(p[s].sum()), float(q[s].sum())
        rest = torch.ones_like(p, dtype=torch.bool)
        rest[s] = False
        qr = q[rest] / (1.0 - qs)
        if rule == "greedy_zfirst":
            return ps + float(torch.minimum(p[rest], qr).sum())
        return ps + float(torch.minimum(p[rest], (1.0 - ps) * qr).sum())
    raise ValueError(f"no closed form for rule {rule!r}")


def mc_acceptance(rule: str, p: torch.Tensor, q: torch.Tensor, n: int, d: int,
                  gen: torch.Generator) -> tuple[float, float]:
    """(mean, standard error) of Pr[accept | drafts] over d draft sets: an unbiased estimate of the acceptance."""
    a = rrs(p, rule, q, draw(rule, q, n, d, gen))[2]
    return float(a.mean()), float(a.std() / d**0.5) if d > 1 else 0.0
