"""Which draft-set rule makes one verified layer of N sibling drafts accept most often (a plain request's layer, one
token out, K = 1), measured offline on the target's own samples. Hugging Face models, no vLLM.

The target samples continuations at T = 1 of held-out prompts (ShareGPT + HumanEval, ``load_prompts``); at every
sampled position p = target, q = draft (full vocabulary, float64). Per position, N and rule
(``vllm_dsbd.testing.draft_rules``): the probability that the emitted token is a draft, exactly where a closed form
exists (iid, greedy, greedy_zfirst, top) and by Monte Carlo otherwise (wor, the engine's rule: ``--draws`` draft sets
per position, the conditional acceptance given the drafts averaged, standard error stated). The engine's own layer
(``core.verify.verify_layer`` on drafts from ``core.sampling.gumbel_topk``, keyed randomness) is run too, counting
accepts (``--engine-draws`` layers per position): it must agree with ``wor``.
Depth 3: tokens per target pass of a tree with N drafts under every node, approximated along the sampled text by
1 + mean_t (a_t + a_t a_t+1 + a_t a_t+1 a_t+2) (the next contexts are the target's samples, not the accepted drafts).

    python benchmarks/engine/draft_rules.py --out results/draft-rules-2026-11-26
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

NS = (1, 2, 3, 4, 8)  # the drafts per layer measured (``--ns``)


def sample_positions(target, draft_models, prompts, n_tokens, eos, seed):
    """Per prompt: the target's T = 1 continuation and, at each of its positions, log p and every draft's log q
    ([n, V] float64)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            res = target(input_ids=x, use_cache=True)
            past, new = res.past_key_values, []
            logits = res.logits[0, -1]
            for _ in range(n_tokens):
                y = int(torch.multinomial(torch.softmax(logits.double(), -1), 1, generator=gen))
                new.append(y)
                if y == eos:
                    break
                res = target(input_ids=torch.tensor([[y]]), past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1]
            full = torch.tensor([ids + new])
            sl = slice(len(ids) - 1, len(ids) - 1 + len(new))
            lp = torch.log_softmax(target(input_ids=full).logits[0, sl].double(), -1)
            lqs = [torch.log_softmax(m(input_ids=full).logits[0, sl].double(), -1) for m in draft_models]
            out.append({"tokens": new, "logp": lp, "logq": lqs})
    return out


def engine_acceptance(logp, logq, n, d, pos):
    """The engine's layer on one position: d layers (keyed seeds), drafts = gumbel_topk on log q (the draft's beam
    step on one beam), one output (K = 1). Returns the accepts counted."""
    import torch

    from vllm_dsbd.core import rng
    from vllm_dsbd.core.sampling import gumbel_topk
    from vllm_dsbd.core.verify import verify_layer

    seeds = torch.arange(d, dtype=torch.int64) + 1000 * pos
    position = torch.full((d,), pos, dtype=torch.int64)
    lq = logq.float()[None, :].expand(d, -1).contiguous()
    didx, dval = gumbel_topk(lq, n, rng.request_key(seeds, position, rng.Stream.DRAFT_DRAW))
    out, _ = verify_layer(logp.float()[None, :].expand(d, -1).contiguous(), didx, dval, lq,
                          torch.ones(d, dtype=torch.int64), seeds, position)
    return int((out[:, :1] == didx).any(1).sum())


def measure(positions, which, draws, engine_draws, seed, key_offset=0):
    """Per rule and N: per-position acceptance lists, and the wor Monte Carlo's per-position standard errors."""
    import torch

    from vllm_dsbd.testing import draft_rules as dr

    gen = torch.Generator().manual_seed(seed)
    acc = {r: {n: [] for n in NS} for r in dr.RULES + ("engine",)}
    se = {n: [] for n in NS}
    pos = 0
    for item in positions:
        for t in range(item["logp"].shape[0]):
            lp, lq = item["logp"][t], item["logq"][which][t]
            p, q = torch.exp(lp), torch.exp(lq)
            for n in NS:
                for rule in dr.RULES:
                    if rule == "wor" and n > 1:
                        m, s = dr.mc_acceptance(rule, p, q, n, draws, gen)
                        acc[rule][n].append(m)
                        se[n].append(s)
                    else:  # N = 1: wor is one draft from q, the same as iid
                        acc[rule][n].append(dr.exact_acceptance("iid" if rule == "wor" else rule, p, q, n))
                if engine_draws:
                    acc["engine"][n].append(engine_acceptance(lp, lq, n, engine_draws, pos + key_offset) / engine_draws)
            pos += 1
    return acc, se


def summarise(acc, se, positions, engine_draws):
    """Table rows: per rule and N, mean acceptance (± standard error where Monte Carlo) and depth-3 tokens/pass."""
    import math

    lens = [it["logp"].shape[0] for it in positions]
    rows = {}
    for rule, by_n in acc.items():
        if not by_n[NS[0]]:
            continue
        rows[rule] = {}
        for n, a in by_n.items():
            P = len(a)
            mean = sum(a) / P
            if rule == "wor" and n > 1:
                err = math.sqrt(sum(s * s for s in se[n])) / P
            elif rule == "engine":
                err = math.sqrt(sum(x * (1 - x) for x in a) / max(engine_draws - 1, 1)) / P
            else:
                err = 0.0
            chain, k, cnt = 0.0, 0, 0
            for L in lens:
                for t in range(L - 2):
                    x = a[k + t]
                    chain += x + x * a[k + t + 1] + x * a[k + t + 1] * a[k + t + 2]
                    cnt += 1
                k += L
            rows[rule][n] = {"accept": mean, "se": err, "tokens_depth3": 1.0 + chain / max(cnt, 1)}
    return rows


