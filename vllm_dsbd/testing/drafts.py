"""The SmolLM2-135M draft of the demo, the benchmarks and the SmolLM2 tests, offline: the distilled draft when its
artifact is committed in the repository's ``drafts/`` folder, else the target's first layers, untrained; and the
committed EAGLE-3 head (:func:`head_folder`), assembled from its artifact."""
from __future__ import annotations

from pathlib import Path


def _assembled_from(out: Path, artifact: Path) -> bool:
    """Whether the assembled folder ``out`` was built from this artifact's layers (a replaced artifact is rebuilt)."""
    import json

    try:
        made = json.loads((out / "distill.json").read_text()).get("artifact_layers_sha256")
        return made is not None and made == json.loads((artifact / "draft.json").read_text())["layers_sha256"]
    except (OSError, ValueError, KeyError):
        return False


def _drafts_dir(root: Path | None) -> Path:
    """``root``'s ``drafts/`` (default: the checkout this package runs from, an editable install, else the working
    directory: a non-editable install on the GPU machine runs from the repository root)."""
    roots = [root] if root is not None else [Path(__file__).resolve().parents[2], Path.cwd()]
    return next((r for r in roots if (r / "drafts").is_dir()), roots[0]) / "drafts"


HEAD_ARTIFACT = "smollm2-135m-eagle3"  # the committed EAGLE-3 head's artifact in drafts/


def head_folder(target: Path, root: Path | None = None) -> Path | None:
    """The committed EAGLE-3 head for SmolLM2-135M (vLLM's public format), assembled beside the target from
    ``drafts/smollm2-135m-eagle3`` on first use; None when that artifact is not there."""
    artifact = _drafts_dir(root) / HEAD_ARTIFACT
    if not artifact.is_dir():
        return None
    import json

    from vllm_dsbd.distill.eagle3_artifact import assemble_head

    out = target.parent / f"head-{HEAD_ARTIFACT}"
    stamp = (artifact / "head.json").read_text()
    if not (out / "config.json").exists() or not (out / "artifact.json").is_file() \
            or json.loads((out / "artifact.json").read_text()) != json.loads(stamp):
        assemble_head(target, artifact, out)
        (out / "artifact.json").write_text(stamp)
    return out


def draft_folder(target: Path, n_layers: int, root: Path | None = None) -> tuple[Path, str]:
    """The best draft available offline: the distilled one if its artifact is committed, else truncated layers
    (the artifacts: in ``drafts/`` of ``root``, :func:`_drafts_dir`; the EAGLE-3 head's is not a draft model's)."""
    drafts = _drafts_dir(root)
    artifacts = sorted(a for a in drafts.glob("smollm2-*") if a.name != HEAD_ARTIFACT) if drafts.exists() else []
    if artifacts:
        try:
            from vllm_dsbd.distill import assemble
            out = target.parent / f"draft-{artifacts[0].name}"
            if not (out / "config.json").exists() or not _assembled_from(out, artifacts[0]):
                assemble(target, artifacts[0], out)
            return out, f"distilled ({artifacts[0].name})"
        except ImportError:
            pass
    out = target.parent / f"smollm2-first{n_layers}"
    if not (out / "config.json").exists():
        from vllm_dsbd.testing import models
        model = models.truncated_draft(models.load_hf(target), n_layers)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        models.load_tokenizer(target).save_pretrained(tmp)
        tmp.rename(out)
    return out, f"first {n_layers} layers of the target, untrained"
