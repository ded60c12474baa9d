"""Counter-based randomness keyed by (seed, position, stream, index).

Every random number DSBD uses is a pure function of the request's seed, the sequence position being decided, a stream
tag naming the decision (draft draw, acceptance coin, residual draw, ...) and an index inside that decision. Nothing is
stateful, so a replayed request repeats exactly and every tensor-parallel rank builds the same forest without a
broadcast. The hash is murmur3's 32-bit finaliser over uint32 words held in int64 tensors (the same arithmetic a
Triton kernel can do in uint32).

The number at (key, index) is fmix32(fmix32(key ^ 0x3C6EF372) ^ fmix32(index * 0x01000193 + 0x6A09E667)): the index is
mixed before it meets the key. (Until 2026-11-25 it was fmix32((key ^ index) * 0x01000193), so keys k and k ^ d gave the
same numbers at indices i and i ^ d: for d below the index range, one array was the other's permutation.)

Why keying by position is exact: a decision at position p uses only numbers keyed by p, and whether a later iteration
starts at p' is decided by numbers keyed by positions < p'; so every decision sees numbers independent of everything
that came before it.
"""
from __future__ import annotations

import enum

import torch

_M32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """What a random number decides. One tag per kind of decision, so no two decisions share numbers."""

    TARGET_DRAW = 1  # beam sampling on the target (the baseline decoder)
    DRAFT_DRAW = 2  # beam sampling on the draft (building the forest)
    ACCEPT = 3  # acceptance coin of draft j in a verification layer
    RESIDUAL = 4  # the one draw from the residual when drafts run out
    DIRECT = 5  # the remaining draws of a layer, straight from the target joint


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser; h holds uint32 values in int64, products wrap mod 2**64 and are masked back to 32 bits.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def request_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per request for (seed, position, stream). seed, position: int64 [R]. Returns int64 [R]."""
    return stream_key(key_base(seed, position), stream)


def key_base(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The (seed, position) part of :func:`request_key`, shared by its streams: ``request_key(s, p, stream) ==
    stream_key(key_base(s, p), stream)`` (computed once when one decision uses several streams)."""
    seed = seed.to(torch.int64)
    h = _fmix32((seed & _M32) ^ 0x9E3779B9)
    h = _fmix32(h ^ ((seed >> 32) & _M32))
    return _fmix32(h ^ (position.to(torch.int64) & _M32))


def stream_key(base: torch.Tensor, stream: int) -> torch.Tensor:
    return _fmix32(base ^ (int(stream) * 0x27D4EB2F & _M32))


def _i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= (1 << 31) else c


def _fmix32_i32_(h: torch.Tensor) -> torch.Tensor:
    # the same finaliser in place on int32 (wrapping multiply; logical shifts by masking): bit-identical to _fmix32,
    # with a quarter of the memory traffic of the int64 form (this runs on every entry of the joint)
    h ^= (h >> 16) & 0xFFFF
    h *= _i32(0x85EBCA6B)
    h ^= (h >> 13) & 0x7FFFF
    h *= _i32(0xC2B2AE35)
    h ^= (h >> 16) & 0xFFFF
    return h


_KEY_SALT = 0x3C6EF372
_INDEX_MUL = 0x01000193
_INDEX_ADD = 0x6A09E667


def _bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fmix32(fmix32(key ^ 0x3C6EF372) ^ fmix32(index * 0x01000193 + 0x6A09E667)) as int32; key: uint32 values in
    int64, index: int64 (low 32 bits used). Each mix runs on its own operand's shape (key [R, 1] against index [1, N]
    mixes R keys and N indices once; only the last fmix32 runs on the broadcast [R, N]).

    Why distinct keys give unrelated arrays: with K = fmix32(key ^ c) and g(i) = fmix32(i * m + a) (g a bijection of
    uint32 that scrambles [0, N)), keys k != k' give the same number at i and j only where g(i) ^ g(j) == K ^ K', about
    N**2 / 2**32 pairs of a window [0, N), as for independent functions; the old hash matched i with i ^ d for every i.
    K spreads keys that differ in a few bits (the XOR of two K is a random-looking word, not a weak one for fmix32)."""
    k = _fmix32((key.to(torch.int64) & _M32) ^ _KEY_SALT)
    k = torch.where(k >= 2**31, k - 2**32, k).to(torch.int32)
    i = index.to(torch.int64) & _M32
    g = torch.where(i >= 2**31, i - 2**32, i).to(torch.int32)  # a fresh tensor: the mixes below run in place
    g *= _i32(_INDEX_MUL)
    g += _INDEX_ADD
    h = _fmix32_i32_(g) ^ k
    return _fmix32_i32_(h)


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, 23 bits: key int64 [R, 1] or [R], index int64 broadcastable. Never 0 or 1.

    u = ((_bits(key, index) >> 9) + 0.5) * 2**-23 (the bits as uint32)."""
    h = _bits(key, index.to(torch.int64))
    return ((h >> 9) & 0x7FFFFF).to(torch.float32).add_(0.5).mul_(2.0**-23)


def gumbel(key: torch.Tensor, shape_last: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [R, shape_last] = -log(-log(u)) for per-request keys [R], indexed 0..shape_last-1."""
    idx = torch.arange(shape_last, dtype=torch.int64, device=key.device)
    return uniform(key[:, None], idx[None, :]).log_().neg_().log_().neg_()


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit request seed from a user seed and a request index (splitmix64), distinct for distinct pairs."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1
