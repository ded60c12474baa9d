"""What a distilled draft adds to its target, and how to rebuild the full draft folder from the two.

A distilled draft = the target's token embedding, final norm and LM head (frozen, shared) + its own decoder layers.
Only the layers need to be kept (committed, shipped): ``export_artifact`` writes

    <artifact>/layers.safetensors   the draft's decoder layers, float16, HF names (model.layers.<i>.*)
    <artifact>/draft.json           how the draft was made (target fingerprint, settings, corpus, time, results)

and ``assemble(target_dir, artifact_dir, out_dir)`` rebuilds the standard HF folder (config.json,
model.safetensors, tokenizer files) from the target folder + artifact. Training stores the layers rounded to float16
values (in float32), so the assembled folder equals the trained one bit for bit.

The target is identified by :func:`target_fingerprint`: a SHA-256 over the architecture fields that matter and the
bytes (float32) of the shared tensors. ``assemble`` refuses a target whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

ARTIFACT_FORMAT = 1
LAYERS_FILE = "layers.safetensors"
ARTIFACT_JSON = "draft.json"
DISTILL_JSON = "distill.json"
_ARCH_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _umask_modes(folder: pathlib.Path) -> None:
    """Gives ``folder``'s files the modes the umask gives new files (mkdtemp and safetensors make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def shared_tensors(model: Any) -> dict[str, Any]:
    """The target tensors a draft reuses: token embedding, final norm, LM head (when not tied)."""
    out = {"model.embed_tokens.weight": model.model.embed_tokens.weight, "model.norm.weight": model.model.norm.weight}
    lm = getattr(model, "lm_head", None)
    if lm is not None and lm.weight is not model.model.embed_tokens.weight:
        out["lm_head.weight"] = lm.weight
    return out


def target_fingerprint(model: Any) -> str:
    import torch

    h = hashlib.sha256()
    cfg = model.config.to_dict()
    h.update(json.dumps({k: cfg.get(k) for k in _ARCH_FIELDS}, sort_keys=True, default=str).encode())
    for name, t in sorted(shared_tensors(model).items()):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def copy_tokenizer_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def layer_state(draft: Any) -> dict[str, Any]:
    """The draft's own tensors (its decoder layers), with HF checkpoint names."""
    return {f"model.layers.{k}": v for k, v in draft.model.layers.state_dict().items()}


def check_target_dir(target_dir: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(target_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"target folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target folder {str(path)!r} has no config.json (not a HF model folder)")
    return path


def export_artifact(draft_dir: str | os.PathLike, artifact_dir: str | os.PathLike) -> pathlib.Path:
    """Writes the artifact (float16 layers + draft.json) of a trained draft folder made by ``python -m
    vllm_dsbd.distill``. Raises if the layers are not float16 values (then assembly could not be exact)."""
    import torch
    from safetensors.torch import load_file, save_file

    draft_dir = pathlib.Path(draft_dir).expanduser()
    meta_path = draft_dir / DISTILL_JSON
    if not meta_path.is_file():
        raise FileNotFoundError(f"{draft_dir} has no {DISTILL_JSON}: not a draft made by vllm_dsbd.distill")
    meta = json.loads(meta_path.read_text())
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {draft_dir}")
    layers = {}
    for f in files:
        layers.update({k: v for k, v in load_file(str(f)).items() if k.startswith("model.layers.")})
    out = {}
    for k, v in sorted(layers.items()):
        h = v.to(torch.float16)
        if not torch.equal(h.to(v.dtype), v):
            raise ValueError(f"{k} holds values that are not float16: the artifact would not rebuild this draft exactly")
        out[k] = h.contiguous()
    artifact_dir = pathlib.Path(artifact_dir).expanduser()
    artifact_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(artifact_dir / LAYERS_FILE), metadata={"format": str(ARTIFACT_FORMAT)})
    info = {"format": ARTIFACT_FORMAT, "num_hidden_layers": meta["num_hidden_layers"],
            "target_fingerprint": meta["target_fingerprint"], "layers_file": LAYERS_FILE,
            "layers_sha256": hashlib.sha256((artifact_dir / LAYERS_FILE).read_bytes()).hexdigest(),
            "rebuild": "python -m vllm_dsbd.distill assemble --target TARGET_DIR --artifact THIS_DIR --out OUT_DIR"}
    info.update({k: v for k, v in meta.items() if k not in info})
    (artifact_dir / ARTIFACT_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    _umask_modes(artifact_dir)
    return artifact_dir


def save_draft_folder(draft: Any, target_dir: pathlib.Path, out_dir: pathlib.Path, meta: dict) -> pathlib.Path:
    """Saves ``draft`` as a standard HF folder (config, float32 weights, tokenizer files of the target, the
    target's generation config, distill.json), written in a temporary folder beside ``out_dir`` and moved in."""
    out_dir = pathlib.Path(out_dir).expanduser()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        draft.save_pretrained(str(tmp))
        copy_tokenizer_files(target_dir, tmp)
        (tmp / DISTILL_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _umask_modes(tmp)
        out_dir.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def assemble(target_dir: str | os.PathLike, artifact_dir: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Rebuilds the full draft folder from the target folder and an artifact written by :func:`export_artifact`.

    The result loads with ``transformers.AutoModelForCausalLM`` and in vLLM as a draft model, and equals the trained
    draft folder bit for bit (same tensors, same config)."""
    import torch
    from safetensors.torch import load_file

    from ..testing import models

    target_dir = check_target_dir(target_dir)
    artifact_dir = pathlib.Path(artifact_dir).expanduser()
    info_path = artifact_dir / ARTIFACT_JSON
    if not info_path.is_file():
        raise FileNotFoundError(f"{artifact_dir} has no {ARTIFACT_JSON}: not a draft artifact")
    info = json.loads(info_path.read_text())
    if info.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"artifact format {info.get('format')!r} is not supported (expected {ARTIFACT_FORMAT})")
    target = models.load_hf(target_dir, dtype=torch.float32)
    fp = target_fingerprint(target)
    if fp != info["target_fingerprint"]:
        raise ValueError(f"{target_dir} is not the target this draft was made for (fingerprint {fp[:12]}..., "
                         f"artifact expects {info['target_fingerprint'][:12]}...)")
    n = int(info["num_hidden_layers"])
    draft = models.truncated_draft(target, n)
    layers = load_file(str(artifact_dir / info.get("layers_file", LAYERS_FILE)))
    prefix = "model.layers."
    state = {k[len(prefix):]: v.to(torch.float32) for k, v in layers.items()}
    missing, unexpected = draft.model.layers.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"artifact layers do not match a {n}-layer draft: missing {missing}, unexpected {unexpected}")
    meta = {k: v for k, v in info.items() if k not in ("format", "layers_file", "layers_sha256", "rebuild")}
    meta["assembled_from_artifact"] = str(artifact_dir)
    meta["artifact_layers_sha256"] = info.get("layers_sha256")  # lets a cached assembly notice a newer artifact
    return save_draft_folder(draft, target_dir, pathlib.Path(out_dir), meta)
