"""Counter-based randomness keyed by (seed, position, stream, index): 64-bit keys, 53-bit uniforms.

Every random number DSBD uses is a pure function of the request's seed, the sequence position being decided, a stream
tag naming the decision (draft draw, acceptance coin, residual draw, ...) and an index inside that decision. Nothing is
stateful, so a replayed request repeats exactly and every tensor-parallel rank builds the same forest without a
broadcast. The hash is murmur3's 64-bit finaliser ``fmix64`` over uint64 words held in int64 tensors (wrapping
multiplies, logical shifts by masking): the same arithmetic a Triton kernel does in uint64
(``dsbd_kernels/verify/kernel.py``, tested bit for bit).

    key      = fmix64(fmix64(fmix64(seed ^ SEED_SALT) ^ position) ^ stream * STREAM_MUL)   (64 bits)
    bits     = fmix64(fmix64(key ^ KEY_SALT) ^ fmix64(index * INDEX_MUL + INDEX_ADD))    (64 bits)
    uniform  = (2 * (bits >> 12) + 1) * 2**-53    float64, the 2**52 odd multiples of 2**-53 in (0, 1)
    gumbel   = float32(-log(-log(uniform)))       computed in float64, rounded once

A uniform is never 0 or 1 and comes within 2**-53 of either end, so Gumbel noise reaches 36.7 (23-bit uniforms, used
until 2026-11-27, stopped at 16.6 and drew tokens of probability ~5e-8 17-20% too rarely: docs/deviations.md D21).
64-bit keys: two decisions of one request share a key with probability ~2**-64 per pair (32-bit keys: ~1% for a
2,048-token request's ~10^4 decisions).

Why this keying is exact: a decision at position p (an acceptance coin, a residual or direct draw, a target beam
step) uses only numbers keyed by p, and each position is decided once; a forest's draft draws (``DRAFT_DRAW``) are
keyed by the forest, its root's position and the depth (:func:`forest_position`), and a request's roots strictly
increase, so every forest draws numbers nothing before it used. Whether a later iteration starts at p', which forest
it drafts and from which law Q (a function of everything before it: the recycle source keeps the target's rows of
earlier forests' nodes, which their draft draws chose) are decided by numbers used before; so every decision sees
numbers independent of everything that came before it. (Draft draws keyed by the node's position, as until 2026-12-06,
let a forest reuse the draws that chose the previous forest's unverified deep nodes, whose recycled rows could make
its Q: Q then depended on the very numbers it was drawn with. docs/deviations.md D10.)
"""
from __future__ import annotations

import enum

import torch

_M64 = (1 << 64) - 1
_M31 = (1 << 31) - 1
_M52 = (1 << 52) - 1
_ONE = 0x3FF0000000000000  # the float64 bits of 1.0

SEED_SALT = 0x9E3779B97F4A7C15
STREAM_MUL = 0xD6E8FEB86659FD93
KEY_SALT = 0x3C6EF372FE94F82B
INDEX_MUL = 0x9FB21C651E98DF25
INDEX_ADD = 0x6A09E667F3BCC909
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53


class Stream(enum.IntEnum):
    """What a random number decides. One tag per kind of decision, so no two decisions share numbers."""

    TARGET_DRAW = 1  # beam sampling on the target (the baseline decoder)
    DRAFT_DRAW = 2  # beam sampling on the draft (building the forest)
    ACCEPT = 3  # acceptance coin of draft j in a verification layer
    RESIDUAL = 4  # the one draw from the residual when drafts run out
    DIRECT = 5  # the remaining draws of a layer, straight from the target joint


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    c &= _M64
    return c - (1 << 64) if c >= (1 << 63) else c


