"""The target (or a draft) as the reference decoder's callable, with per-sequence KV reuse (:class:`PrefixCachedLM`).

Used by ``evaluate.measure_acceptance`` (a draft model) and ``eagle3_eval.measure_head_acceptance`` (an EAGLE-3 head)
alike, so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import torch


class PrefixCachedLM:
    """``f(ids [B, T]) -> next-token logits [B, V]`` (float32) over a HF causal LM, with per-sequence KV reuse.

    A lane is created by a sequence that extends no lane's base; a lane is reused for a sequence sharing at least its
    base (the sequence that created it, e.g. a prompt), so requests never evict each other. At most ``max_lanes``
    lanes are kept (least recently used dropped)."""

    def __init__(self, model: Any, max_lanes: int = 256):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_lanes = max_lanes
        self.lanes: list[dict] = []  # {"base": int, "tokens": list[int], "cache": DynamicCache, "used": int}
        self.clock = 0
        self.tokens_fed = 0

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"expected token ids of shape [B, T] with T >= 1, got {tuple(ids.shape)}")
        out = []
        for row in ids.tolist():
            self.clock += 1
            best, best_c = None, -1
            for lane in self.lanes:
                c = self._common(lane["tokens"], row)
                if c >= lane["base"] and c > best_c:
                    best, best_c = lane, c
            if best is None:
                best = {"base": len(row) - 1, "tokens": [], "cache": DynamicCache()}
                best_c = 0
                self.lanes.append(best)
                if len(self.lanes) > self.max_lanes:
                    self.lanes.remove(min(self.lanes, key=lambda ln: ln["used"]))
            keep = min(best_c, len(row) - 1)
            have = best["cache"].get_seq_length()
            if keep == 0:
                best["cache"] = DynamicCache()
            elif have > keep:
                best["cache"].crop(-(have - keep))
            feed = torch.tensor([row[keep:]], device=self.device)
            pos = torch.arange(keep, len(row), device=self.device)[None]
            o = self.model(input_ids=feed, position_ids=pos, past_key_values=best["cache"], use_cache=True,
                           logits_to_keep=1)
            self.tokens_fed += len(row) - keep
            best["tokens"] = row
            best["used"] = self.clock
            out.append(o.logits[0, -1].float())
        return torch.stack(out)
