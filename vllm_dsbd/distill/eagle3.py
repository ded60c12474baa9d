"""An EAGLE-3 draft head in pure torch, computing what vLLM's ``Eagle3LlamaForCausalLM`` computes, and its folder.

The head drafts from the target's features: ``fc`` maps the concatenation of the target's residual stream after
layers ``aux_layer_ids`` (vLLM's default for a Llama of L layers: (2, L // 2, L - 3)) to the hidden size; one Llama
decoder layer ("midlayer") attends over concat(input_layernorm(embed(token)), hidden_norm(hidden)) (2 x hidden
inputs to q/k/v); the residual is the raw ``hidden``; a final norm; an LM head over a *draft vocabulary* of
``draft_vocab_size`` target tokens, mapped by ``d2t`` (target id = draft id + d2t[draft id]) and ``t2d`` (bool over
the target vocabulary). Position t takes the target's features at t and the token at t + 1 and predicts the token at
t + 2; deeper drafts feed back the head's own pre-norm hidden state (vLLM's ``aux_output``), as vLLM's proposer does.

The folder is the public one vLLM loads (``config.json`` with architectures ["LlamaForCausalLMEagle3"],
``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``; ``model.safetensors`` with ``midlayer.*``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; no ``embed_tokens``: vLLM shares the target's).
The embedding is the target's, passed in (``embed``), never stored.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_target_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 auxiliary layers (``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``): the
    residual stream entering layer 2, L // 2 and L - 3 (= HF ``output_hidden_states[i]``)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 15, 27])
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def for_target(cls, tcfg: Any, draft_vocab_size: int) -> "Eagle3Config":
        """A head shaped like one decoder layer of the target (HF config ``tcfg``)."""
        rope = getattr(tcfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))
        hd = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                   num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                   head_dim=hd, vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab_size,
                   aux_layer_ids=default_aux_layers(tcfg.num_hidden_layers), target_hidden_size=tcfg.hidden_size,
                   rms_norm_eps=float(tcfg.rms_norm_eps), rope_theta=float(theta),
                   max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 8192)))

    def to_hf(self) -> dict:
        """config.json in the public EAGLE-3 head format."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "num_hidden_layers": 1,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size or self.hidden_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
                "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                 "use_aux_hidden_state": True},
                "torch_dtype": "float16"}

    @classmethod
    def from_hf(cls, d: dict) -> "Eagle3Config":
        arch = d.get("architectures") or []
        if not any("eagle3" in a.lower() for a in arch):
            raise ValueError(f"not an EAGLE-3 head config (architectures {arch})")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError("only one-layer EAGLE-3 heads are supported")
        for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "attention_bias"):
            if d.get(k) or (d.get("eagle_config") or {}).get(k):
                raise ValueError(f"EAGLE-3 head variant {k!r} is not supported")
        rope = d.get("rope_parameters") or {}
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or d.get(
            "eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ValueError("the head config must name its auxiliary layers (eagle_aux_hidden_state_layer_ids)")
        hd = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]), head_dim=hd,
                   vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   aux_layer_ids=list(ids), target_hidden_size=d.get("target_hidden_size"),
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                   rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                   max_position_embeddings=int(d.get("max_position_embeddings", 8192)))


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (forward_native): float32 statistics, weight applied in the input dtype."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's default / HF rotate_half) of ``x`` [B, H, T, hd] at ``positions`` [B, T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    f = positions.float()[:, None, :, None] * inv  # [B, 1, T, hd/2]
    cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        D, H, Hk, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * D, H * hd, bias=False)
        self.k_proj = nn.Linear(2 * D, Hk * hd, bias=False)
        self.v_proj = nn.Linear(2 * D, Hk * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, H, T, hd], k and v [B, Hk, T, hd] of ``x`` [B, T, 2D], rotary applied to q and k."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """o_proj(softmax(q k^T / sqrt(hd), masked) v): ``mask`` [B or 1, T, S] bool, True = attend."""
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        B, H, T, hd = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * hd))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """The head; ``embed`` is the target's token embedding [V, D] (a frozen tensor, not a parameter of the head)."""

    def __init__(self, c: Eagle3Config, embed: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        Dt = c.target_hidden_size or c.hidden_size
        self.fc = nn.Linear(len(c.aux_layer_ids) * Dt, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed = embed

    # --- vocabulary -------------------------------------------------------------------------------------------
    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``target_ids`` (distinct, ascending) -> d2t offsets and the t2d mask."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # --- forward ----------------------------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """vLLM's ``combine_hidden_states``: fc over the concatenated auxiliary hidden states [.., 3 Dt]."""
        return self.fc(aux)

    def layer_input(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """(attention q/k/v for the new positions, residual): the layer's first half up to the projections."""
        L = self.midlayer
        e = L.input_layernorm(self.embed[input_ids].to(hidden.dtype))
        x = torch.cat([e, L.hidden_norm(hidden)], -1)
        return L.self_attn.qkv(x, positions), hidden

    def layer_output(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """(normed hidden for the LM head, pre-norm hidden fed to the next depth) after the attention output."""
        L = self.midlayer
        residual = attn_out + residual
        h = L.mlp(L.post_attention_layernorm(residual))
        pre = h + residual
        return self.norm(pre), pre

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None):
        """vLLM's ``Eagle3LlamaForCausalLM.forward`` for a batch: ``input_ids`` [B, T], ``hidden`` [B, T, D] (the
        fc-combined target features, or the previous depth's pre-norm output), ``positions`` [B, T]; ``past`` the
        (k, v) [B, Hk, S, hd] of earlier positions; ``mask`` [B or 1, T, S + T] (default: all of past, causal
        among the new). Returns (normed hidden, pre-norm hidden, (k, v) including the new positions)."""
        (q, k, v), residual = self.layer_input(input_ids, hidden, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        T, S = q.shape[2], k.shape[2]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None]
        out, pre = self.layer_output(self.midlayer.self_attn.attend(q, k, v, mask), residual)
        return out, pre, (k, v)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd]."""
        return self.lm_head(normed)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """vLLM's ``compute_logits``: logits over the target vocabulary, -inf outside the draft vocabulary."""
        z = self.logits(normed)
        out = z.new_full((*z.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.target_ids] = z
        return out

    def macs_per_token(self) -> int:
        """Multiply-adds of one drafted token (fc for a root, the layer, the draft-vocabulary LM head)."""
        return sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2)


# ----------------------------------------------------------------------------------------------------------------
# folder
# ----------------------------------------------------------------------------------------------------------------
def head_state(head: Eagle3Head, dtype: torch.dtype = torch.float16, lm_head: bool = True) -> dict:
    sd = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    if not lm_head:
        sd.pop("lm_head.weight")
    sd["d2t"] = head.d2t.detach().clone()
    sd["t2d"] = head.t2d.detach().clone()
    return sd


def save_head(head: Eagle3Head, out_dir: str | os.PathLike, extra: dict | None = None,
              dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Writes the public folder: config.json + model.safetensors (``dtype`` weights, d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_hf()
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    if extra:
        cfg["dsbd"] = extra
    save_file(head_state(head, dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    from .artifact import _umask_modes

    _umask_modes(out)  # safetensors writes private files
    return out


def is_head_folder(path: str | os.PathLike) -> bool:
    p = pathlib.Path(path) / "config.json"
    if not p.is_file():
        return False
    return any("eagle3" in a.lower() for a in json.loads(p.read_text()).get("architectures") or [])


def load_head(path: str | os.PathLike, embed: torch.Tensor, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head folder (ours or a public one of this variant) with the target's embedding ``embed``."""
    from safetensors.torch import load_file

    path = pathlib.Path(path).expanduser()
    c = Eagle3Config.from_hf(json.loads((path / "config.json").read_text()))
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    sd.pop("embed_tokens.weight", None)
    head = Eagle3Head(c, embed=None)
    if "d2t" not in sd:  # no draft vocabulary: the full target vocabulary
        sd["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    if "t2d" not in sd:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + sd["d2t"].long()] = True
        sd["t2d"] = t2d
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    missing, unexpected = head.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: not an EAGLE-3 head of this shape (missing {missing}, unexpected {unexpected})")
    head.embed = embed.detach().to(dtype)
    return head.eval()


def init_from_target(head: Eagle3Head, target: Any, seed: int = 0) -> None:
    """A starting point: the midlayer's MLP, norms and attention output from the target's last layer, q/k/v with
    the target's weights on the hidden half (zeros on the embedding half), fc as an average of the aux features, the
    LM head from the target's rows of the draft vocabulary, the final norm from the target's."""
    g = torch.Generator().manual_seed(seed)
    src = target.model.layers[-1]
    D = head.config.hidden_size
    n_aux = len(head.config.aux_layer_ids)
    with torch.no_grad():
        m = head.midlayer
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        m.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        m.hidden_norm.weight.copy_(src.input_layernorm.weight)
        m.input_layernorm.weight.copy_(target.model.layers[0].input_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight
            dst = getattr(m.self_attn, name).weight
            dst[:, :D].normal_(0, 0.02 / math.sqrt(2), generator=g)
            dst[:, D:].copy_(w)
        m.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        head.fc.weight.zero_()
        for i in range(n_aux):
            head.fc.weight[:, i * D:(i + 1) * D] += torch.eye(D) / n_aux
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=g) * 0.002)
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.target_ids])