def paired(acc, lens, base="wor") -> dict:
    """Per rule and N: mean over positions of (rule - ``base``) acceptance, with a standard error clustered by prompt
    (positions of one continuation are correlated): sd of the per-prompt mean differences / sqrt(prompts)."""
    import statistics

    out = {}
    for rule, by_n in acc.items():
        if rule == base or not by_n[NS[0]]:
            continue
        out[rule] = {}
        for n in NS:
            diff = [a - b for a, b in zip(by_n[n], acc[base][n])]
            per, k = [], 0
            for L in lens:
                per.append(sum(diff[k:k + L]) / L)
                k += L
            out[rule][n] = (sum(diff) / len(diff), statistics.stdev(per) / len(per) ** 0.5)
    return out


def table(rows, diffs=None) -> str:
    head = "| rule | " + " | ".join(f"N = {n}" for n in NS) + " |"
    lines = [head, "|---" * (len(NS) + 1) + "|"]
    for rule, by_n in rows.items():
        cells = [f"{v['accept']:.4f}" + (f" ± {v['se']:.4f}" if v["se"] else "") for v in by_n.values()]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines += ["", "Depth 3, tokens per target pass (N drafts under every node, see the docstring):", "", head,
              "|---" * (len(NS) + 1) + "|"]
    for rule, by_n in rows.items():
        lines.append(f"| {rule} | " + " | ".join(f"{v['tokens_depth3']:.3f}" for v in by_n.values()) + " |")
    if diffs:
        lines += ["", "Paired difference from wor (the engine's rule), ± standard error clustered by prompt:", "",
                  head, "|---" * (len(NS) + 1) + "|"]
        for rule, by_n in diffs.items():
            lines.append(f"| {rule} - wor | " + " | ".join(f"{m:+.4f} ± {e:.4f}" for m, e in by_n.values()) + " |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        for rule, by_n in rows.items():
            if rule == "engine":
                continue
            ax.plot(NS, [by_n[n]["accept"] for n in NS], marker="o", label=rule)
        ax.set_xscale("log", base=2)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.set_xlabel("drafts per layer N")
        ax.set_ylabel("per-layer acceptance")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4, help="per source: this many ShareGPT + HumanEval prompts")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draws", type=int, default=64, help="wor: draft sets per position (Monte Carlo)")
    ap.add_argument("--engine-draws", type=int, default=64, help="engine layer runs per position (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafts", choices=("both", "distilled", "truncated"), default="both",
                    help="the committed draft (distilled if its artifact is there), the untrained truncated one, both")
    ap.add_argument("--ns", default="1,2,3,4,8", help="drafts per layer N, comma-separated")
    ap.add_argument("--engine-key-offset", type=int, default=0, help="added to the engine layers' keys (a rerun "
                    "with other random numbers)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="folder for results.json and acceptance.png")
    args = ap.parse_args(argv)
    import torch

    global NS
    NS = tuple(int(n) for n in args.ns.split(","))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_dsbd.testing import models
    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.prompts import load_prompts

    torch.set_num_threads(args.threads)
    t0 = time.time()
    target_dir = models.smollm2_dir()
    draft_dir, draft_desc = draft_folder(target_dir, 2, pathlib.Path(__file__).resolve().parents[2])
    target = models.load_hf(target_dir)
    drafts = {}
    if args.drafts != "truncated":
        drafts[f"draft: {draft_desc}"] = models.load_hf(draft_dir)
    if args.drafts != "distilled":
        drafts["draft: truncated_draft(target, 2), untrained"] = models.truncated_draft(target, 2)
    tok = models.load_tokenizer(target_dir)
    prompts, pdesc, _ = load_prompts(tok, args.num_prompts, 64, False)
    positions = sample_positions(target, list(drafts.values()), prompts, args.tokens, tok.eos_token_id, args.seed)
    lens = [it["logp"].shape[0] for it in positions]
    n_pos = sum(lens)
    print(f"{pdesc}; {n_pos} positions sampled at T = 1 ({time.time() - t0:.0f} s)", flush=True)
    results, report = {}, {}
    for which, name in enumerate(drafts):
        t1 = time.time()
        acc, se = measure(positions, which, args.draws, args.engine_draws, args.seed + 1 + which,
                          args.engine_key_offset)
        rows = summarise(acc, se, positions, args.engine_draws)
        diffs = paired(acc, lens)
        results[name] = rows
        report[name] = {"rows": {r: {str(n): v for n, v in by.items()} for r, by in rows.items()},
                        "minus_wor": {r: {str(n): v for n, v in by.items()} for r, by in diffs.items()},
                        "per_position": {r: {str(n): [round(x, 6) for x in a] for n, a in by.items()}
                                         for r, by in acc.items() if by[NS[0]]},
                        "seconds": time.time() - t1}
        print(f"\n{name} ({n_pos} positions, {time.time() - t1:.0f} s)\n{table(rows, diffs)}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"prompts": pdesc, "positions": n_pos, "tokens": args.tokens, "draws": args.draws,
                "engine_draws": args.engine_draws, "seed": args.seed, "ns": list(NS),
                "engine_key_offset": args.engine_key_offset, "lengths": lens,
                "sampled_tokens": [it["tokens"] for it in positions], "threads": args.threads,
                "torch": torch.__version__, "seconds": time.time() - t0}
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "drafts": report}, separators=(",", ":")))
        plot(results, args.out / "acceptance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
