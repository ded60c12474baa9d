"""The SmolLM2-135M draft of the demo, the benchmarks and the SmolLM2 tests, offline: the distilled draft when its
artifact is committed in the repository's ``drafts/`` folder, else the target's first layers, untrained."""
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


def draft_folder(target: Path, n_layers: int, root: Path | None = None) -> tuple[Path, str]:
    """The best draft available offline: the distilled one if its artifact is committed, else truncated layers.
    The artifacts are looked for in ``root``'s ``drafts/`` (default: the checkout this package runs from, an editable
    install, else the working directory: a non-editable install on the GPU machine runs from the repository root)."""
    roots = [root] if root is not None else [Path(__file__).resolve().parents[2], Path.cwd()]
    root = next((r for r in roots if (r / "drafts").is_dir()), roots[0])
    artifacts = sorted((root / "drafts").glob("smollm2-*")) if (root / "drafts").exists() else []
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
