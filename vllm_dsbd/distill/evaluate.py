"""Acceptance of a draft in speculative sampling, measured with the reference decoder.

``measure_acceptance`` runs ``vllm_dsbd.core.reference.dsbd_decode(target_fn, draft_fn, prompts, width=1,
depth=gamma, mode="single", temperature=T)`` (W = 1 single-beam DSBD is speculative sampling) on held-out prompts
and reports the mean acceptance length = generated tokens / target passes, pooled over the prompts (between 1 and
gamma + 1).

The reference decoder calls its models on whole sequences (no KV cache). To make a 30-layer target affordable on a
CPU, the callables given to it here are :class:`PrefixCachedLM`: each keeps one KV cache per request ("lane") and
feeds only the tokens after the longest prefix it has already computed (rejected draft tokens are cropped off). The
logits are those of the same model on the same sequence, up to float rounding (checked in the tests).
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import torch


class PrefixCachedLM:
    """``f(ids [B, T]) -> next-token logits [B, V]`` (float32) over a HF causal LM, with per-sequence KV reuse.

    A lane is created by a sequence that extends no lane's base; a lane is reused for a sequence sharing at least its
    base (the sequence that created it, e.g. a prompt), so requests never evict each other. At most ``max_lanes``
    lanes are kept (least recently used dropped)."""

    def __init__(self, model: Any, max_lanes: int = 256):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_lanes = max_lanes
        self.lanes: list[dict] = []  # {"base": int, "tokens": list[int], "cache": DynamicCache, "used": int}
        self.clock = 0
        self.tokens_fed = 0

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"expected token ids of shape [B, T] with T >= 1, got {tuple(ids.shape)}")
        out = []
        for row in ids.tolist():
            self.clock += 1
            best, best_c = None, -1
            for lane in self.lanes:
                c = self._common(lane["tokens"], row)
                if c >= lane["base"] and c > best_c:
                    best, best_c = lane, c
            if best is None:
                best = {"base": len(row) - 1, "tokens": [], "cache": DynamicCache()}
                best_c = 0
                self.lanes.append(best)
                if len(self.lanes) > self.max_lanes:
                    self.lanes.remove(min(self.lanes, key=lambda ln: ln["used"]))
            keep = min(best_c, len(row) - 1)
            have = best["cache"].get_seq_length()
            if keep == 0:
                best["cache"] = DynamicCache()
            elif have > keep:
                best["cache"].crop(-(have - keep))
            feed = torch.tensor([row[keep:]], device=self.device)
            pos = torch.arange(keep, len(row), device=self.device)[None]
            o = self.model(input_ids=feed, position_ids=pos, past_key_values=best["cache"], use_cache=True,
                           logits_to_keep=1)
            self.tokens_fed += len(row) - keep
            best["tokens"] = row
            best["used"] = self.clock
            out.append(o.logits[0, -1].float())
        return torch.stack(out)


def measure_acceptance(target: Any, draft: Any, prompt_ids: list[list[int]], *, gamma: int = 3,
                       max_new_tokens: int = 64, temperature: float = 1.0, eos_token_id: int | None = None,
                       seed: int = 0, progress: bool = False, desc: str = "acceptance") -> dict:
    """Speculative sampling (W = 1, depth ``gamma``) of every prompt with the reference decoder; returns the pooled
    acceptance length (generated tokens / target passes) and details. Prompts are decoded one at a time (each with
    its own seed ``derive_seed(seed, i)`` as a batch would give it)."""
    from tqdm.auto import tqdm

    from ..core import reference, rng

    tf, df = PrefixCachedLM(target), PrefixCachedLM(draft)
    gen = calls = iters = 0
    per_prompt = []
    t0 = time.time()
    for i, p in enumerate(tqdm(prompt_ids, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True)):
        o = reference.dsbd_decode(tf, df, list(p), width=1, depth=gamma, max_new_tokens=max_new_tokens,
                                  mode="single", temperature=temperature, eos_token_id=eos_token_id,
                                  seed=rng.derive_seed(seed, i))
        gen += o.stats.generated_tokens
        calls += o.stats.target_calls
        iters += o.stats.iterations
        per_prompt.append(o.stats.generated_tokens / max(o.stats.target_calls, 1))
        tf.lanes.clear(), df.lanes.clear()  # one request at a time: free its KV
    mean_len = gen / max(calls, 1)
    return {
        "acceptance_length": mean_len,
        "generated_tokens": gen,
        "target_calls": calls,
        "prompts": len(prompt_ids),
        "acceptance_length_mean_of_prompts": sum(per_prompt) / max(len(per_prompt), 1),
        "acceptance_length_per_prompt_std": float(torch.tensor(per_prompt).std()) if len(per_prompt) > 1 else 0.0,
        "gamma": gamma,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seconds": round(time.time() - t0, 1),
    }


def evaluate(target_dir: str, drafts: dict[str, Any], *, prompts: str = "sharegpt", num_prompts: int = 32,
             max_prompt_len: int = 64, gamma: int = 3, max_new_tokens: int = 64, temperature: float = 1.0,
             seed: int = 0, progress: bool = True, log=print) -> dict:
    """Acceptance of each draft in ``drafts`` (name -> HF folder, an EAGLE-3 head folder, or an int n for the
    untrained ``truncated_draft(target, n)``) on the first ``num_prompts`` held-out prompts of ``prompts``."""
    from ..testing import models
    from . import data

    target = models.load_hf(target_dir)
    tok = models.load_tokenizer(target_dir)
    texts = data.load_prompts(prompts, "eval")[:num_prompts]
    pids = [data.encode_prompt(tok, t, max_prompt_len) for t in texts]
    eos = tok.eos_token_id
    results = {}
    for name, spec in drafts.items():
        from . import eagle3

        if not isinstance(spec, int) and eagle3.is_head_folder(spec):
            from .eagle3_eval import measure_head_acceptance

            head = eagle3.load_head(spec, target.get_input_embeddings().weight)
            r = measure_head_acceptance(target, head, pids, gamma=gamma, max_new_tokens=max_new_tokens,
                                        temperature=temperature, eos_token_id=eos, seed=seed)
        else:
            draft = models.truncated_draft(target, spec) if isinstance(spec, int) else models.load_hf(spec)
            r = measure_acceptance(target, draft, pids, gamma=gamma, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_id=eos, seed=seed, progress=progress, desc=name)
        r["draft"] = spec if isinstance(spec, int) else str(spec)
        results[name] = r
        log(f"{name}: acceptance length {r['acceptance_length']:.3f} ({r['generated_tokens']} tokens / "
            f"{r['target_calls']} target passes, {len(pids)} prompts, {r['seconds']} s)")
    return {"prompts": prompts, "split": "eval", "num_prompts": len(pids), "max_prompt_len": max_prompt_len,
            "results": results}


def write_json(obj: dict, path: str | pathlib.Path) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
