"""Wall-clock by forest source, the engine as a user gets it (cost model on): each source set's DSBD engine against
the same engine with ``"sources": []`` (nothing drafted, the γ = 0 engine) and against plain vLLM, side by side in one
run, on the workloads where beams are used (issue 38, item 3).

SmolLM2-135M-Instruct, float32, eager, on this machine's cores; prompt kinds of ``draftfree.py`` (code edits from
HumanEval's last problems, ShareGPT eval chats; held out from the draft's training). Per source set (``none`` =
``[]``, ``recycle``, ``lookup``, ``recycle,lookup`` = the default without a draft model, ``model`` = the committed
draft, ``head`` = the EAGLE-3 head of ``--head``; ``model,recycle,lookup`` / ``head,recycle,lookup``: the draft or
head mixed with the draft-free sources, ``engine/mixing.py``) one engine (width 4, depth 3, cost model ``"auto"``), and per kind:

- **greedy b1**: plain requests at T = 0 one at a time (``dsbd_width`` 2, as the demo), tokens per second and
  tokens per target pass (``vllm:dsbd_target_passes``);
- **greedy N in one call**: the same prompts in one call;
- **T=1 b1** (with ``--sampled``): plain requests at T = 1 one at a time (the engine's width), tokens per second and
  per target pass;
- **beams**: ``LLM.beam_search`` W = 4, T = 0 (beams inside the DSBD engine; the median of ``--beam-calls`` calls),
  best-beam tokens per second and target passes per beam step (``vllm:dsbd_beam_*``); beams compared with vLLM's
  own loop on the plain engine.

Every timed call follows a warm-up call of the same shape; with ``--repeats`` the engines run again in alternating
order and each row keeps its fastest run; each row has its wall time and this process's CPU time
(the engine runs in it; on a shared machine the steadier of the two). Results: a table on stdout, ``--out``/README.md, the rows in
``--out``/rows.json and a plot of each row's tokens per CPU-second over the ``none`` engine's (``--out``/sources.png).

    python benchmarks/engine/sources_wall.py --out results/sources-wall-DATE [--kinds code-edit,chat] [--prompts 4]
        [--beams-only]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # draftfree.py beside this file

from draftfree import prompts as kind_prompts  # noqa: E402

SETS = ("none", "recycle", "lookup", "recycle,lookup", "model")
COUNTERS = ("vllm:dsbd_target_passes", "vllm:dsbd_beam_target_passes", "vllm:dsbd_beam_steps")


def metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def engine(folder: Path, source_set: str | None, draft: Path | None, head: Path | None = None):
    """A plain vLLM engine (``source_set`` None) or a DSBD engine drafting from ``source_set``."""
    import vllm

    spec = None
    if source_set is not None:
        spec = {"method": "dsbd", "width": 4}
        if source_set != "none":  # an engine without forests takes no depth
            spec["num_speculative_tokens"] = 3
        names = source_set.split(",")
        if names[0] in ("model", "head"):  # the draft or the head, alone or mixed with the draft-free sources
            if names[0] == "head" and head is None:
                raise SystemExit("a 'head' source set needs --head HEAD_FOLDER")
            spec["model"] = str(draft if names[0] == "model" else head)
            spec["sources"] = ["model"] + names[1:]
        else:
            spec["sources"] = [] if source_set == "none" else source_set.split(",")
    return vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                    max_num_seqs=8, disable_log_stats=False, speculative_config=spec)


def timed(llm, fn):
    """(output, wall seconds, counter deltas, CPU seconds of this process: the engine runs in it; steadier than wall
    on a shared machine) of ``fn()``."""
    c0 = {k: metric(llm, k) for k in COUNTERS}
    t0, p0 = time.perf_counter(), time.process_time()
    out = fn()
    secs, cpu = time.perf_counter() - t0, time.process_time() - p0
    return out, secs, {k: metric(llm, k) - c0[k] for k in COUNTERS}, cpu


def run_engine(llm, enc, kinds, tokens: int, beam_tokens: int, dsbd: bool, greedy: bool = True,
               sampled: bool = False, beam_calls: int = 3) -> tuple[list[dict], dict]:
    """The rows of one engine, and its best beams by kind (``greedy`` False: the beam rows only; ``sampled``: also
    the T = 1 row). A DSBD engine's beam row is the median of ``beam_calls`` calls: one call is 1.7 s, and one such
    call on the ``[]`` engine spread 24.7-38.1 tok/s over minutes on this machine (vLLM's loop: one call)."""
    import vllm
    from vllm.sampling_params import BeamSearchParams

    extra = {"extra_args": {"dsbd_width": 2}} if dsbd else {}
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)
    bp = BeamSearchParams(beam_width=4, max_tokens=beam_tokens, ignore_eos=True)
    rows, beams = [], {}
    for kind in kinds:
        ps = [{"prompt_token_ids": p} for k, p in enc if k == kind]
        llm.generate(ps[:1] if greedy else ps, sp, use_tqdm=False)  # warm-up of this kind's prompt lengths
        if greedy:
            outs, s1, c1, u1 = timed(llm, lambda: [llm.generate([p], sp, use_tqdm=False)[0] for p in ps])
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"kind": kind, "row": "greedy b1", "tokens": n, "seconds": s1, "cpu": u1,
                         "per_pass": n / c1["vllm:dsbd_target_passes"] if dsbd else 1.0})
            outs, s2, c2, u2 = timed(llm, lambda: llm.generate(ps, sp, use_tqdm=False))
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"kind": kind, "row": f"greedy {len(ps)} in one call", "tokens": n, "seconds": s2, "cpu": u2,
                         "per_pass": n / c2["vllm:dsbd_target_passes"] if dsbd else 1.0})
        if sampled:  # no per-request seed: plain vLLM's CPU runner cannot seed a request's generator
            st = vllm.SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
            outs, s4, c4, u4 = timed(llm, lambda: [llm.generate([p], st, use_tqdm=False)[0] for p in ps])
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"kind": kind, "row": "T=1 b1", "tokens": n, "seconds": s4, "cpu": u4,
                         "per_pass": n / c4["vllm:dsbd_target_passes"] if dsbd else 1.0})
        llm.beam_search(ps[:1], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))  # warm-up
        runs = [timed(llm, lambda: llm.beam_search(ps, bp)) for _ in range(beam_calls if dsbd else 1)]
        outs, s3, c3, u3 = sorted(runs, key=lambda r: r[1])[len(runs) // 2]  # the median call (vLLM's loop: one)
        beams[kind] = [[list(s.tokens[len(p["prompt_token_ids"]):]) for s in o.sequences] for o, p in zip(outs, ps)]
        steps = c3["vllm:dsbd_beam_steps"]
        rows.append({"kind": kind, "row": "beams W=4", "tokens": sum(len(b[0]) for b in beams[kind]), "seconds": s3,
                     "cpu": u3,
                     "per_pass": steps / c3["vllm:dsbd_beam_target_passes"] if dsbd and steps else 1.0})
        print(f"  {kind}: " + ", ".join(f"{r['row']} {r['tokens'] / r['seconds']:.1f} tok/s"
                                        for r in rows if r["kind"] == kind),
              flush=True)
    return rows, beams


def shutdown(llm) -> None:
    from vllm_dsbd.testing.engines import shutdown as stop

    stop(llm)
    gc.collect()


def plot(rows: list[dict], sets: list[str], out: Path) -> None:
    """Each row's tokens per CPU-second over the ``none`` engine's, by source set (bars), one panel per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for j, s in enumerate(sets):
            vals = [next((r["vs_none_cpu"] for r in rows if r["kind"] == kind and r["row"] == n and r["set"] == s), 0)
                    for n in names]
            ax.bar([i + (j - len(sets) / 2 + 0.5) * 0.8 / len(sets) for i in range(len(names))], vals,
                   0.8 / len(sets), label=s)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(kind)
        ax.set_ylabel("tokens per CPU-second over sources = []")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="code-edit,chat")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens of a plain request")
    ap.add_argument("--beam-tokens", type=int, default=16, help="beam steps of a beam request")
    ap.add_argument("--sets", default=";".join(SETS), help="source sets, ';'-separated (none, model, or sources)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every engine, alternating their order; each row keeps its fastest (a shared machine)")
    ap.add_argument("--beam-calls", type=int, default=3, help="timed beam calls per DSBD engine run (the median)")
    ap.add_argument("--beams-only", action="store_true", help="the beam rows only (no greedy rows)")
    ap.add_argument("--sampled", action="store_true", help="also the T = 1 row (plain requests one at a time)")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head folder (the 'head' source sets)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    draft, draft_kind = draft_folder(folder, 8, Path(__file__).resolve().parents[2])
    kinds, sets = a.kinds.split(","), a.sets.split(";")
    enc = [(k, p) for k, p in kind_prompts(load_tokenizer(folder), a.prompts) if k in kinds]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    best: dict[tuple, dict] = {}  # (engine, kind, row) -> the row of its fastest run
    ref_beams = None
    t0 = time.time()
    order = [None] + sets
    for rep in range(a.repeats):  # engines alternate forward and back; each row keeps its fastest run
        for s in order if rep % 2 == 0 else order[::-1]:
            print(f"engine: {'plain vLLM' if s is None else 'DSBD sources ' + s} (run {rep + 1})", flush=True)
            llm = engine(folder, s, draft, a.head and Path(a.head))
            rows, beams = run_engine(llm, enc, kinds, a.tokens, a.beam_tokens, s is not None, not a.beams_only,
                                     a.sampled, a.beam_calls)
            shutdown(llm)
            if s is None:
                ref_beams = beams
            for r in rows:
                r["set"] = "plain vLLM" if s is None else s
                r["tok_s"] = r["tokens"] / r["seconds"]
                if s is not None and r["row"].startswith("beams"):
                    r["beams"] = beams[r["kind"]]
                key = (r["set"], r["kind"], r["row"])
                if key not in best or r["seconds"] < best[key]["seconds"]:
                    best[key] = r
    all_rows = list(best.values())
    for r in all_rows:
        b = r.pop("beams", None)
        r["same_beams"] = None if b is None else b == ref_beams[r["kind"]]
    for r in all_rows:
        r["tok_cpu_s"] = r["tokens"] / r["cpu"]
    base = {(r["kind"], r["row"]): r for r in all_rows if r["set"] == "none"}
    plain = {(r["kind"], r["row"]): r for r in all_rows if r["set"] == "plain vLLM"}
    for r in all_rows:
        b, p = base.get((r["kind"], r["row"])), plain[(r["kind"], r["row"])]
        r["vs_none"] = r["tok_s"] / b["tok_s"] if b else None
        r["vs_none_cpu"] = r["tok_cpu_s"] / b["tok_cpu_s"] if b else None
        r["vs_plain"] = r["tok_s"] / p["tok_s"]
        r["vs_plain_cpu"] = r["tok_cpu_s"] / p["tok_cpu_s"]
    head = ("| kind | row | engine | tok/s | vs sources = [], wall / CPU | vs plain vLLM (beams: its loop), wall / CPU "
            "| tokens per target pass (beams: beam steps per pass) | beams = vLLM's |\n|---|---|---|---|---|---|---|---|")

    def two(a, b):
        return "-" if a is None else f"{a:.2f} / {b:.2f}"

    lines = [head] + [
        f"| {r['kind']} | {r['row']} | {r['set']} | {r['tok_s']:.1f} | {two(r['vs_none'], r['vs_none_cpu'])} | "
        f"{two(r['vs_plain'], r['vs_plain_cpu'])} | {r['per_pass']:.2f} | "
        f"{'-' if r.get('same_beams') is None else ('yes' if r['same_beams'] else 'NO')} |" for r in all_rows]
    table = "\n".join(lines)
    print("\n" + table + f"\n\n{time.time() - t0:.0f} s; draft: {draft_kind}")
    args = {**vars(a), "head": a.head and "HEAD"}  # no machine path in a results page
    (out / "rows.json").write_text(json.dumps({"args": args, "draft": draft_kind, "rows": all_rows}, indent=1))
    cmd = " ".join("HEAD" if a.head and x == a.head else x for x in sys.argv[1:])
    (out / "README.md").write_text(
        f"# Wall-clock by forest source\n\n`benchmarks/engine/sources_wall.py {cmd}`, "
        f"{os.cpu_count()} CPU threads; draft for `model`: {draft_kind}.\n\n{table}\n\n![speed over sources = []]"
        "(sources.png)\n")
    plot([r for r in all_rows if r["set"] != "plain vLLM"], sets, out / "sources.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
