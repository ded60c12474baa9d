"""The fused verification kernel (``dsbd_kernels.verify.fused_verify_layer``) in the engine's static verification.

One launch per layer computes the sampling rows' joint and recursive rejection chain with the same decisions as
``joint_logprobs`` + ``verify_layer_static`` (``tests/kernels/test_kernel_verify.py``), where the torch layer launches a
few dozen small operations per draft. On CUDA the static paths use it (``VLLM_DSBD_FUSED_VERIFY=0``: the torch layer);
on the CPU the torch layer runs. Measurements: docs/notebook/gpu-2026-11-22.md.
"""
from __future__ import annotations

import torch

from vllm_dsbd import envs
from vllm_dsbd.core.params import BatchParams

FUSED_ENV = envs.FUSED_VERIFY


def fused_default(device: torch.device) -> bool:
    """Whether the static paths verify with the kernel on ``device`` (``VLLM_DSBD_FUSED_VERIFY``: ``auto``, the default,
    on CUDA; ``0`` never; ValueError otherwise), as the environment says now; the runner passes what it read at
    start-up."""
    return envs.read(only=(FUSED_ENV,)).fused_verify_on(device)


def fused_layer(logits: torch.Tensor, scores: torch.Tensor, live: torch.Tensor, params: BatchParams,
                position: torch.Tensor, draft_idx: torch.Tensor, draft_valid: torch.Tensor, logq: torch.Tensor,
                k: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_layer_static(joint_logprobs(logits, scores, live, params), ...)`` for the sampling rows in one launch
    (temperature-0 rows come back without outputs: their caller steps them with ``beam_step``). ``logits`` [R, S, V],
    ``logq`` [R, S * V]; ``kmax`` (a host value) the output columns. No host read."""
    from dsbd_kernels.verify import fused_verify_layer

    return fused_verify_layer(logits, scores.float().contiguous(), live.contiguous(), params.temperature,
                              params.top_k, params.top_p, params.seed, position, draft_idx.contiguous(),
                              draft_valid.contiguous(), logq.float().contiguous(), k, max_outputs=max(kmax, 1),
                              use_kernel=True)
