"""How the engine's keyed Gumbel noise (``core.rng.gumbel``: u = (k + 0.5) 2**-23, 23-bit uniforms, so the noise is at
most -log(-log(1 - 2**-24)) = 16.6) draws rare tokens, exactly: a vocabulary of V = 49,152 with n_B tokens whose
logit is c below the other n_A = V - n_B; P(a B token wins the Gumbel-max) with the quantised noise (summed over all
2**23 levels of the B tokens' maximum) against the exact n_B e^-c / (n_A + n_B e^-c). numpy, about a minute.
With ``--models``: how much mass SmolLM2's target and the two drafts put below 6.2e-8 and 1e-6, on the target's
T = 1 sampling of 24 tokens of the first held-out ShareGPT prompt (``benchmarks/engine/draft_rules.py``'s sampling).
With ``--draws``: the engine's draw (argmax of log q + ``rng.gumbel``) on a synthetic q over 49,152 tokens, 200,704
draws: E min(1, p/q) against sum min(p, q), and the draws' law in 40 bins of equal q-mass (chi-square; ~4 min).

    python results/draft-rules-2026-11-26/gumbel_tail.py [--models] [--draws]
"""
import importlib.util
import math
import pathlib
import sys

import numpy as np

K = 2**23
u = ((np.arange(K, dtype=np.float64) + 0.5) * 2.0**-23).astype(np.float32)
g = (-np.log(-np.log(u))).astype(np.float64)  # float32 arithmetic, as rng.gumbel
V = 49152
for nB, c in ((16384, 3.0), (4096, 2.0), (4096, 4.0), (4096, 6.0), (512, 6.0)):
    nA = V - nB
    pB = np.diff(np.concatenate([[0.0], ((np.arange(K) + 1) / K) ** nB]))  # P(max of the B noises = level k)
    FA = (np.searchsorted(g, g - c, side="left") / K) ** nA  # P(every A noise < that level - c)
    quant, exact = float((pB * FA).sum()), nB * math.exp(-c) / (nA + nB * math.exp(-c))
    print(f"n_B = {nB:5d}, c = {c}: P(a B token) quantised {quant:.6g}, exact {exact:.6g}, "
          f"relative error {quant / exact - 1:+.4f}")

if "--models" in sys.argv:
    import torch

    from vllm_dsbd.testing import models
    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.prompts import load_prompts

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("draft_rules_bench", root / "benchmarks/engine/draft_rules.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.set_num_threads(1)
    target_dir = models.smollm2_dir()
    target, tok = models.load_hf(target_dir), models.load_tokenizer(target_dir)
    drafts = [models.load_hf(draft_folder(target_dir, 2, root)[0]), models.truncated_draft(target, 2)]
    prompts, _, _ = load_prompts(tok, 1, 64, False)
    pos = bench.sample_positions(target, drafts, prompts[:1], 24, tok.eos_token_id, 0)
    for name, lp in (("target p", pos[0]["logp"]), ("distilled q", pos[0]["logq"][0]),
                     ("truncated q", pos[0]["logq"][1])):
        pr = lp.exp()
        print(name + ": mean mass per position below 6.2e-8 / 1e-6: "
              + " / ".join(f"{float((pr * (pr < t)).sum(1).mean()):.2e}" for t in (6.2e-8, 1e-6)))

if "--draws" in sys.argv:
    from collections import Counter

    import torch

    from vllm_dsbd.core import rng

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "helpers"))
    from chisq import goodness_of_fit

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lq = torch.log_softmax(torch.randn(V, dtype=torch.float64, generator=gen), 0)
    lp = torch.log_softmax(lq + torch.randn(V, dtype=torch.float64, generator=gen) * 1.5, 0)
    f = torch.exp(lp - lq).clamp(max=1.0)
    order = torch.argsort(lq)
    binof = torch.empty(V, dtype=torch.int64)
    binof[order] = (lq.exp()[order].cumsum(0) * 40).long().clamp(max=39)
    probs = torch.zeros(40, dtype=torch.float64).index_add_(0, binof, lq.exp())
    zs = []
    for c in range(64, 64 + 196):
        keys = rng.request_key(torch.arange(1024) + 1024 * c, torch.full((1024,), 5), rng.Stream.DRAFT_DRAW)
        zs.append(torch.argmax(lq.float()[None] + rng.gumbel(keys, V), 1))
    z = torch.cat(zs)
    x = f[z]
    print(f"{z.numel()} engine draws: E min(1, p/q) {float(x.mean()):.5f} ± {float(x.std()) / math.sqrt(z.numel()):.5f}"
          f", exact {float(torch.minimum(lp.exp(), lq.exp()).sum()):.5f}")
    stat = goodness_of_fit(Counter(binof[z].tolist()), {i: float(probs[i]) for i in range(40)}, z.numel())
    print("the draws in 40 bins of equal q-mass: chi2 %.1f df %d threshold %.1f" % stat)
