"""Synthetic width-1 engine steps for ``sampler.verify`` (chain forests): the cases of the chain verification tests
(``test_verify_chain.py``) and the inputs of ``benchmarks/kernels/verify_chain.py``.

A step: R requests, each with a chain drafted like the engine's drafter does (beam_step on the draft's logits with
the request's settings, DRAFT_DRAW stream), the draft's logits a noisy copy of the target's so that layers pass and
fail, and the logits rows of one target pass (the root, then one row after each scheduled node).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Req:
    """One request of a synthetic step."""

    depth: int = 3  # drafted depth (0: no forest)
    nodes: int | None = None  # nodes vLLM scheduled (sampler.truncate), None: all
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos: int = -1  # a token id, or -2: the token of the chain's node at depth ``eos_depth`` (an EOS the draft hits)
    eos_depth: int = 1
    peak: float = 3.0  # target logits = peak * N(0, 1)
    noise: float = 0.5  # draft logits = target + noise * N(0, 1)
    drafts: str = "draft"  # "draft": drawn from the draft; "argmax": the target's argmax; "double_q": drawn from the
    # draft but with log Q = log P + log 2 (P <= Q everywhere: the residual has no mass, verify_layer's fallback)


def build_step(reqs: list[Req], G: int, V: int, seed: int = 0):
    """(logits [rows, V], [RowPlan], DSBDConfig) of one width-1 engine step over ``reqs``."""
    from vllm_dsbd.config import DSBDConfig
    from vllm_dsbd.core import rng
    from vllm_dsbd.core.forest import Forest
    from vllm_dsbd.core.joint import NEG_INF, joint_logprobs
    from vllm_dsbd.core.params import BatchParams
    from vllm_dsbd.core.sampling import beam_step
    from vllm_dsbd.engine import sampler
    from vllm_dsbd.engine.state import PendingForest, RequestState

    gen = torch.Generator().manual_seed(seed)
    plans, rows, first = [], [], 0
    for i, rq in enumerate(reqs):
        L = 5 + int(torch.randint(0, 50, (1,), generator=gen))
        rseed = int(torch.randint(0, 2**62, (1,), generator=gen))
        target = torch.randn(rq.depth + 1, V, generator=gen) * rq.peak
        draft = target[: rq.depth] + rq.noise * torch.randn(rq.depth, V, generator=gen)
        eos = rq.eos
        params = BatchParams.make(1, temperature=rq.temperature, top_k=rq.top_k, top_p=rq.top_p, seed=rseed,
                                  eos=max(eos, -1), depth=rq.depth, single=True, max_k=1)
        toks, joints = [], []
        for d in range(rq.depth):
            st = beam_step(draft[d][None, None], torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), params,
                           torch.tensor([rng.forest_position(L - 1, d + 1)]), rng.Stream.DRAFT_DRAW)
            tok, joint = int(st.token[0, 0]), st.joint
            if rq.drafts == "argmax":
                tok = int(target[d].argmax())
            elif rq.drafts == "double_q":
                logp, _ = joint_logprobs(target[d][None, None], torch.zeros(1, 1),
                                         torch.ones(1, 1, dtype=torch.bool), params)
                joint = logp + torch.log(torch.tensor(2.0))
            toks.append(tok)
            joints.append(joint)
        if eos == -2:
            eos = toks[min(rq.eos_depth, rq.depth) - 1] if rq.depth else 0
        st = RequestState(req_id=f"r{i}", seed=rseed, width=1, temperature=rq.temperature, top_k=rq.top_k,
                          top_p=rq.top_p, eos=eos, max_tokens=None)
        plan = sampler.RowPlan(state=st, first_row=first, context_len=L)
        n = rq.depth if rq.nodes is None else min(rq.nodes, rq.depth)
        if rq.depth and n:
            z = torch.zeros(1, G, 1, dtype=torch.int64)
            tok_t = z.clone()
            tok_t[0, : rq.depth, 0] = torch.tensor(toks)
            valid = torch.zeros(1, G, 1, dtype=torch.bool)
            valid[0, : rq.depth] = True
            q = torch.full((1, G, V), NEG_INF)
            q[0, : rq.depth] = torch.cat(joints)
            forest = Forest(parent=z, token=tok_t, valid=valid, score=torch.zeros(1, G, 1), q_joint=q,
                            depth=torch.tensor([rq.depth]))
            cut = sampler.truncate(forest, L, n)
            plan.forest = PendingForest(forest=cut, tokens=toks[:n], parents=list(range(-1, n - 1)),
                                        depths=list(range(1, n + 1)), root_pos=L - 1)
            plan.num_nodes, plan.drafted_depth = n, rq.depth
        else:
            n = 0
        rows.extend(target[: n + 1])
        first += n + 1
        plans.append(plan)
    return torch.stack(rows), plans, DSBDConfig(width=1, depth=G, dynamic_width=False)
