"""Draft cost per token relative to the target (SmolLM2-135M): the EAGLE-3 head and the committed 2-layer draft,
timed side by side in one process (interleaved, medians), plus multiply-add counts.

    python results/eagle3-head-2026-11-27/cost.py --head HEAD_DIR [--repeats 30] [--json cost.json]
"""
import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from vllm_dsbd.distill import eagle3
    from vllm_dsbd.distill.eagle3_eval import time_cost
    from vllm_dsbd.testing import models
    from vllm_dsbd.testing.drafts import draft_folder

    torch.set_num_threads(a.threads)
    tdir = models.smollm2_dir()
    target = models.load_hf(tdir).eval()
    ddir, _ = draft_folder(tdir, 8, pathlib.Path(__file__).resolve().parents[2])
    draft = models.load_hf(ddir).eval()
    head = eagle3.load_head(a.head, target.get_input_embeddings().weight)

    def macs(m):  # matrices touched per token (the embedding is a lookup)
        emb = m.get_input_embeddings().weight
        return sum(p.numel() for p in m.parameters() if p.dim() == 2 and p is not emb) + (
            emb.numel() if m.get_output_embeddings().weight is emb else 0)

    out = {"macs_per_token": {"target": macs(target), "draft": macs(draft), "head": head.macs_per_token(),
                              "head_without_fc": head.macs_per_token() - head.fc.weight.numel()},
           "timings": []}
    out["macs_ratio"] = {k: v / out["macs_per_token"]["target"] for k, v in out["macs_per_token"].items()}
    for tokens in (1, 16):
        r = time_cost(target, head, draft, context=128, tokens=tokens, repeats=a.repeats)
        out["timings"].append(r)
        print(json.dumps(r))
    print(json.dumps(out["macs_ratio"]))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