def _fmix64_(h: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 in place on int64 (uint64 bits): wrapping multiplies, logical shifts by masking."""
    h ^= (h >> 33) & _M31
    h *= _i64(FMIX_C1)
    h ^= (h >> 33) & _M31
    h *= _i64(FMIX_C2)
    h ^= (h >> 33) & _M31
    return h


DEPTH_BITS = 16  # forest_position: a forest's depths are below 2**16


def forest_position(root, depth):
    """The position word ``DRAFT_DRAW`` is keyed by for the depth-``depth`` draws (depth >= 1) of the forest whose root
    sits at position ``root`` (plain requests: the last committed token; beam requests: the live beams' last tokens):
    ``root * 2**16 + depth``, distinct for distinct (root, depth), so each forest's noise is fresh (module docstring).
    Ints, numpy arrays or int64 tensors alike."""
    return root * (1 << DEPTH_BITS) + depth


def key_base(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The (seed, position) part of a key, shared by its streams: ``request_key(s, p, stream) ==
    stream_key(key_base(s, p), stream)``. seed, position: int64 (all 64 bits used). Returns int64 (uint64 bits)."""
    h = _fmix64_(seed.to(torch.int64) ^ _i64(SEED_SALT))
    return _fmix64_(h ^ position.to(torch.int64))  # broadcast (seed [R, 1] against positions [R, L])


def stream_key(base: torch.Tensor, stream: int) -> torch.Tensor:
    return _fmix64_(base ^ _i64(int(stream) * STREAM_MUL))


def request_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """One 64-bit key per request for (seed, position, stream). seed, position: int64 [R]. Returns int64 [R]."""
    return stream_key(key_base(seed, position), stream)


def _bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fmix64(fmix64(key ^ KEY_SALT) ^ fmix64(index * INDEX_MUL + INDEX_ADD)), int64 (uint64 bits). Each inner mix runs
    on its own operand's shape (key [R, 1] against index [1, N] mixes R keys and N indices once; only the last fmix64
    runs on the broadcast [R, N]).

    Why distinct keys give unrelated arrays: with K = fmix64(key ^ c) and g(i) = fmix64(i * m + a) (a bijection of
    uint64 that scrambles [0, N)), keys k != k' give the same number at i and j only where g(i) ^ g(j) == K ^ K',
    about N**2 / 2**64 pairs of a window [0, N)."""
    k = _fmix64_(key.to(torch.int64) ^ _i64(KEY_SALT))
    g = index.to(torch.int64) * _i64(INDEX_MUL)  # a fresh tensor: the mixes below run in place
    g += _i64(INDEX_ADD)
    return _fmix64_(_fmix64_(g) ^ k)


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, 53 bits: (2 * (bits >> 12) + 1) * 2**-53 (module docstring); key int64 [R, 1] or
    [R], index int64 broadcastable. Never 0 or 1; the smallest is 2**-53, the largest 1 - 2**-53."""
    return uniform_of_(_bits(key, index))


def uniform_of_(h: torch.Tensor) -> torch.Tensor:
    """The uniforms of hash bits ``h`` (int64, overwritten: the result is a float64 view of its memory)."""
    # 1 + n * 2**-52 by its bits (n = bits >> 12 < 2**52), then exact float steps: (2n + 1) * 2**-53, all in place
    h >>= 12
    h &= _M52
    h |= _ONE
    return h.view(torch.float64).sub_(1.0).add_(2.0**-53)


def gumbel_of_(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise float32 = -log(-log(u)) from float64 uniforms ``u`` (overwritten): float64 logs, one
    rounding to float32. Every sampler's noise goes through here (the kernel does the same steps)."""
    return u.log_().neg_().log_().neg_().to(torch.float32)


# entries of the int64 / float64 temporaries of one piece of a CPU gumbel call (in cache: ~3x faster than one pass)
_CPU_PIECE = 1 << 18


def gumbel(key: torch.Tensor, shape_last: int) -> torch.Tensor:
    """Gumbel(0, 1) noise float32 [R, shape_last] for per-request keys [R], indexed 0..shape_last-1. On the CPU in
    pieces of about :data:`_CPU_PIECE` entries (the same numbers; temporaries bounded by a piece)."""
    R, N, dev = key.shape[0], shape_last, key.device
    idx = torch.arange(N, dtype=torch.int64, device=dev)
    if dev.type != "cpu" or R * N <= _CPU_PIECE:
        return gumbel_of_(uniform(key[:, None], idx[None, :]))
    out = torch.empty(R, N, dtype=torch.float32, device=dev)
    cols = min(N, _CPU_PIECE)
    rows = max(1, _CPU_PIECE // cols)
    for a in range(0, R, rows):
        for b in range(0, N, cols):
            out[a : a + rows, b : b + cols] = gumbel_of_(uniform(key[a : a + rows, None], idx[None, b : b + cols]))
    return out


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit request seed from a user seed and a request index (splitmix64), distinct for distinct pairs."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1
