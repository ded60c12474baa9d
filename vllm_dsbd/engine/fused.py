"""The fused verification kernel (``dsbd_kernels.verify.fused_verify_layer``) in the engine's static verification.

One launch per layer computes the sampling rows' joint and their recursive rejection chain (``joint_logprobs`` +
``verify_layer``, the same decisions: ``triton_kernels/verify/README.md``, ``tests/kernels/test_kernel_verify.py``), where the
torch layer (``core.verify_static.verify_layer_static``) launches a few dozen small operations per draft. Measured on
an H100 (``docs/notebook``, 2026-11-22: V = 32000, W = 4, depth 3): 5.4 vs 33.6 ms at batch 1, 10.0 vs 31.8 ms at batch 64
against the torch core. So on CUDA the static paths use it (``sampler.verify`` for plain requests, mode "sample";
``beam_sampling.verify`` for beam requests at T > 0); ``VLLM_DSBD_FUSED_VERIFY=0`` keeps the torch layer. On the
CPU the torch layer runs (tests run the kernel there under Triton's interpreter, ``fused=True``).
"""
from __future__ import annotations

import torch

from vllm_dsbd import envs
from vllm_dsbd.core.params import BatchParams

FUSED_ENV = envs.FUSED_VERIFY


def fused_default(device: torch.device) -> bool:
    """Whether the static paths verify with the kernel on ``device`` (``VLLM_DSBD_FUSED_VERIFY``: ``auto``, the
    default, on CUDA; ``0`` never; ValueError for any other value), as the environment says now: the default of
    callers that do not say (the runner says what it read at start-up, ``envs.Env.fused_verify_on``)."""
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
