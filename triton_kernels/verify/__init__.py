"""Fused exact verification of one DSBD layer for a batch: the public entry point (thin wrapper over ``kernel.py``).

One launch per layer replaces ``vllm_dsbd.core.joint.joint_logprobs`` + ``vllm_dsbd.core.verify.verify_layer`` for the
sampling requests of a batch: the target joint log P over live beam slots x vocab (temperature, top-k and top-p over
the flattened joint), the recursive rejection chain over the layer's drafts with the without-replacement proposal
law, and the residual / direct draws, with the core's counter-based random numbers computed in the kernel. The
decisions equal the core's (see README.md beside this file for the math and for what "equal" rests on).
"""

from __future__ import annotations

import torch
import triton

from vllm_dsbd.core.rng import Stream

from .._utils import check_device, check_launchable, is_interpreted, require
from .kernel import verify_layer_kernel
from .naive import verify_layer_ref

__all__ = ["fused_verify_layer", "verify_layer_ref"]

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tile sizes. Module constants so tests can shrink them and cross chunk boundaries on tiny inputs.
_MAX_BLOCK_V = 1024  # vocab entries per chunk of a pass
_NUM_PIVOTS = 16  # thresholds tried per pass of the top-k / top-p search (a power of two)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    require(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    require(t.numel() <= 1 or t.stride(-1) == 1, f"{name} must have unit stride in its last dimension")


