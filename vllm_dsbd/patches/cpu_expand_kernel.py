"""Patch: vLLM's CPU stand-in for the rejection sampler's ``expand_kernel`` writes its result (vllm#55005).

On CPU, vLLM 0.26 replaces the Triton kernels of speculative decoding with C++ ops (``cpu_model_runner.py:78-113``).
The stand-in for ``expand_kernel`` (``utils/cpu_triton_utils.py:408-421``) converts the output buffer to int64 with
``_ensure_int64``, which makes a *copy* for any other dtype; the C++ op fills the copy and the caller's buffer stays
as ``new_empty`` left it. ``expand_batch_to_tokens`` expands float32 temperatures, int32 top-k and float32 top-p
this way, so on CPU every non-greedy request of vLLM's own speculative decoding (``draft_model``, EAGLE, ...) divides
its target logits by uninitialised memory: the output is not the target's law (measured: SmolLM2-135M drafting for
itself at temperature 1 accepted 3 of 177 draft tokens and wrote text of mean log-probability -12.6 per token).

DSBD never calls the rejection sampler; the fix is here because the benchmark's ``draft_model`` baseline and the
tests that compare DSBD with it run vLLM's speculative sampling on CPU. It is the one patch that changes a non-DSBD
path, and only to make it compute what vLLM's Triton kernel computes on a GPU. Nothing changes where vLLM uses the
Triton kernel (GPUs, or a Triton-CPU backend): the module patched here is only read by the CPU model runner.
"""

from __future__ import annotations

import types

from vllm_dsbd.patches._patching import set_attr, when_imported

PATCH_ID = "cpu_expand_kernel"
MODULE = "vllm.utils.cpu_triton_utils"


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` replaced by ``replace_to``), in any dtype: what
    ``rejection_sampler.expand_kernel`` does on a GPU."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    expanded = torch.where(input_val == replace_from, replace_to, input_val).repeat_interleave(counts)
    output[: expanded.numel()].copy_(expanded)


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(cpu_tl: types.ModuleType) -> None:
    set_attr(PATCH_ID, cpu_tl, "expand_kernel", cpu_tl._FuncWrapper(expand))
