"""Draft distillation: build a small draft model for a Llama-family target (``python -m vllm_dsbd.distill``).

The draft = a few decoder layers of the target's width (initialised from the target's first layers) on the
target's token embedding, final norm and LM head (frozen, shared: the draft adds only its layers' weights), trained
to match the target's next-token distributions (forward KL on the full vocabulary) on text the target samples itself
at temperature 1. Output: a standard HF folder (config.json, model.safetensors, tokenizer files) that transformers
and vLLM load as a draft model.

    python -m vllm_dsbd.distill --target DIR --out DIR --layers 2 --tokens 200000 --seq-len 128 \\
        --batch-size 8 --lr 1e-3 --prompts sharegpt --device cpu --seed 0
    python -m vllm_dsbd.distill export --draft DIR --artifact drafts/NAME     # layers only, float16
    python -m vllm_dsbd.distill assemble --target DIR --artifact drafts/NAME --out DIR
    python -m vllm_dsbd.distill eval --target DIR --draft DIR [--baseline-layers 2] [--head DIR]
    python -m vllm_dsbd.distill --head eagle3 --target DIR --out DIR ...   # an EAGLE-3 head instead (eagle3*.py)

Python API: :class:`DistillConfig`, :func:`distill`, :func:`export_artifact`, :func:`assemble`,
:func:`evaluate` / :func:`measure_acceptance`.
"""

from .artifact import assemble, export_artifact, target_fingerprint
from .evaluate import PrefixCachedLM, evaluate, measure_acceptance
from .train import DistillConfig, build_draft, distill, fused_kl

__all__ = ["DistillConfig", "distill", "build_draft", "fused_kl", "assemble", "export_artifact", "target_fingerprint",
           "evaluate", "measure_acceptance", "PrefixCachedLM"]
