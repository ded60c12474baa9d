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


from .prefix_lm import PrefixCachedLM  # re-exported: distill.PrefixCachedLM


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
