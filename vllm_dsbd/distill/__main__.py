"""CLI: ``python -m vllm_dsbd.distill [train] --target DIR --out DIR ...`` (``--head eagle3``: an EAGLE-3 head instead
of a draft model) and the subcommands export, assemble, eval (``python -m vllm_dsbd.distill <cmd> --help``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .train import DistillConfig

_SUBCOMMANDS = ("train", "export", "assemble", "eval")


def _train_parser(prog: str) -> argparse.ArgumentParser:
    d = DistillConfig(target="", out="")
    p = argparse.ArgumentParser(
        prog=prog, description="Distil a small draft model from a Llama-family target (HF folder). Resumable: a "
        "re-run with the same arguments continues from the last checkpoint and reuses the generated corpus.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target model folder (HF format)")
    p.add_argument("--out", required=True, help="output folder of the draft (HF format)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers of the draft")
    p.add_argument("--tokens", type=int, default=d.tokens, help="target-generated tokens to train on (corpus size)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (prompt + generated)")
    p.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len, help="prompt tokens at most (cut)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per optimizer step")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over the corpus")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm (0: off)")
    p.add_argument("--prompts", default=d.prompts, help="sharegpt, humaneval, or a .txt/.jsonl file")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature of the corpus")
    p.add_argument("--beam-width", type=int, default=d.beam_width,
                   help="0: the target samples the corpus; W >= 2: the corpus is the target's beam search of width W "
                        "(its W final beams per prompt), for a draft made for beam requests")
    p.add_argument("--loss", default=d.loss, choices=["kl", "topk"],
                   help="kl: forward KL on the full vocabulary; topk: KL + a squared error on the log-probabilities "
                        "of the target's top-k tokens (what a beam forest's ranking needs)")
    p.add_argument("--topk", type=int, default=d.topk, help="k of --loss topk")
    p.add_argument("--topk-weight", type=float, default=d.topk_weight, help="weight of the top-k term")
    p.add_argument("--init", default=None, help="a draft folder (HF) to start from (default: the target's first layers)")
    p.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size, help="sequences generated together")
    p.add_argument("--gen-dtype", default=d.gen_dtype, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the target while generating the corpus")
    p.add_argument("--train-dtype", default=d.train_dtype, choices=["float32", "bfloat16", "float16"],
                   help="matmul dtype in training (autocast; weights and softmax stay float32)")
    p.add_argument("--kl-chunk", type=int, default=d.kl_chunk, help="positions per chunk of the fused KL loss")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the loss's elementwise part")
    p.add_argument("--gen-workers", type=int, default=d.gen_workers,
                   help="processes generating the corpus (CPU; use with --threads 1 on a shared machine)")
    p.add_argument("--gen-engine", default=d.gen_engine, choices=["hf", "vllm"],
                   help="what generates the corpus: the HF loop, or a vLLM engine (~50x faster on a CPU)")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps")
    p.add_argument("--work-dir", default=None, help="corpus cache + checkpoint (default: <out>.work)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--artifact", default=None, help="also write the layers-only artifact to this folder")
    p.add_argument("--stop-after", type=int, default=None,
                   help="run at most N steps in this invocation, checkpoint and exit (a re-run continues)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _head_parser(prog: str) -> argparse.ArgumentParser:
    from .eagle3_train import HeadConfig

    d = HeadConfig(target="", out="")
    p = argparse.ArgumentParser(
        prog=prog + " --head eagle3", description="Train an EAGLE-3 head (vLLM's public format) for a Llama-family "
        "target on its own generations, with training-time test over the forest depth and a trimmed vocabulary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--head", required=True, choices=["eagle3"])
    p.add_argument("--target", required=True, help="target model folder (HF format)")
    p.add_argument("--out", required=True, help="output folder of the head (vLLM's EAGLE-3 format)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="draft vocabulary: the N tokens the "
                   "target generates most often in the corpus")
    p.add_argument("--depth", type=int, default=d.depth, help="training-time test unroll (forest depths)")
    p.add_argument("--depth-decay", type=float, default=d.depth_decay, help="loss weight of depth k: decay**k")
    p.add_argument("--tokens", type=int, default=d.tokens, help="sampled corpus size (generated tokens)")
    p.add_argument("--beam-tokens", type=int, default=d.beam_tokens, help="beam-search corpus size (0: none)")
    p.add_argument("--beam-width", type=int, default=d.beam_width, help="beam width of the beam-search corpus")
    for name in ("seq_len", "max_prompt_len", "gen_batch_size", "beam_gen_batch_size", "batch_size", "warmup_steps",
                 "gen_workers", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("epochs", "lr", "min_lr_ratio", "weight_decay", "grad_clip", "temperature"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this wall time")
    p.add_argument("--prompts", default=d.prompts, help="sharegpt, humaneval, or a .txt/.jsonl file")
    for name in ("gen_dtype", "feature_dtype", "train_dtype"):
        p.add_argument("--" + name.replace("_", "-"), default=getattr(d, name),
                       choices=["float32", "bfloat16", "float16"])
    p.add_argument("--gen-engine", default=d.gen_engine, choices=["hf", "vllm"],
                   help="what generates the corpora: the HF loop, or a vLLM engine (~50x faster on a CPU)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--work-dir", default=None, help="corpus caches + features (default: <out>.work)")
    p.add_argument("--corpus-dir", default=None, help="sampled corpus cache (default: <work>/corpus)")
    p.add_argument("--beam-corpus-dir", default=None, help="beam corpus cache (default: <work>/corpus-beam<W>)")
    p.add_argument("--artifact", default=None, help="also write the artifact (no LM head, float16) to this folder")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad arguments (or a missing / wrong target folder) print one clear line and return 2."""
    try:
        return _main(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"python -m vllm_dsbd.distill: error: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in _SUBCOMMANDS else "train"
    prog = "python -m vllm_dsbd.distill" + ("" if cmd == "train" else f" {cmd}")
    if cmd == "train" and any(x == "--head" or x.startswith("--head=") for x in argv):
        from .eagle3_train import HeadConfig, train_head

        a = vars(_head_parser(prog).parse_args(argv))
        a.pop("head")
        a["progress"] = not a.pop("no_progress")
        train_head(HeadConfig(**a))
        return 0
    if cmd == "train":
        a = vars(_train_parser(prog).parse_args(argv))
        a["progress"] = not a.pop("no_progress")
        a["compile_loss"] = not a.pop("no_compile")
        cfg = DistillConfig(**{k: a[k] for k in (f.name for f in dataclasses.fields(DistillConfig))})
        from .train import distill

        distill(cfg)
        return 0
    if cmd == "export":
        p = argparse.ArgumentParser(prog=prog, description="Write the layers-only artifact (float16) of a draft.")
        p.add_argument("--draft", required=True, help="draft folder written by python -m vllm_dsbd.distill")
        p.add_argument("--artifact", required=True, help="artifact folder to write")
        a = p.parse_args(argv)
        from .artifact import export_artifact

        print(export_artifact(a.draft, a.artifact))
        return 0
    if cmd == "assemble":
        p = argparse.ArgumentParser(prog=prog, description="Rebuild a full draft folder from target + artifact.")
        p.add_argument("--target", required=True)
        p.add_argument("--artifact", required=True)
        p.add_argument("--out", required=True)
        a = p.parse_args(argv)
        from .artifact import assemble
        from .eagle3_artifact import assemble_head, is_head_artifact

        print((assemble_head if is_head_artifact(a.artifact) else assemble)(a.target, a.artifact, a.out))
        return 0
    # eval
    p = argparse.ArgumentParser(prog=prog, description="Acceptance length of speculative sampling (W=1, depth "
                                "gamma) with the reference decoder on held-out prompts.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", action="append", default=[], help="draft folder (repeatable)")
    p.add_argument("--head", action="append", default=[], help="EAGLE-3 head folder (repeatable)")
    p.add_argument("--baseline-layers", type=int, action="append", default=[],
                   help="also measure the untrained truncated_draft(target, N) (repeatable)")
    p.add_argument("--prompts", default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results to this file")
    a = p.parse_args(argv)
    import torch

    from .evaluate import evaluate, write_json

    if a.threads:
        torch.set_num_threads(a.threads)
    drafts: dict = {f"distilled:{d}": d for d in a.draft}
    drafts.update({f"eagle3:{h}": h for h in a.head})
    drafts.update({f"truncated_draft({n})": n for n in a.baseline_layers})
    if not drafts:
        p.error("give at least one --draft, --head or --baseline-layers")
    res = evaluate(a.target, drafts, prompts=a.prompts, num_prompts=a.num_prompts, max_prompt_len=a.max_prompt_len,
                   gamma=a.gamma, max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    res["threads"] = torch.get_num_threads()
    if a.json:
        write_json(res, a.json)
    print(json.dumps({k: round(v["acceptance_length"], 3) for k, v in res["results"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
