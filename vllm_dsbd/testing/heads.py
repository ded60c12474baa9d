"""A random EAGLE-3 head for a Llama target, written in the public EAGLE-3 folder format (tests, benchmarks).

The format of the public heads (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``config.json`` with
``architectures: ["LlamaForCausalLMEagle3"]``, the target's Llama shape with ``num_hidden_layers: 1`` and a
``draft_vocab_size``; ``model.safetensors`` with ``midlayer.*`` (one decoder layer whose q/k/v projections take
2 * hidden: concat(embed, hidden), and a ``hidden_norm``), ``fc.weight`` ([hidden, 3 * hidden]: the target's three
auxiliary hidden states), ``norm.weight``, ``lm_head.weight`` ([draft vocab, hidden]), ``d2t`` (draft id -> target id
offset, int64) and ``t2d`` (target ids in the draft vocabulary, bool). No embedding: vLLM shares the target's.
"""
from __future__ import annotations

import json
import os
import pathlib


def head_folder(target: str | os.PathLike, folder: str | os.PathLike, draft_vocab: int, seed: int = 0,
                std: float = 0.05, aux_layers: list[int] | None = None, bigram: float | None = None) -> pathlib.Path:
    """Writes (or rewrites) a random EAGLE-3 head for the Llama ``target`` into ``folder`` and returns it. Its draft
    vocabulary: ``draft_vocab`` target ids drawn at random (sorted), its LM head those ids' rows of the target's (a
    plausible law over them); other weights ``N(0, std)``, norms 1. ``aux_layers``: written as
    ``eagle_aux_hidden_state_layer_ids`` (None: vLLM's default for the target).

    ``bigram``: instead a head that computes the target's zero-layer law (``lm_head(norm(embed(token)))``, its logits
    times ``bigram``) from the node's own token: q and k read the embedding half of the input (scaled so each row
    attends to its own token), v and o copy it, the MLP adds nothing, and ``norm_before_residual`` with a zero
    ``hidden_norm`` drops the hidden input. It agrees with a target whose layers add nothing (:func:`bigram_target`),
    whatever features it is fed."""
    import torch
    from safetensors.torch import load_file, save_file

    target = pathlib.Path(target)
    cfg = json.loads((target / "config.json").read_text())
    H, V, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or H // heads
    if not 0 < draft_vocab <= V:
        raise ValueError(f"draft_vocab must be in [1, {V}], got {draft_vocab}")
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    head_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"), "hidden_act": cfg.get("hidden_act", "silu"),
        "hidden_size": H, "intermediate_size": inter, "initializer_range": 0.02,
        "max_position_embeddings": cfg["max_position_embeddings"], "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": cfg.get("rope_theta", 10000.0), "tie_word_embeddings": False, "torch_dtype": "float32",
        "use_cache": True, "vocab_size": V, "draft_vocab_size": draft_vocab,
    }
    if aux_layers is not None:
        head_cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2) + "\n")
    weights = {}
    for f in sorted(target.glob("*.safetensors")):
        weights.update(load_file(f))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * std

    t = {
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, H),
        "midlayer.mlp.up_proj.weight": rnd(inter, H),
        "midlayer.mlp.down_proj.weight": rnd(H, inter),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "fc.weight": rnd(H, 3 * H) * 4,
        "norm.weight": torch.ones(H),
        "lm_head.weight": weights["lm_head.weight"][ids].clone().float(),
        "d2t": (ids - torch.arange(draft_vocab)).to(torch.int64),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if bigram is not None:
        if heads * hd != H or kv != heads:
            raise ValueError("a bigram head needs heads * head_dim == hidden and no GQA")
        eye = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)  # reads the embedding half of concat(embed, hidden)
        t["midlayer.self_attn.q_proj.weight"] = 2.0 * eye
        t["midlayer.self_attn.k_proj.weight"] = 2.0 * eye
        t["midlayer.self_attn.v_proj.weight"] = eye.clone()
        t["midlayer.self_attn.o_proj.weight"] = torch.eye(H)
        t["midlayer.mlp.down_proj.weight"] = torch.zeros(H, inter)
        t["midlayer.hidden_norm.weight"] = torch.zeros(H)
        t["norm.weight"] = weights["model.norm.weight"].clone().float()
        t["lm_head.weight"] = t["lm_head.weight"] * bigram
        head_cfg["norm_before_residual"] = True
        (out / "config.json").write_text(json.dumps(head_cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out


def bigram_target(source: str | os.PathLike, folder: str | os.PathLike, scale: float = 1.0) -> pathlib.Path:
    """A copy of the Llama folder ``source`` in ``folder`` whose layers add nothing to the residual stream (attention
    ``o_proj`` and MLP ``down_proj`` zero): its next-token law is its zero-layer one, which a ``bigram`` head
    (:func:`head_folder`) computes; its LM head times ``scale`` (< 1: flatter laws). Returns ``folder``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = pathlib.Path(folder)
    shutil.copytree(source, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder



def draft_ids(folder: str | os.PathLike) -> list[int]:
    """The target ids of a head's draft vocabulary (from its ``d2t``)."""
    import torch
    from safetensors.torch import load_file

    d2t = load_file(str(pathlib.Path(folder) / "model.safetensors"))["d2t"]
    return (torch.arange(d2t.shape[0]) + d2t).tolist()
