"""Measuring an EAGLE-3 head offline (pure torch, no vLLM): its next-token distribution at a target context, its
acceptance in speculative sampling with the reference decoder, and its cost per token beside the target's.

* :func:`root_logits` - the head's depth-0 logits over the target vocabulary (-inf outside the draft vocabulary) at
  the end of each sequence, from the target's features of that sequence (what a forest's first level drafts from).
* :func:`measure_head_acceptance` - ``evaluate.measure_acceptance`` with the head as the draft: speculative
  sampling (``reference.dsbd_decode``, W = 1, depth gamma). The head's draft callable learns which sequence is
  verified from the target callable (every target pass makes the next draft call a root): at a root it runs on the
  target's features of the verified prefix (KV-cached), deeper calls feed back its own pre-norm hidden state.
* :func:`time_cost` - medians of the head's, a draft model's and the target's forward time per token at a decode step
  (KV of ``context`` positions, ``tokens`` new tokens), interleaved in one process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from . import eagle3


@torch.no_grad()
def features(target: Any, ids: torch.Tensor, layer_ids: list[int]):
    """(last-position logits [B, V] float32, aux [B, T, 3D]) of the target on ``ids`` [B, T] (no cache)."""
    o = target(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return o.logits[:, -1].float(), torch.cat([o.hidden_states[i] for i in layer_ids], -1)


@torch.no_grad()
def root_logits(head: eagle3.Eagle3Head, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Head logits [B, V] (target vocabulary) predicting the token after ``ids`` [B, n] (n >= 2), given the target's
    ``aux`` [B, >= n - 1, 3D]: positions 0..n-2 take (target features at t, token t + 1), causally."""
    B, n = ids.shape
    h = head.combine(aux[:, : n - 1].to(head.fc.weight.dtype))
    pos = torch.arange(n - 1)[None].expand(B, n - 1)
    out, _, _ = head(ids[:, 1:], h, pos)
    return head.target_logits(out[:, -1]).float()


class _HeadLane:
    """One request's state: the target's KV cache and features of the verified prefix, the head's chain."""

    def __init__(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.tokens: list[int] = []
        self.aux: list[torch.Tensor] = []
        self.chain: list[int] = []
        self.kv = None
        self.pre = None


class HeadDraftFn:
    """``f(ids [1, T]) -> logits [1, V]``: the head as the draft callable of the reference decoder (W = 1)."""

    def __init__(self, target: Any, head: eagle3.Eagle3Head):
        self.target, self.head = target.eval(), head.eval()
        self.layer_ids = head.config.aux_layer_ids
        self.root = True
        self.lane = _HeadLane()

    def reset(self) -> None:
        self.lane, self.root = _HeadLane(), True

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.shape[0] != 1:
            raise ValueError("HeadDraftFn drafts one sequence at a time (W = 1)")
        row = ids[0].tolist()
        ln = self.lane
        if self.root:
            self.root = False
            n = len(row)
            if ln.tokens != row[: len(ln.tokens)]:  # a new request
                self.lane = ln = _HeadLane()
            new = row[len(ln.tokens): n - 1]
            if new:
                pos = torch.arange(len(ln.tokens), n - 1)[None]
                o = self.target.model(input_ids=torch.tensor([new]), position_ids=pos, past_key_values=ln.cache,
                                      use_cache=True, output_hidden_states=True)
                ln.aux.append(torch.cat([o.hidden_states[i][0] for i in self.layer_ids], -1))
                ln.tokens += new
            aux = torch.cat(ln.aux)[None]
            h = self.head.combine(aux)
            out, ln.pre, ln.kv = self.head(torch.tensor([row[1:n]]), h, torch.arange(n - 1)[None])
            ln.pre = ln.pre[:, -1:]
            ln.chain = list(row)
            return self.head.target_logits(out[:, -1]).float()
        if len(row) != len(ln.chain) + 1 or row[:-1] != ln.chain:
            raise RuntimeError("a draft call that neither starts nor extends the head's chain")
        p = len(row) - 2
        out, pre, ln.kv = self.head(torch.tensor([[row[-1]]]), ln.pre, torch.tensor([[p]]), past=ln.kv)
        ln.pre = pre
        ln.chain = list(row)
        return self.head.target_logits(out[:, -1]).float()


def measure_head_acceptance(target: Any, head: eagle3.Eagle3Head, prompt_ids: list[list[int]], *, gamma: int = 3,
                            max_new_tokens: int = 64, temperature: float = 1.0, eos_token_id: int | None = None,
                            seed: int = 0) -> dict:
    """Pooled acceptance length (generated tokens / target passes) of speculative sampling with the head."""
    from ..core import reference, rng
    from .prefix_lm import PrefixCachedLM

    tf = PrefixCachedLM(target)
    df = HeadDraftFn(target, head)

    def target_fn(ids):
        df.root = True
        return tf(ids)

    gen = calls = 0
    t0 = time.time()
    for i, p in enumerate(prompt_ids):
        df.reset()
        o = reference.dsbd_decode(target_fn, df, list(p), width=1, depth=gamma, max_new_tokens=max_new_tokens,
                                  mode="single", temperature=temperature, eos_token_id=eos_token_id,
                                  seed=rng.derive_seed(seed, i))
        gen += o.stats.generated_tokens
        calls += o.stats.target_calls
        tf.lanes.clear()
    return {"acceptance_length": gen / max(calls, 1), "generated_tokens": gen, "target_calls": calls,
            "prompts": len(prompt_ids), "gamma": gamma, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seconds": round(time.time() - t0, 1)}


@torch.no_grad()
def time_cost(target: Any, head: eagle3.Eagle3Head, draft: Any | None = None, *, context: int = 128,
              tokens: int = 1, repeats: int = 30, seed: int = 0) -> dict:
    """Median seconds per forward of ``tokens`` new tokens after ``context`` cached positions (batch 1; logits of
    every new token) for the target, the head (layer + draft-vocabulary LM head) and ``draft``, interleaved."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    ctx = torch.randint(0, V, (1, context), generator=g)
    new = torch.randint(0, V, (1, tokens), generator=g)
    pos = torch.arange(context, context + tokens)[None]

    def hf_runner(model):
        cache = DynamicCache()
        model(input_ids=ctx, past_key_values=cache, use_cache=True)

        def run():
            model(input_ids=new, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-tokens)
        return run

    D = head.config.hidden_size
    hd = head.config.head_dim
    Hk = head.config.num_key_value_heads
    kv = (torch.randn(1, Hk, context, hd, generator=g), torch.randn(1, Hk, context, hd, generator=g))
    hid = torch.randn(1, tokens, D, generator=g)

    def head_run():
        out, _, _ = head(new, hid, pos, past=kv)
        head.logits(out)

    runs = {"target": hf_runner(target), "head": head_run}
    if draft is not None:
        runs["draft"] = hf_runner(draft)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeats + 2):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            if r >= 2:  # warm-up
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"context": context, "tokens": tokens, "repeats": repeats, "median_seconds": med,
           "head_over_target": med["head"] / med["target"]}
    if draft is not None:
        out["draft_over_target"] = med["draft"] / med["target"]
    return out
