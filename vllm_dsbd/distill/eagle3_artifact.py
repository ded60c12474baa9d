"""The committed form of a trained EAGLE-3 head: everything but its LM head, which is the target's rows.

A head trained by ``eagle3_train.py`` keeps the target's LM head rows of its draft vocabulary, frozen, rounded to
float16. ``export_head_artifact`` writes

    <artifact>/head.safetensors   midlayer.*, fc.weight, norm.weight (float16), d2t (int64), t2d (bool)
    <artifact>/head.json          target fingerprint, config.json of the head, how it was trained

and ``assemble_head(target_dir, artifact_dir, out_dir)`` rebuilds the public head folder (config.json +
model.safetensors with ``lm_head.weight``), equal to the trained folder tensor for tensor. ``python -m
vllm_dsbd.distill assemble`` calls it for a folder holding ``head.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import torch

from . import artifact as art
from . import eagle3

HEAD_FILE = "head.safetensors"
HEAD_JSON = "head.json"
FORMAT = 1


def is_head_artifact(path: str | os.PathLike) -> bool:
    return (pathlib.Path(path).expanduser() / HEAD_JSON).is_file()


def export_head_artifact(head_dir: str | os.PathLike, artifact_dir: str | os.PathLike) -> pathlib.Path:
    from safetensors.torch import load_file, save_file

    head_dir = pathlib.Path(head_dir).expanduser()
    meta_path = head_dir / "distill.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{head_dir} has no distill.json: not a head made by vllm_dsbd.distill --head eagle3")
    meta = json.loads(meta_path.read_text())
    sd = load_file(str(head_dir / eagle3.WEIGHTS_FILE))
    sd.pop("lm_head.weight")
    out = pathlib.Path(artifact_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(sd.items())}, str(out / HEAD_FILE), metadata={"format": str(FORMAT)})
    info = {"format": FORMAT, "config": json.loads((head_dir / "config.json").read_text()),
            "target_fingerprint": meta["target_fingerprint"],
            "head_sha256": hashlib.sha256((out / HEAD_FILE).read_bytes()).hexdigest(),
            "rebuild": "python -m vllm_dsbd.distill assemble --target TARGET_DIR --artifact THIS_DIR --out OUT_DIR",
            "training": {k: v for k, v in meta.items() if k != "target"}}
    (out / HEAD_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    art._umask_modes(out)
    return out


def assemble_head(target_dir: str | os.PathLike, artifact_dir: str | os.PathLike,
                  out_dir: str | os.PathLike) -> pathlib.Path:
    """The public head folder from the target and the artifact (refuses another target)."""
    from safetensors.torch import load_file

    from ..testing import models

    target_dir = art.check_target_dir(target_dir)
    artifact_dir = pathlib.Path(artifact_dir).expanduser()
    info = json.loads((artifact_dir / HEAD_JSON).read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"head artifact format {info.get('format')!r} is not supported (expected {FORMAT})")
    target = models.load_hf(target_dir, dtype=torch.float32)
    fp = art.target_fingerprint(target)
    if fp != info["target_fingerprint"]:
        raise ValueError(f"{target_dir} is not the target this head was trained for (fingerprint {fp[:12]}..., "
                         f"artifact expects {info['target_fingerprint'][:12]}...)")
    c = eagle3.Eagle3Config.from_hf(info["config"])
    sd = load_file(str(artifact_dir / HEAD_FILE))
    head = eagle3.Eagle3Head(c)
    ids = torch.arange(c.draft_vocab_size) + sd["d2t"].long()
    rows = target.get_output_embeddings().weight.detach()[ids].to(torch.float16).float()
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    sd["lm_head.weight"] = rows
    head.load_state_dict(sd, strict=True)
    out = eagle3.save_head(head, out_dir, dtype=getattr(torch, info["config"].get("torch_dtype", "float16")))
    meta = dict(info["training"], target=str(target_dir), assembled_from_artifact=str(artifact_dir))
    (out / "distill.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out
