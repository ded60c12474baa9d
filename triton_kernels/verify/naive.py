"""Torch reference of fused layer verification: the test oracle, the CPU path and the benchmark's baseline.

It is the torch core itself (``vllm_dsbd.core``: ``joint_logprobs`` then ``verify_layer`` on the sampling rows), so
"the kernel equals the reference" means "the kernel equals the core".
"""

from __future__ import annotations

import torch

from vllm_dsbd.core.joint import joint_logprobs
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.verify import verify_layer


def verify_layer_ref(
    logits: torch.Tensor,
    scores: torch.Tensor,
    live: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    draft_idx: torch.Tensor,
    draft_valid: torch.Tensor,
    logq: torch.Tensor,
    k: torch.Tensor,
    max_outputs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``dsbd_kernels.verify.fused_verify_layer`` (see there); returns new tensors.

    Deterministic rows (temperature 0) are not verified here either: out_idx -1, out_valid False. Reads the batch's
    row selection on the host (boolean indexing), as the core does.
    """
    R = logits.shape[0]
    dev = logits.device
    out_idx = torch.full((R, max_outputs), -1, dtype=torch.int64, device=dev)
    out_valid = torch.zeros(R, max_outputs, dtype=torch.bool, device=dev)
    params = BatchParams.make(R, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, device=dev)
    logp, _ = joint_logprobs(logits, scores, live, params)  # [R, S * V]
    samp = temperature > 0
    if bool(samp.any()):
        oi, ov = verify_layer(logp[samp], draft_idx[samp], draft_valid[samp], logq[samp], k[samp], seed[samp],
                              position[samp])
        w = min(oi.shape[1], max_outputs)
        out_idx[samp, :w] = oi[:, :w]
        out_valid[samp, :w] = ov[:, :w]
    return out_idx, out_valid
