"""From a verification result to what an iteration emits: the new live beams and the beams that finished."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .forest import Forest
from .params import BatchParams
from .verify import VerifyResult


def node_paths(forest: Forest, slot: torch.Tensor, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root slot and tokens of the forest paths ending at (depth, slot).

    slot: [R, K] int64 node slots at depth ``depth`` [R] (depth 0 means the slot is a root).
    Returns (root [R, K] int64, tokens [R, K, G] int64 with the path's tokens at depths 1..depth, 0 beyond)."""
    R, K = slot.shape
    G = forest.max_depth
    toks = torch.zeros(R, K, G, dtype=torch.int64, device=slot.device)
    for lvl in range(G, 0, -1):
        on = (lvl <= depth)[:, None]
        s = slot.clamp(0, forest.token.shape[2] - 1)
        toks[:, :, lvl - 1] = torch.where(on, forest.token[:, lvl - 1].gather(1, s), 0)
        slot = torch.where(on, forest.parent[:, lvl - 1].gather(1, s), slot)
    return slot, toks


@dataclass
class Emitted:
    """Beams of R requests emitted by one iteration; each is root beam + ``tokens[:length]``."""

    root: torch.Tensor  # [R, K] int64 root slot the beam extends
    tokens: torch.Tensor  # [R, K, G + 1] int64
    length: torch.Tensor  # [R, K] int64 tokens added to the root
    score: torch.Tensor  # [R, K] float32 cumulative score
    valid: torch.Tensor  # [R, K] bool


def iteration_outputs(forest: Forest, res: VerifyResult, params: BatchParams,
                      finished: bool = True) -> tuple[Emitted, Emitted]:
    """(live, finished) beams after an iteration.

    live: the non-EOS outputs of the last processed layer (single-beam mode: its first output only).
    finished: EOS outputs of every processed layer, and (full-width deterministic rows) the EOS candidates of vLLM's
    rule; in single-beam mode only the emitted beam can finish. ``finished=False``: not computed (returned empty),
    for a caller that needs them only when a live beam is missing."""
    rec = res.layers
    R, L, wm = rec.token.shape
    dev = rec.token.device
    is_eos = (params.eos >= 0)[:, None, None] & (rec.token == params.eos[:, None, None]) & rec.valid
    single = params.single[:, None]

    def emit(layer: int, slot: torch.Tensor, token: torch.Tensor, score, valid) -> Emitted:
        d = torch.full((R,), layer, dtype=torch.int64, device=dev)
        root, toks = node_paths(forest, slot, d)
        toks = torch.nn.functional.pad(toks, (0, 1))
        toks[:, :, layer] = token
        return Emitted(root, toks, torch.full_like(slot, layer + 1), score, valid)

    done = []
    at_last = torch.arange(L, device=dev)[None, :] == res.last[:, None]  # [R, L]
    first = torch.zeros(R, wm, dtype=torch.bool, device=dev)
    first[:, 0] = True
    for layer in range(L if finished else 0):
        if not bool(rec.processed[:, layer].any()):
            break
        take = is_eos[:, layer] & (~single | (first & at_last[:, layer, None]))
        done.append(emit(layer, rec.parent[:, layer], rec.token[:, layer], rec.score[:, layer], take))
        ed = rec.eos_done[:, layer]
        if bool(ed.any()):
            slots = torch.arange(ed.shape[1], device=dev)[None, :].expand(R, -1)
            done.append(emit(layer, slots, params.eos.clamp(min=0)[:, None].expand_as(slots),
                             rec.eos_score[:, layer], ed))
    # live beams: gather the last layer's outputs
    li = res.last
    pick = lambda t: t[torch.arange(R, device=dev), li]  # noqa: E731
    valid = pick(rec.valid) & ~pick(is_eos) & (~single | first)
    root, toks = node_paths(forest, pick(rec.parent), li)
    toks = torch.nn.functional.pad(toks, (0, 1))
    toks.scatter_(2, li[:, None, None].expand(R, wm, 1), pick(rec.token)[:, :, None])
    live = Emitted(root, toks, (li + 1)[:, None].expand(R, wm).clone(), pick(rec.score), valid)
    return live, _cat(done, live)


def _cat(parts: list[Emitted], like: Emitted) -> Emitted:
    if not parts:
        z = like.valid[:, :0]
        return Emitted(like.root[:, :0], like.tokens[:, :0], like.length[:, :0], like.score[:, :0], z)
    g = max(p.tokens.shape[2] for p in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, g - t.shape[2]))  # noqa: E731
    return Emitted(torch.cat([p.root for p in parts], 1), torch.cat([pad(p.tokens) for p in parts], 1),
                   torch.cat([p.length for p in parts], 1), torch.cat([p.score for p in parts], 1),
                   torch.cat([p.valid for p in parts], 1))
