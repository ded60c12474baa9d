"""EAGLE-3 heads as the draft of a DSBD engine: recognising one, and the target features that feed it.

A head (vLLM's ``Eagle3LlamaForCausalLM``: one decoder layer over concat(embed(token), hidden), ``fc`` over the
target's auxiliary hidden states of three layers, a draft vocabulary mapped to target ids by ``d2t``) drafts a
forest node from its token and one hidden state: the target's (``combine_hidden_states``: ``fc`` of the three
auxiliary states) when the node's parent is a verified token, else the head's own (pre-norm) output at the parent
node, as EAGLE does. A draft row at position p (token t_p) takes the hidden state of position p - 1, so the head's
rows sit at the positions and slots the draft model's would (vLLM's EagleProposer runs the same rows one position
earlier, which rotary attention does not see, and has no row for position 0). Position 0 and prompt positions
without the target's features (prefix-cache hits) get a zero feature: a weaker draft, never a wrong law.

:class:`Features` keeps each plain request's combined target features for the positions its next catch-up pass
needs (``RequestState.head_features``), filled from every target pass (prefill chunks included) and trimmed after
each drafting call; beam requests keep theirs by slot (:class:`SlotFeatures`). Design: docs/design/forests.md
("EAGLE-3 heads as the draft").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the architectures vLLM's registry maps to an EAGLE-3 Llama head (model_executor/models/registry.py)
HEAD_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def is_head(hf_config) -> bool:
    """Whether a draft's Hugging Face config is an EAGLE-3 head vLLM loads as ``Eagle3LlamaForCausalLM``."""
    archs = getattr(hf_config, "architectures", None) or []
    return any(a in HEAD_ARCHS for a in archs)


def is_head_checkpoint(model: str, revision: str | None = None) -> bool:
    """Whether the checkpoint ``model`` (a folder or a Hub id) declares an EAGLE-3 head architecture in its
    ``config.json`` (False when it cannot be read: vLLM's own loading then reports the problem)."""
    from transformers import PretrainedConfig

    try:
        cfg, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    except Exception:  # noqa: BLE001 - not readable here; vLLM's ModelConfig raises its own error for it
        return False
    return any(a in HEAD_ARCHS for a in cfg.get("architectures") or [])


@dataclass
class Features:
    """One plain request's combined target features (``[n, H]``, on the device) for positions ``[start, start + n)``."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]

    def append(self, start: int, rows: torch.Tensor) -> "Features":
        """These features followed by ``rows`` at positions ``[start, ...)``; a gap or an overlap keeps the newer rows
        from ``start`` on (a rewind: positions past ``start`` were recomputed)."""
        if start == self.end:
            return Features(self.start, torch.cat([self.rows, rows]))
        if self.start <= start < self.end:
            return Features(self.start, torch.cat([self.rows[: start - self.start], rows]))
        return Features(start, rows)

    def window(self, lo: int, hi: int) -> torch.Tensor:
        """The features of positions ``[lo, hi)``, zeros where none is kept (position -1, prefix-cache hits)."""
        out = self.rows.new_zeros(hi - lo, self.rows.shape[1])
        a, b = max(lo, self.start), min(hi, self.end)
        if a < b:
            out[a - lo : b - lo] = self.rows[a - self.start : b - self.start]
        return out

    def trim(self, lo: int) -> "Features | None":
        """Only the positions from ``lo`` on (None when nothing is left)."""
        if lo >= self.end:
            return None
        return Features(max(lo, self.start), self.rows[max(0, lo - self.start):])


def window(feats: Features | None, lo: int, hi: int, hidden: int, device, dtype) -> torch.Tensor:
    """``feats.window(lo, hi)``, or zeros without features."""
    if feats is None:
        return torch.zeros(hi - lo, hidden, device=device, dtype=dtype)
    return feats.window(lo, hi)


class SlotFeatures:
    """A beam request's combined target features by slot (its token positions: prompt, linear prefix, trie, forest),
    zeros where the target computed none; moved with the K/V when a beam step keeps forest nodes (``_move_kv``)."""

    def __init__(self, hidden: int, device, dtype):
        self.rows = torch.zeros(0, hidden, device=device, dtype=dtype)

    def put(self, slots: list[int], rows: torch.Tensor) -> None:
        need = max(slots) + 1
        if need > self.rows.shape[0]:
            grown = self.rows.new_zeros(max(need, 2 * self.rows.shape[0]), self.rows.shape[1])
            grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[torch.tensor(slots, dtype=torch.int64, device=self.rows.device)] = rows.to(self.rows.dtype)

    def move(self, src: list[int], dst: list[int]) -> None:
        if src:
            self.put(list(dst), self.gather(list(src)))

    def gather(self, slots: list[int]) -> torch.Tensor:
        """The features of ``slots`` (zeros for a slot below 0 or never computed)."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.rows.device)
        ok = (idx >= 0) & (idx < self.rows.shape[0])
        out = self.rows.new_zeros(len(slots), self.rows.shape[1])
        out[ok] = self.rows[idx[ok]]
        return out
