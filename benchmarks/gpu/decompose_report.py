"""The markdown report of ``decompose.py`` (issue 47 item 1): step table, configuration tax and DSBD's own work, the
profiler's counts, phases and sync stacks, from the results the engines' subprocesses wrote."""
from __future__ import annotations

def _row(results: dict, name: str, batch: int) -> dict | None:
    return next((r for r in results.get(name, {}).get("rows") or [] if r["batch"] == batch), None)


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(args, results: dict, device: str, ENGINES: dict, COLUMNS: list) -> str:
    """The tables of ``decompose.py``'s README from its results (``ENGINES``, ``COLUMNS``: that script's)."""
    order = [n for n in ENGINES if n in results]
    lab = {n: ENGINES[n][0] for n in ENGINES}
    lines = [f"{device}; {'tiny shapes, float32, eager' if args.tiny else 'Llama-3.1-8B shape, random weights, bf16'}"
             f"; prompts of {args.prompt_len} distinct token ids, temperature 1; medians over {args.steps} steps "
             f"after 2 warm-up steps; engines in-process, one subprocess each, {args.parallel} starting together; "
             "ms per step unless said", "", "## Step time", "",
             "| engine | runner | graphs | async | batch | step ms | ms / token | tokens / req / step | spec slots / "
             "step | vs (d) | start s | depths drafted |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in order:
        res, info = results[n], results[n].get("info") or {}
        for r in res.get("rows") or []:
            d = _row(results, "d", r["batch"])
            lines.append(f"| {lab[n]} | {info.get('runner', '-')} | {info.get('cudagraph_mode', '-')} | "
                         f"{info.get('async', '-')} | {r['batch']} | {r['step_ms']:.2f} | {r['ms_per_token']:.2f} | "
                         f"{r['tokens_per_req_step']:.2f} | {r['spec_slots_per_step']:.1f} | "
                         f"{_f(r['step_ms'] / d['step_ms'] if d else None, '{:.2f}x')} | "
                         f"{_f(info.get('startup_s'), '{:.0f}')} | "
                         + (" ".join(f"{k}:{v}" for k, v in sorted(r.get("depths", {}).items())) or "-")
                         + " |")
    notes = [f"- {lab[n]}: {results[n]['info']['reprobe']}" for n in order
             if (results[n].get("info") or {}).get("reprobe")]
    lines += [""] + notes if notes else []
    lines += ["", "## Configuration tax and DSBD's own work (step ms; + = slower)", "",
              "| batch | (a) | (b) | (c) | (d) | V2 -> V1 (b - a) | FULL -> PIECEWISE (c - b) | "
              "async -> sync (d - c) | tax (d - a) | DSBD [] - (d) | DSBD default - (d) | ngram - (d) | "
              "ngram_gpu - (b) | V1 runner > 5% of (a)? |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in args.batches:
        s = {n: (_row(results, n, b) or {}).get("step_ms") for n in ENGINES}
        dif = lambda x, y: None if s[x] is None or s[y] is None else s[x] - s[y]  # noqa: E731
        v1 = None if s["a"] is None or s["b"] is None else s["b"] / s["a"] - 1
        pairs = (("b", "a"), ("c", "b"), ("d", "c"), ("d", "a"), ("dsbd_none", "d"), ("dsbd_default", "d"),
                 ("ngram", "d"), ("ngram_gpu", "b"))
        lines.append(f"| {b} | " + " | ".join(_f(s[k]) for k in "abcd") + " | "
                     + " | ".join(_f(dif(x, y), "{:+.2f}") for x, y in pairs) + " | "
                     + ("-" if v1 is None else f"{'yes' if v1 > 0.05 else 'no'} ({100 * v1:+.1f}%)") + " |")
    plain = {n: results[n]["info"] for n in "abcd" if results.get(n, {}).get("info")}
    same = lambda i: next((p for p, j in plain.items()  # noqa: E731
                           if all(i.get(k) == j.get(k) for k in ("runner", "cudagraph_mode", "async"))), None)
    lines += ["", "Speculative engines against the plain engine of the same resolved configuration (runner, graphs, "
              "async), where one ran:", "", "| engine | configuration | plain engine | batch | step ms | plain ms | "
              "difference |", "|---|---|---|---|---|---|---|"]
    for n in order:
        info = results[n].get("info") or {}
        if n in ("a", "b", "c", "d") or not info:
            continue
        p = same(info)
        for r in results[n].get("rows") or []:
            q = _row(results, p, r["batch"]) if p else None
            lines.append(f"| {lab[n]} | {info['runner']}, {info['cudagraph_mode']}, "
                         f"{'async' if info['async'] else 'sync'} | {lab[p] if p else 'none ran'} | {r['batch']} | "
                         f"{r['step_ms']:.2f} | {_f(q and q['step_ms'])} | "
                         f"{_f(q and r['step_ms'] - q['step_ms'], '{:+.2f}')} |")
    keys = ["launches", "graph launches", "kernels run", "memcpy HtoD", "memcpy DtoH", "memcpy DtoD", "syncs",
            "blocking cudaMemcpy", "gpu busy ms", "aten ops"]
    lines += ["", f"## Per step, from torch.profiler ({args.prof_steps} steps)", "",
              "| engine | batch | " + " | ".join(keys) + " | sync-debug syncs |",
              "|---|---|" + "---|" * (len(keys) + 1)]
    for n in order:
        for r in results[n].get("rows") or []:
            p = r.get("profile") or {}
            lines.append(f"| {lab[n]} | {r['batch']} | " + " | ".join(_f(p.get(k), "{:.1f}") for k in keys) + " | "
                         + _f((r.get("sync") or {}).get("syncs per step"), "{:g}") + " |")
    lines += ["", "## Host time per phase (ms per step, exclusive, no GPU synchronisation added)", "",
              "| engine | batch | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for n in order:
        for r in results[n].get("rows") or []:
            lines.append(f"| {lab[n]} | {r['batch']} | " + " | ".join(f"{r['phases_ms'][k]:.2f}" for k in COLUMNS)
                         + " |")
    lines += ["", f"## Synchronisations (set_sync_debug_mode over {args.sync_steps} steps): the most frequent stacks",
              ""]
    for n in order:
        for r in results[n].get("rows") or []:
            if r.get("sync"):
                lines.append(f"- {lab[n]}, batch {r['batch']}: {r['sync']['syncs per step']:g} per step")
                lines += [f"  - x{c}: `{st}`" for st, c in r["sync"]["stacks"][:6]]
    if not args.tiny and not any((r.get("sync") for n in order for r in results[n].get("rows") or [])):
        lines.append("- none recorded")
    if args.tiny:
        lines.append("- skipped on CPU: set_sync_debug_mode needs CUDA")
    lines += ["", "## Engines not measured, or cut short", ""]
    lines += [f"- {lab[n]} (`{n}`): {results[n].get('skipped') or results[n].get('error')}" for n in order
              if results[n].get("skipped") or results[n].get("error")]
    return "\n".join(lines)
