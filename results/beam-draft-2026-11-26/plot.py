"""Coverage against N for the drafts of this page (reads the coverage-*.json files here, writes coverage.png)."""
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = pathlib.Path(__file__).parent
fig, ax = plt.subplots(figsize=(7, 4.5))
for name, label, style in (("committed", "committed draft", "o-"), ("beam-kl", "fine-tuned on beams, KL", "s--"),
                           ("beam-topk", "fine-tuned on beams, KL + top-8", "^--")):
    d = json.loads((here / f"coverage-{name}.json").read_text())
    kl = (d if name != "committed" else json.loads((here / "coverage-synthetic.json").read_text())).get(
        "mixes", {}).get("0.0", {}).get("kl")  # the committed draft's KL: the synthetic run's a = 0 row
    cov = d["coverage"]
    ks = sorted(int(k) for k in cov)
    ax.plot(ks, [cov[str(k)] for k in ks], style, label=label + (f" (KL {kl:.2f})" if kl else ""))
syn = json.loads((here / "coverage-synthetic.json").read_text())["mixes"]
for a in ("0.25", "0.5", "0.75"):
    cov = syn[a]["coverage"]
    ks = sorted(int(k) for k in cov)
    ax.plot(ks, [cov[str(k)] for k in ks], ":", label=f"synthetic a = {a} (KL {syn[a]['kl']:.2f})")
ax.axhline(0.45, color="gray", lw=0.8)
ax.text(4.2, 0.47, "0.45: 0.6 target passes per beam step at depth 3", fontsize=8, color="gray")
ax.set_xscale("log", base=2)
ax.set_xlabel("N, draft nodes per depth")
ax.set_ylabel("share of beam steps whose target top-4 pairs are drafted")
ax.set_title("SmolLM2-135M, W = 4, T = 0: forest-layer coverage (16 held-out prompts, 240 steps)", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(here / "coverage.png", dpi=110)