def fused_verify_layer(
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
    *,
    max_outputs: int | None = None,
    out_idx: torch.Tensor | None = None,
    out_valid: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifies one layer of every sampling request of a batch; returns ``(out_idx, out_valid)``.

    For each request with temperature > 0: log P = the target joint over (live slot, token) pairs (joint index
    b * V + x), then the layer's K = k[r] outputs by recursive rejection sampling over the drafts in draw order, then
    a residual draw and direct draws when the drafts run out, exactly as ``joint_logprobs`` + ``verify_layer``.
    Requests with temperature 0 (deterministic) are NOT handled: their row is -1 / False, and the caller runs
    ``beam_step`` on them as ``verify_forest`` does (beam search needs no verification randomness, and its EOS rule
    lives there).

    Args:
        logits: ``[R, S, V]`` fp32/fp16/bf16 target logits at the S parent slots; unit stride in V.
        scores: ``[R, S]`` fp32 beam scores (read where ``live``).
        live: ``[R, S]`` bool, the valid parent beams of the layer.
        temperature: ``[R]`` fp32, > 0 sampling, 0 deterministic (skipped).
        top_k: ``[R]`` int64 over the flattened joint, 0 = off.
        top_p: ``[R]`` fp32 over the flattened joint, in (0, 1]; 1 = off.
        seed: ``[R]`` int64 request seeds.
        position: ``[R]`` int64 position of the layer's tokens (keys the randomness with ``seed``).
        draft_idx: ``[R, M]`` int64 joint indices of the layer's drafts in draw order (M may be 0); in [0, S * V)
            where valid, pairwise distinct among the valid ones (drawn without replacement).
        draft_valid: ``[R, M]`` bool, which drafts exist (a prefix in DSBD; any pattern is honoured).
        logq: ``[R, S * V]`` fp32 draft joint log Q the drafts were drawn from; unit stride.
        k: ``[R]`` int64 outputs wanted, 0 <= k <= support of P and k <= max_outputs.
        max_outputs: columns of the outputs (e.g. the width W); default ``max(k.max(), 1)``, which syncs.
        out_idx: optional ``[R, max_outputs]`` int64 output buffer (CUDA-graph friendly), unit stride.
        out_valid: optional ``[R, max_outputs]`` bool output buffer, unit stride.
        use_kernel: True = the Triton kernel, False = the torch reference (``verify_layer_ref``), None = the kernel
            on CUDA or under ``TRITON_INTERPRET=1``, the reference otherwise.

    Returns:
        out_idx ``[R, max_outputs]`` int64 joint indices of the outputs in emission order, -1 after the k-th;
        out_valid ``[R, max_outputs]`` bool, the first k[r] columns of sampling rows.

    Raises ValueError on a broken contract (shapes, dtypes, strides, devices). Values are not checked (that would
    sync). No host sync when ``max_outputs`` is given; one launch, grid (R,).
    """
    require(logits.dim() == 3, f"logits must be [R, S, V], got shape {tuple(logits.shape)}")
    require(logits.dtype in _LOGIT_DTYPES, f"logits dtype must be one of {_LOGIT_DTYPES}, got {logits.dtype}")
    require(logits.stride(-1) == 1, "logits must have unit stride in V")
    R, S, V = logits.shape
    require(S >= 1 and V >= 1, f"logits needs S >= 1 and V >= 1, got {tuple(logits.shape)}")
    require(S * V < 2**31, f"the joint has {S * V} entries; at most 2**31 - 1 supported")
    require(draft_idx.dim() == 2, f"draft_idx must be [R, M], got shape {tuple(draft_idx.shape)}")
    M = draft_idx.shape[1]
    _check("scores", scores, (R, S), torch.float32)
    _check("live", live, (R, S), torch.bool)
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                        ("top_p", top_p, torch.float32), ("seed", seed, torch.int64),
                        ("position", position, torch.int64), ("k", k, torch.int64)):
        _check(name, t, (R,), dt)
    _check("draft_idx", draft_idx, (R, M), torch.int64)
    _check("draft_valid", draft_valid, (R, M), torch.bool)
    _check("logq", logq, (R, S * V), torch.float32)
    device = logits.device
    for name, t in (("scores", scores), ("live", live), ("temperature", temperature), ("top_k", top_k),
                    ("top_p", top_p), ("seed", seed), ("position", position), ("draft_idx", draft_idx),
                    ("draft_valid", draft_valid), ("logq", logq), ("k", k)):
        check_device(name, t, device)
    if max_outputs is None:
        max_outputs = max(int(k.max()) if R else 0, 1)  # host sync; pass max_outputs to avoid it
    require(max_outputs >= 1, f"max_outputs must be >= 1, got {max_outputs}")
    if out_idx is None:
        out_idx = torch.empty(R, max_outputs, dtype=torch.int64, device=device)
    if out_valid is None:
        out_valid = torch.empty(R, max_outputs, dtype=torch.bool, device=device)
    _check("out_idx", out_idx, (R, max_outputs), torch.int64)
    _check("out_valid", out_valid, (R, max_outputs), torch.bool)
    check_device("out_idx", out_idx, device)
    check_device("out_valid", out_valid, device)

    if use_kernel is None:
        use_kernel = device.type == "cuda" or is_interpreted(verify_layer_kernel)
    if not use_kernel:
        ref_idx, ref_valid = verify_layer_ref(logits, scores, live, temperature, top_k, top_p, seed, position,
                                              draft_idx, draft_valid, logq, k, max_outputs)
        out_idx.copy_(ref_idx)
        out_valid.copy_(ref_valid)
        return out_idx, out_valid
    check_launchable(verify_layer_kernel, device, "fused_verify_layer", "verify_layer_ref")
    if R == 0:
        return out_idx, out_valid
    interpreted = is_interpreted(verify_layer_kernel)
    verify_layer_kernel[(R,)](
        out_idx, out_valid, logits, scores, live, temperature, top_k, top_p, seed, position, k,
        draft_idx, draft_valid, logq,
        S, V, M, max_outputs,
        logits.stride(0), logits.stride(1), scores.stride(0), live.stride(0), draft_idx.stride(0),
        draft_valid.stride(0), logq.stride(0), out_idx.stride(0), out_valid.stride(0),
        STREAM_ACCEPT=int(Stream.ACCEPT),
        STREAM_RESIDUAL=int(Stream.RESIDUAL),
        STREAM_DIRECT=int(Stream.DIRECT),
        BLOCK_V=max(2, min(_MAX_BLOCK_V, triton.next_power_of_2(V))),
        BLOCK_S=max(2, triton.next_power_of_2(S)),
        BLOCK_M=max(2, triton.next_power_of_2(M)),
        BLOCK_K=max(2, triton.next_power_of_2(max_outputs)),
        NUM_PIVOTS=_NUM_PIVOTS,
        ACCURATE=not interpreted,  # libdevice exp/log on the GPU; the interpreter has only numpy's
        num_warps=8,
    )
    return out_idx, out_valid
