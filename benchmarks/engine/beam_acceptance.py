"""How often a deterministic full-width forest layer could pass with a given draft: along the target's own beam
search (W beams), is the target's set of W best (beam, token) pairs inside the draft's K best pairs from the same
beams? K = W is DSBD's forest (W nodes per depth); larger K shows what wider forests would buy. Hugging Face models,
no vLLM, no KV cache (every step recomputes): a quick offline check of a draft, not a speed benchmark.

    python benchmarks/engine/beam_acceptance.py            # SmolLM2-135M and its distilled draft, 6 prompts, 16 steps
    python benchmarks/engine/beam_acceptance.py --draft DIR --num-prompts 16 --json out.json   # another draft
    python benchmarks/engine/beam_acceptance.py --mix 0,0.25,0.5,0.75   # also drafts between the draft and the target

``--mix a`` adds a synthetic draft log_softmax(a log p + (1 - a) log q) (a = 0: the draft, 1: the target), with its
mean KL(target || draft) over the live beams: what coverage a draft of a given KL would reach.

``--head DIR`` also measures an EAGLE-3 head (``vllm_dsbd.distill --head eagle3``, pure torch) at every live beam:
its depth-0 distribution from the target's features of the beam (what a forest's first level drafts from), q = 0
outside its draft vocabulary. Its KL to the full target distribution is infinite where the target puts mass outside
that vocabulary, so the table gives, for the draft and the head alike, the KL to the target renormalised over the
head's vocabulary (the draft renormalised there too) and the target mass outside it.

    python benchmarks/engine/beam_acceptance.py --head DIR --ks 4,8,16,32,64 --num-prompts 8 --json out.json
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--ks", default="4,6,8,12,16")
    ap.add_argument("--draft", default=None, help="a draft folder (HF); default: the committed distilled draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the coverage table here")
    ap.add_argument("--mix", default="0", help="comma-separated a in [0, 1): drafts log_softmax(a log p + (1-a) log q)")
    ap.add_argument("--head", default=None, help="also measure this EAGLE-3 head folder")
    args = ap.parse_args(argv)
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub, as demo_vllm.py runs
    from vllm_dsbd.testing import models
    from vllm_dsbd.testing.drafts import draft_folder
    from vllm_dsbd.testing.prompts import load_prompts

    torch.set_num_threads(args.threads)
    target_dir = models.smollm2_dir()
    if args.draft:
        draft_dir, draft_desc = pathlib.Path(args.draft), args.draft
    else:
        draft_dir, draft_desc = draft_folder(target_dir, 8, pathlib.Path(__file__).resolve().parents[2])
    target = models.load_hf(target_dir)
    T = models.next_token_logits_fn(target)
    head = None
    if args.head:
        from vllm_dsbd.distill import eagle3, eagle3_eval

        head = eagle3.load_head(args.head, target.get_input_embeddings().weight)
        vin = head.t2d
        hh = {int(k): 0 for k in args.ks.split(",")}
        hkl = {"head": 0.0, "draft": 0.0, "mass_out": 0.0}
    D = models.next_token_logits_fn(models.load_hf(draft_dir))
    tok = models.load_tokenizer(target_dir)
    n = max(8, (args.num_prompts + 1) // 2)
    chat_code, _, _ = load_prompts(tok, n, 128, False)
    prompts = chat_code[:8] + chat_code[n:n + 8] + chat_code[8:n] + chat_code[n + 8:]  # 8 chat, 8 code, then more
    W, ks = args.width, [int(k) for k in args.ks.split(",")]
    mixes = [float(a) for a in args.mix.split(",")]
    hits, kls, total, rows = {a: {k: 0 for k in ks} for a in mixes}, {a: 0.0 for a in mixes}, 0, 0
    with torch.no_grad():
        for p in prompts[: args.num_prompts]:
            beams = [(list(p), 0.0)]
            for step in range(args.steps):
                seqs = torch.tensor([b[0] for b in beams])
                if head is not None:
                    zt, aux = eagle3_eval.features(target, seqs, head.config.aux_layer_ids)
                    lt = torch.log_softmax(zt.double(), -1)
                    lh = torch.log_softmax(eagle3_eval.root_logits(head, seqs, aux).double(), -1)
                else:
                    lt = torch.log_softmax(T(seqs).double(), -1)
                ld = torch.log_softmax(D(seqs).double(), -1)
                V = lt.shape[1]
                sc = torch.tensor([b[1] for b in beams], dtype=torch.float64)[:, None]
                jt = (lt + sc).flatten()
                jt[tok.eos_token_id :: V] = -torch.inf  # EOS finishes a beam: never a live beam
                top = set(torch.topk(jt, W).indices.tolist())
                if step > 0:  # the first step has one beam (the prompt), as in the engine (no forest yet)
                    total += 1
                    rows += lt.shape[0]
                    for a in mixes:
                        la = torch.log_softmax(a * lt + (1 - a) * ld, -1) if a else ld
                        kls[a] += float((lt.exp() * (lt - la)).sum())
                        jd = (la + sc).flatten()
                        jd[tok.eos_token_id :: V] = -torch.inf
                        for k in ks:
                            hits[a][k] += top <= set(torch.topk(jd, k).indices.tolist())
                    if head is not None:
                        pin = torch.log_softmax(lt[:, vin], -1)
                        for name, lq in (("head", lh), ("draft", ld)):
                            hkl[name] += float((pin.exp() * (pin - torch.log_softmax(lq[:, vin], -1))).sum())
                        hkl["mass_out"] += float(lt[:, ~vin].exp().sum())
                        jh = (lh + sc).flatten()
                        jh[tok.eos_token_id :: V] = -torch.inf
                        for k in ks:
                            hits_h = top <= set(torch.topk(jh, k).indices.tolist())
                            hh[k] += hits_h
                beams = [(beams[i // V][0] + [i % V], float(jt[i])) for i in sorted(top, key=lambda i: -float(jt[i]))]
    print(f"draft: {draft_desc}; W = {W}; {total} beam steps over {args.num_prompts} prompts")
    for a in mixes:
        if a:
            print(f"synthetic draft a = {a}: log_softmax({a} log p + {1 - a:g} log q)")
        print(f"  mean KL(target || draft) over the live beams: {kls[a] / rows:.3f} nats")
        for k in ks:
            print(f"  forest width K = {k:2d}: the target's {W} pairs inside the draft's {k}: {hits[a][k] / total:.3f}")
    if head is not None:
        print(f"head: {args.head}; draft vocabulary {int(vin.sum())} tokens; target mass outside it "
              f"{hkl['mass_out'] / rows:.4f}")
        print(f"  KL over the head's vocabulary (target renormalised): head {hkl['head'] / rows:.3f}, "
              f"draft {hkl['draft'] / rows:.3f} nats")
        for k in ks:
            print(f"  forest width K = {k:2d}: the target's {W} pairs inside the head's {k}: {hh[k] / total:.3f}")
    if args.json:
        import json

        pathlib.Path(args.json).write_text(json.dumps(
            {"draft": draft_desc, "width": W, "beam_steps": total, "num_prompts": args.num_prompts,
             "steps": args.steps, "coverage": {str(k): hits[0.0][k] / total for k in ks} if 0.0 in hits else None,
             "mixes": {str(a): {"kl": kls[a] / rows, "coverage": {str(k): hits[a][k] / total for k in ks}}
                       for a in mixes},
             "head": None if head is None else {
                 "folder": args.head, "draft_vocab": int(vin.sum()), "target_mass_outside": hkl["mass_out"] / rows,
                 "kl_in_vocab": {"head": hkl["head"] / rows, "draft": hkl["draft"] / rows},
                 "coverage": {str(k): hh[k] / total for k in ks}}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
