"""Speed at a realistic model size without real weights (GPU; ``--tiny`` runs the same flow on CPU as a smoke test).

Target: a Llama-3.1-8B-shaped model, draft: a Llama-3.2-1B-shaped model, both with vLLM's random (``dummy``) weights,
made on the machine from config files only, with a word-level tokenizer of one word per token id (vLLM's beam
search needs a tokenizer; prompts are random token ids). Random weights make real
DSBD acceptance near zero, so the DSBD rows use ``benchmarks/set_acceptance.py``: **accepted-path lengths follow a set
per-layer acceptance rate instead of DSBD's verification** (which still runs, so its cost counts). The numbers are
system speed at a given acceptance, not quality, and not DSBD's output law.

Rows, on the same prompts, one process, engines one after the other:
  plain sampling (temperature 1)     one engine, which also runs vLLM's LLM.beam_search at each --beam-widths
  DSBD width W (per request), rate r one DSBD engine (width max(--widths), depth --depth), every (W, r)
Printed last: tokens/s, target passes per token, and each row's speed relative to plain sampling.

    python benchmarks/gpu/large_model.py --out results/gpu/large_model        (GPU)
    python benchmarks/gpu/large_model.py --tiny --out /tmp/lm                  (CPU smoke)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # set_acceptance must act in the engine's process

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (for set_acceptance)
import set_acceptance  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)
TINY_T = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False)
TINY_D = dict(TINY_T, num_hidden_layers=1, tie_word_embeddings=True)


def write_config(folder: Path, shape: dict, dtype: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, **shape)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer with exactly ``vocab`` tokens ("t0", "t1", ...): decodes every id the model can emit."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(
        folder)


def metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", 0) or 0
    return 0


def shutdown(llm):
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test of the flow)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rates", default="0.5,0.8")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--beam-widths", default="4")
    ap.add_argument("--work", default="/tmp/dsbd-large-model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    if args.tiny:
        torch.set_num_threads(1)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    dtype = "float32" if args.tiny else "bfloat16"
    work = Path(args.work)
    target = write_config(work / "target", TINY_T if args.tiny else LLAMA_8B, dtype)
    draft = write_config(work / "draft", TINY_D if args.tiny else LLAMA_1B, dtype)
    vocab = (TINY_T if args.tiny else LLAMA_8B)["vocab_size"]
    for folder in (target, draft):
        if not (folder / "tokenizer.json").exists():
            write_tokenizer(folder, vocab)
    rnd = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rnd.randrange(3, vocab) for _ in range(args.prompt_len)])
               for _ in range(args.num_prompts)]
    widths = [int(w) for w in args.widths.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    beam_widths = [int(w) for w in args.beam_widths.split(",") if w]
    gpu_mem = {} if args.tiny else {"gpu_memory_utilization": 0.45}  # two engines in turn in one process
    common = dict(dtype=dtype, **gpu_mem, enforce_eager=True, load_format="dummy", seed=0,
                  max_model_len=args.prompt_len + args.max_tokens + 64, disable_log_stats=False,
                  enable_prefix_caching=False)

    def params(**kw):
        return [vllm.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=i,
                                    detokenize=False, **kw) for i in range(len(prompts))]

    rows = []
    llm = vllm.LLM(model=str(target), **common)
    llm.generate(prompts[:2], params()[:2], use_tqdm=False)  # warm-up
    outs, secs = timed(lambda: llm.generate(prompts, params(), use_tqdm=False))
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append(dict(method="plain sampling", width=1, rate=None, tokens=n, seconds=secs, passes=n))
    print("row:", rows[-1], flush=True)
    for w in beam_widths:
        bp = BeamSearchParams(beam_width=w, max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        outs, secs = timed(lambda: llm.beam_search(
            [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], bp))
        n = sum(len(o.sequences[0].tokens) - args.prompt_len for o in outs)
        rows.append(dict(method="vLLM beam_search", width=w, rate=None, tokens=n, seconds=secs, passes=n))
        print("row:", rows[-1], flush=True)
    shutdown(llm)

    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": args.depth, "width": max(widths),
            "dynamic_width": False}
    llm = vllm.LLM(model=str(target), speculative_config=spec, **common)
    set_acceptance.install(rates[0])
    try:
        llm.generate(prompts[:2], params()[:2], use_tqdm=False)  # warm-up
        for rate in rates:
            set_acceptance.set_rate(rate)
            for w in widths:
                before = metric(llm, "vllm:spec_decode_num_drafts")
                outs, secs = timed(lambda: llm.generate(prompts, params(extra_args={"dsbd_width": w}),
                                                        use_tqdm=False))
                drafts = metric(llm, "vllm:spec_decode_num_drafts") - before
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append(dict(method="DSBD (SET-RATE acceptance)", width=w, rate=rate, tokens=n, seconds=secs,
                                 passes=len(prompts) + drafts))
                print("row:", rows[-1], flush=True)
    finally:
        set_acceptance.uninstall()
        shutdown(llm)

    base = rows[0]["tokens"] / rows[0]["seconds"]
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["passes_per_token"] = r["passes"] / r["tokens"]
        r["speed_vs_plain"] = r["tokens_per_s"] / base
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shapes = "tiny" if args.tiny else "target Llama-3.1-8B shape, draft Llama-3.2-1B shape"
    print(f"\n{device}; {shapes}; random weights; {args.num_prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens, temperature 1, eager; DSBD depth {args.depth}, fixed width")
    print(f"{'method':28s} {'W':>2s} {'rate':>5s} {'tokens':>7s} {'tok/s':>8s} {'passes/tok':>11s} {'vs plain':>9s}")
    for r in rows:
        rate = f"{r['rate']:.2f}" if r["rate"] is not None else "-"
        print(f"{r['method']:28s} {r['width']:2d} {rate:>5s} {r['tokens']:7d} {r['tokens_per_s']:8.1f} "
              f"{r['passes_per_token']:11.3f} {r['speed_vs_plain']:9.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "large_model.json").write_text(json.dumps(dict(device=device, shapes=shapes, args=vars(args),
                                                              rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
