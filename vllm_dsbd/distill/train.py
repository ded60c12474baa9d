"""Distillation of a small draft from a Llama-family target: settings, loss, training loop, checkpoints.

The draft is the target's first ``layers`` decoder layers (initialisation) on top of the target's token embedding,
final norm and LM head, which stay frozen and shared: the draft adds only its layers' weights. It is trained to
match the target's next-token distribution on text the target generated (``corpus.py``) with the forward KL
``KL(p_target || q_draft)`` over the **full vocabulary** at every generated position. The target's distribution is
recomputed from its cached final hidden state with the (frozen) LM head, inside a fused, chunked loss
(:class:`FusedKL`) that never keeps [tokens, vocab] tensors for the backward pass.

For beam requests (``--beam-width``, ``--loss topk``): the corpus is the target's own beam searches, and the loss adds
a squared error on the log-probabilities of the target's ``topk`` best tokens (plus a hinge on the draft's own top
tokens the target ranks lower): a T = 0 forest layer passes only when the draft ranks the target's best (beam, token)
pairs, across beams, among its N best, which the mass-weighted KL fits loosely. ``--init`` starts from a draft.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import artifact as art
from . import corpus as corp
from . import corpus_vllm
from . import data

CKPT = "checkpoint.pt"


@dataclass
class DistillConfig:
    """Settings of one distillation run (the CLI flags of ``python -m vllm_dsbd.distill``)."""

    target: str
    out: str
    layers: int = 2
    tokens: int = 200_000  # size of the generated corpus, in generated (= trained-on) tokens
    seq_len: int = 128  # prompt + generated tokens per sequence
    max_prompt_len: int = 64
    batch_size: int = 8  # sequences per optimizer step
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    prompts: str = "sharegpt"
    temperature: float = 1.0
    beam_width: int = 0  # >= 2: the corpus is the target's beam search of this width (W final beams per prompt)
    loss: str = "kl"  # "kl": forward KL; "topk": KL + topk_weight * top-k log-probability error (module docstring)
    topk: int = 8
    topk_weight: float = 1.0
    init: str | None = None  # a draft folder (HF) with ``layers`` layers to start from (default: the target's first)
    gen_batch_size: int = 64
    gen_dtype: str = "bfloat16"  # dtype of the target while it generates the corpus
    train_dtype: str = "bfloat16"  # matmul dtype (autocast) in training; master weights and softmax stay float32
    kl_chunk: int = 128  # positions per chunk of the fused KL
    compile_loss: bool = True  # torch.compile the elementwise part of the loss (falls back to eager)
    gen_workers: int = 1  # processes generating the corpus
    gen_engine: str = "hf"  # "hf": the HF loop (corpus.py); "vllm": a vLLM engine (corpus_vllm.py, ~50x on CPU)
    device: str = "cpu"
    seed: int = 0
    save_every: int = 50
    work_dir: str | None = None  # generation cache + checkpoint; default <out>.work
    threads: int | None = None
    artifact: str | None = None  # also write the small artifact (layers only) there
    stop_after: int | None = None  # run at most this many steps in this invocation, checkpoint, return (resumable)
    progress: bool = True

    def validate(self) -> None:
        def positive(name, integer=True):
            v = getattr(self, name)
            if (integer and (not isinstance(v, int) or isinstance(v, bool))) or v is None or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive {'integer' if integer else 'number'}, got {v!r}")

        for name in ("layers", "tokens", "seq_len", "max_prompt_len", "batch_size", "gen_batch_size", "kl_chunk",
                     "save_every", "gen_workers"):
            positive(name)
        for name in ("epochs", "lr"):
            positive(name, integer=False)
        if self.max_steps is not None:
            positive("max_steps")
        if self.threads is not None:
            positive("threads")
        if self.stop_after is not None:
            positive("stop_after")
        if self.max_prompt_len >= self.seq_len:
            raise ValueError(f"--max-prompt-len ({self.max_prompt_len}) must be < --seq-len ({self.seq_len})")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")
        if self.beam_width < 0 or self.beam_width == 1:
            raise ValueError(f"--beam-width must be 0 (sampled corpus) or >= 2, got {self.beam_width}")
        if self.loss not in ("kl", "topk"):
            raise ValueError(f"--loss must be kl or topk, got {self.loss!r}")
        if self.loss == "topk" and (self.topk < 1 or self.topk_weight < 0):
            raise ValueError("--topk must be >= 1 and --topk-weight >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("--min-lr-ratio must be in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("--warmup-steps, --weight-decay and --grad-clip must be >= 0")
        if self.gen_engine not in ("hf", "vllm"):
            raise ValueError(f"--gen-engine must be hf or vllm, got {self.gen_engine!r}")
        for name in ("gen_dtype", "train_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"--{name.replace('_', '-')} must be float32, bfloat16 or float16")
        art.check_target_dir(self.target)
        if not self.out:
            raise ValueError("--out is required")

    @property
    def work_path(self) -> pathlib.Path:
        out = pathlib.Path(self.out).expanduser()
        return pathlib.Path(self.work_dir).expanduser() if self.work_dir else out.with_name(out.name + ".work")


# ----------------------------------------------------------------------------------------------------------------
# loss
# ----------------------------------------------------------------------------------------------------------------
def _kl_terms(zq: torch.Tensor, zp: torch.Tensor):
    """Per row: KL(softmax(zp) || softmax(zq)), entropy of softmax(zp), and softmax(zq) - softmax(zp) (the
    gradient of the KL w.r.t. zq) in zq's dtype. Softmaxes in float32."""
    out_dtype = zq.dtype
    lq = torch.log_softmax(zq.float(), -1)
    lp = torch.log_softmax(zp.float(), -1)
    p = lp.exp()
    kl = (p * (lp - lq)).sum(-1)
    ent = -(p * lp).sum(-1)
    return kl, ent, (lq.exp() - p).to(out_dtype)


def _topk_terms(zq: torch.Tensor, zp: torch.Tensor, k: int, lam: float):
    """:func:`_kl_terms` plus ``lam`` times a ranking term, per row: the mean over the target's ``k`` best tokens of
    (log q - log p)^2, and for the draft's ``k`` best tokens outside them a squared hinge max(0, log q - max(log p,
    the target's k-th best log p))^2 (a draft token ranked above what the target ranks it is pushed down, no further).
    Returns (kl + lam * rank, entropy, gradient w.r.t. zq)."""
    out_dtype = zq.dtype
    lq = torch.log_softmax(zq.float(), -1)
    lp = torch.log_softmax(zp.float(), -1)
    p, q = lp.exp(), lq.exp()
    kl = (p * (lp - lq)).sum(-1)
    ent = -(p * lp).sum(-1)
    vp, ip = torch.topk(lp, k, dim=-1)
    _, iq = torch.topk(lq, k, dim=-1)
    in_p = torch.zeros_like(lp).scatter_(1, ip, 1.0)
    in_q = torch.zeros_like(lp).scatter_(1, iq, 1.0) * (1.0 - in_p)
    d = in_p * (lq - lp) + in_q * torch.relu(lq - torch.maximum(lp, vp[:, -1:]))
    rank = (d * d).sum(-1) / k
    grad = (q - p) + (2.0 * lam / k) * (d - d.sum(-1, keepdim=True) * q)
    return kl + lam * rank, ent, grad.to(out_dtype), kl


_COMPILED: dict = {}


def _kl_terms_fn(compile_: bool, topk: int = 0, lam: float = 0.0):
    """(zq, zp) -> (loss, entropy, gradient, kl) per row: the KL (``topk`` 0) or :func:`_topk_terms`; eager, or
    (``compile_``) torch.compile'd, which fuses the elementwise passes (about 2x faster on a CPU); falls back to
    eager, once, if compilation is not possible here."""
    if topk:
        eager = lambda zq, zp: _topk_terms(zq, zp, topk, lam)  # noqa: E731
    else:
        def eager(zq, zp):
            kl, ent, g = _kl_terms(zq, zp)
            return kl, ent, g, kl
    if not compile_:
        return eager
    key = (topk, lam)
    if key not in _COMPILED:
        try:
            fn = torch.compile(eager, dynamic=False)
            fn(torch.zeros(2, max(8, 2 * topk)), torch.zeros(2, max(8, 2 * topk)))  # fails here without a compiler
            _COMPILED[key] = fn
        except Exception as e:  # pragma: no cover - depends on the toolchain
            import warnings

            warnings.warn(f"torch.compile of the KL loss failed ({type(e).__name__}: {e}); using eager mode")
            _COMPILED[key] = eager
    return _COMPILED[key]


class FusedKL(torch.autograd.Function):
    """Mean over positions of ``KL(softmax(t W^T) || softmax(h W^T))`` with a frozen ``W`` [V, D].

    ``h`` [N, D]: the draft's final hidden states (after the final norm); ``t`` [N, D]: the target's. Processed in
    chunks of ``chunk`` positions; the gradient w.r.t. ``h`` (``(q - p) W / N``) is computed in the forward pass,
    so no [N, V] tensor outlives its chunk. Logits are products in ``W``'s dtype (pass a bfloat16 copy for speed),
    softmaxes are float32. Returns (loss, per-position KL, per-position target entropy) - only loss has a gradient.
    With ``compile_`` the elementwise part is torch.compile'd (chunks padded to ``chunk`` rows: one shape). With
    ``topk`` > 0 the loss is :func:`_topk_terms`' (``lam`` its weight); the per-position values returned stay the KL.
    """

    @staticmethod
    def forward(ctx, h, t, W, chunk, compile_, topk=0, lam=0.0):
        N = h.shape[0]
        fn = _kl_terms_fn(compile_, topk, lam)
        loss = torch.empty(N, dtype=torch.float32, device=h.device)
        grad = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        kl = torch.empty(N, dtype=torch.float32, device=h.device)
        ent = torch.empty(N, dtype=torch.float32, device=h.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            zq = h[s:e].detach().to(W.dtype) @ W.T
            zp = t[s:e].to(W.dtype) @ W.T
            if compile_ and e - s < chunk:
                zq = torch.nn.functional.pad(zq, (0, 0, 0, chunk - (e - s)))
                zp = torch.nn.functional.pad(zp, (0, 0, 0, chunk - (e - s)))
            lo, en, g, k = fn(zq, zp)
            loss[s:e], kl[s:e], ent[s:e] = lo[: e - s], k[: e - s], en[: e - s]
            grad[s:e] = (g[: e - s] @ W).float()
        ctx.save_for_backward(grad)
        ctx.n = N
        ctx.h_dtype = h.dtype
        ctx.mark_non_differentiable(kl, ent)
        return loss.mean(), kl, ent

    @staticmethod
    def backward(ctx, g, _g_kl, _g_ent):
        (grad,) = ctx.saved_tensors
        return (grad * (g / ctx.n)).to(ctx.h_dtype), None, None, None, None, None, None


def fused_kl(h: torch.Tensor, t: torch.Tensor, W: torch.Tensor, chunk: int = 128, compile_: bool = False,
             topk: int = 0, lam: float = 0.0):
    """See :class:`FusedKL`: returns (mean loss, per-position KL, per-position target entropy)."""
    return FusedKL.apply(h, t, W, chunk, compile_, topk, lam)


# ----------------------------------------------------------------------------------------------------------------
# corpus in memory
# ----------------------------------------------------------------------------------------------------------------
class Corpus:
    def __init__(self, paths: list[pathlib.Path]):
        shards = [corp.load_shard(p) for p in paths]
        L = max(s.ids.shape[1] for s in shards)
        self.ids = torch.cat([torch.nn.functional.pad(s.ids, (0, L - s.ids.shape[1])) for s in shards]).long()
        self.lengths = torch.cat([s.lengths for s in shards])
        self.prompt_lengths = torch.cat([s.prompt_lengths for s in shards])
        self.hidden = torch.cat([s.hidden for s in shards])
        n_loss = self.lengths - self.prompt_lengths
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), n_loss.cumsum(0)])
        self.n_loss_tokens = int(n_loss.sum())
        assert self.hidden.shape[0] == self.n_loss_tokens, (self.hidden.shape, self.n_loss_tokens)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, idx: list[int]):
        """(input ids [B, T], loss mask [B, T], target hidden [n, D]) with rows right-padded to the longest."""
        T = int(self.lengths[idx].max())
        ids = self.ids[idx, :T]
        pos = torch.arange(T)[None, :]
        lo = (self.prompt_lengths[idx] - 1)[:, None]
        hi = (self.lengths[idx] - 2)[:, None]
        mask = (pos >= lo) & (pos <= hi)
        hid = torch.cat([self.hidden[self.offsets[i]: self.offsets[i + 1]] for i in idx])
        return ids, mask, hid


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(random.Random(f"order/{seed}/{epoch}").getrandbits(63))
    return torch.randperm(n, generator=g).tolist()


def lr_at(step: int, total: int, cfg: DistillConfig) -> float:
    """Linear warmup, then cosine decay from lr to lr * min_lr_ratio at ``total`` steps (step is 0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------------------------------------------
def build_draft(target: Any, n_layers: int) -> Any:
    """The target's first ``n_layers`` layers (trainable copies) with the target's embedding, final norm and LM
    head (shared, frozen)."""
    from ..testing import models

    n_target = target.config.num_hidden_layers
    if not 1 <= n_layers <= n_target:
        raise ValueError(f"--layers must be in [1, {n_target}] for this target, got {n_layers}")
    draft = models.truncated_draft(target, n_layers)
    for p in draft.parameters():
        p.requires_grad_(False)
    for p in draft.model.layers.parameters():
        p.requires_grad_(True)
    return draft


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(device)}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _atomic_torch_save(obj: Any, path: pathlib.Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def prepare_corpus(cfg: Any, target_dir: pathlib.Path, tok: Any, fingerprint: str, cache_dir: pathlib.Path, *,
                   eos_id: int | None, pad_id: int, tokens: int | None = None, beam_width: int | None = None, gen_batch_size: int | None = None,
                   log: Callable[[str], None] = print) -> tuple[list[pathlib.Path], dict]:
    """The corpus shards (cached in ``cache_dir``, generated when missing) for the settings of ``cfg`` (a
    :class:`DistillConfig` or any object with its corpus fields); ``tokens``, ``beam_width`` and ``gen_batch_size``
    override ``cfg``'s. Shared by the draft and the EAGLE-3 head trainers, so both read the same cache."""
    tokens = cfg.tokens if tokens is None else tokens
    beam_width = cfg.beam_width if beam_width is None else beam_width
    gen_batch_size = cfg.gen_batch_size if gen_batch_size is None else gen_batch_size
    device = torch.device(cfg.device)
    corpus_meta = {"format": corp._FORMAT, "target_fingerprint": fingerprint, "prompts": cfg.prompts,
                   "seq_len": cfg.seq_len, "max_prompt_len": cfg.max_prompt_len, "temperature": cfg.temperature,
                   "gen_batch_size": gen_batch_size, "gen_dtype": cfg.gen_dtype, "seed": cfg.seed}
    if beam_width:  # only then: a sampled corpus cached before this setting existed stays valid
        corpus_meta["beam_width"] = beam_width
    gen_engine = getattr(cfg, "gen_engine", "hf")
    if gen_engine != "hf":  # likewise: HF caches made before the setting existed stay valid
        corpus_meta["gen_engine"] = gen_engine
    corp.check_meta(cache_dir, corpus_meta)
    paths, have = corp.corpus_paths(cache_dir, tokens)
    gen_stats: dict = {"generated_tokens_before": have, "generation_seconds": 0.0, "generated_tokens_new": 0}
    if have < tokens:
        texts = data.load_prompts(cfg.prompts, "train")
        random.Random(f"prompts/{cfg.seed}").shuffle(texts)
        # enough prompts for the corpus even if half the rows stop early (more are reused cyclically)
        n_prompts = min(len(texts), 2 * math.ceil(tokens / (cfg.seq_len - cfg.max_prompt_len)) + 2 * gen_batch_size)
        prompt_ids = [data.encode_prompt(tok, t, cfg.max_prompt_len) for t in texts[:n_prompts]]
        workers = cfg.gen_workers if device.type == "cpu" else 1
        build = corp.build_corpus if gen_engine == "hf" else corpus_vllm.build_corpus
        paths, gen_stats = build(
            str(target_dir), prompt_ids, cache_dir, n_tokens=tokens, seq_len=cfg.seq_len,
            gen_batch_size=gen_batch_size, temperature=cfg.temperature, seed=cfg.seed, device=str(device),
            eos_id=eos_id, pad_id=pad_id, gen_dtype=cfg.gen_dtype, workers=workers, threads=cfg.threads,
            progress=cfg.progress, log=log, beam_width=beam_width)
    return paths, gen_stats


def special_ids(tok, target) -> tuple[int | None, int]:
    """(EOS id, padding id) for corpus generation: the tokenizer's, else the model config's EOS (the first of a list);
    padding falls back to EOS, then 0."""
    eos_id = tok.eos_token_id if tok.eos_token_id is not None else target.config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_id if eos_id is not None else 0)
    return eos_id, pad_id


def distill(cfg: DistillConfig, log: Callable[[str], None] = print) -> pathlib.Path:
    """Runs (or resumes) a distillation; returns the output folder. See the module docstring."""
    from tqdm.auto import tqdm

    from ..testing import models

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked but no CUDA device is available")
    target_dir = art.check_target_dir(cfg.target)
    work = cfg.work_path
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    target = models.load_hf(target_dir, dtype=torch.float32)
    if not hasattr(target, "model") or not hasattr(target.model, "layers"):
        raise ValueError(f"{target_dir}: not a Llama-family causal LM (no model.layers)")
    fingerprint = art.target_fingerprint(target)
    tok = models.load_tokenizer(target_dir)
    eos_id, pad_id = special_ids(tok, target)

    # 1. corpus ---------------------------------------------------------------------------------------------------
    paths, gen_stats = prepare_corpus(cfg, target_dir, tok, fingerprint, work / "corpus", eos_id=eos_id, pad_id=pad_id,
                                      log=log)
    ckpt_path = work / CKPT
    corpus = Corpus(paths)

    # 2. draft + optimizer ----------------------------------------------------------------------------------------
    draft = build_draft(target, cfg.layers)
    if cfg.init:
        _load_init(draft, cfg.init, cfg.layers)
        log(f"starting from the layers of {cfg.init}")
    del target  # the layers above the draft's are no longer referenced
    draft.to(device)
    W = draft.get_output_embeddings().weight.detach()
    W_mm = W.to(_dtype(cfg.train_dtype)) if _dtype(cfg.train_dtype) != W.dtype else W
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(corpus) / cfg.batch_size)
    total = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    run_key = {"target_fingerprint": fingerprint, "layers": cfg.layers, "corpus_sequences": len(corpus),
               "corpus_tokens": corpus.n_loss_tokens, "batch_size": cfg.batch_size, "total_steps": total,
               "lr": cfg.lr, "min_lr_ratio": cfg.min_lr_ratio, "warmup_steps": cfg.warmup_steps,
               "weight_decay": cfg.weight_decay, "seed": cfg.seed}
    if cfg.loss != "kl" or cfg.init:
        run_key.update(loss=cfg.loss, topk=cfg.topk, topk_weight=cfg.topk_weight, init=cfg.init)
    step, elapsed_before, loss_log = 0, 0.0, []
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        if ck["run_key"] != run_key:
            diff = {k: (ck["run_key"].get(k), v) for k, v in run_key.items() if ck["run_key"].get(k) != v}
            raise ValueError(f"checkpoint {ckpt_path} belongs to another run {diff} (checkpoint, asked); "
                             "use another --work-dir or delete the checkpoint")
        draft.model.layers.load_state_dict(ck["layers"])
        opt.load_state_dict(ck["optimizer"])
        step, elapsed_before, loss_log = ck["step"], ck["train_seconds"], ck["loss_log"]
        log(f"resuming from {ckpt_path} at step {step}/{total}")

    def save_ckpt():
        _atomic_torch_save({"run_key": run_key, "step": step, "layers": draft.model.layers.state_dict(),
                            "optimizer": opt.state_dict(), "train_seconds": elapsed_before + time.time() - t_train,
                            "loss_log": loss_log}, ckpt_path)

    # 3. training -------------------------------------------------------------------------------------------------
    amp = _dtype(cfg.train_dtype) != torch.float32
    draft.train()
    t_train = time.time()
    bar = tqdm(total=total, initial=step, desc="distilling", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    acc_loss, acc_n, acc_tok, tok_seen = 0.0, 0, 0, 0
    log_every = max(1, min(cfg.save_every, 25))
    stop_at = total if cfg.stop_after is None else min(total, step + cfg.stop_after)
    while step < stop_at:
        epoch, k = divmod(step, steps_per_epoch)
        order = epoch_order(len(corpus), cfg.seed, epoch)
        idx = order[k * cfg.batch_size: (k + 1) * cfg.batch_size]
        ids, mask, hid = corpus.batch(idx)
        ids, mask, hid = ids.to(device), mask.to(device), hid.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        with torch.autocast(device.type, dtype=_dtype(cfg.train_dtype), enabled=amp):
            h = draft.model(input_ids=ids, use_cache=False).last_hidden_state
        loss, kl, _ = fused_kl(h[mask].float(), hid, W_mm, cfg.kl_chunk, cfg.compile_loss,
                               cfg.topk if cfg.loss == "topk" else 0, cfg.topk_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        n = kl.numel()
        acc_loss += float(kl.sum())
        acc_n += n
        tok_seen += n
        bar.update(1)
        bar.set_postfix(kl=f"{acc_loss / max(acc_n, 1):.3f}", lr=f"{group['lr']:.1e}",
                        tok_s=f"{tok_seen / max(time.time() - t_train, 1e-9):.0f}")
        if step % log_every == 0 or step == total:
            loss_log.append([step, round(acc_loss / max(acc_n, 1), 5)])
            acc_loss, acc_n = 0.0, 0
        if step % cfg.save_every == 0 or step == stop_at:
            save_ckpt()
    bar.close()
    train_seconds = elapsed_before + time.time() - t_train
    if step < total:
        log(f"stopped at step {step}/{total} (--stop-after); checkpoint {ckpt_path}: re-run to continue")
        return pathlib.Path(cfg.out)

    # 4. output ---------------------------------------------------------------------------------------------------
    draft.eval().to("cpu")
    with torch.no_grad():  # the published draft holds float16 values: the artifact rebuilds it exactly
        for p in draft.model.layers.parameters():
            p.copy_(p.to(torch.float16).to(p.dtype))
    n_layer_params = sum(p.numel() for p in draft.model.layers.parameters())
    meta = {
        "num_hidden_layers": cfg.layers,
        "target": str(target_dir),
        "target_fingerprint": fingerprint,
        "method": ("forward KL(target || draft) on the full vocabulary" + (
                   f" + {cfg.topk_weight} x the top-{cfg.topk} log-probability error" if cfg.loss == "topk" else "")
                   + " at every generated position of text the target " + (
                   f"beam-searched itself (width {cfg.beam_width}, final beams)" if cfg.beam_width else
                   "sampled itself") + "; draft = " + (f"the layers of {cfg.init} (init)" if cfg.init else
                   "target's first layers (init)") + " + target's embedding, final norm and LM head (frozen, shared)"),
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items()
                     if k not in ("target", "out", "work_dir", "artifact", "progress", "stop_after")},
        "work_dir": str(work),
        "corpus": {"sequences": len(corpus), "generated_tokens": corpus.n_loss_tokens,
                   "prompt_tokens": int(corpus.prompt_lengths.sum()),
                   "generation_process_seconds": corp.shard_generation_seconds(paths), **gen_stats},
        "training": {"steps": total, "trained_tokens": _trained_tokens(corpus, cfg, total, steps_per_epoch),
                     "train_seconds": round(train_seconds, 1), "loss_log": loss_log},
        "draft_layer_params": n_layer_params,
        "draft_layer_bytes_fp16": 2 * n_layer_params,
        "machine": machine_info(device),
        "wall_seconds_this_run": round(time.time() - t_start, 1),
    }
    out = art.save_draft_folder(draft, target_dir, pathlib.Path(cfg.out), meta)
    log(f"draft written to {out} ({cfg.layers} layers, {n_layer_params / 1e6:.2f} M own parameters)")
    if cfg.artifact:
        art.export_artifact(out, cfg.artifact)
        log(f"artifact written to {cfg.artifact}")
    return out


def _load_init(draft: Any, folder: str, n_layers: int) -> None:
    """Copies the decoder layers of the draft folder ``folder`` (HF format, same target) into ``draft``."""
    from ..testing import models

    src = models.load_hf(pathlib.Path(folder).expanduser(), dtype=torch.float32)
    if src.config.num_hidden_layers != n_layers:
        raise ValueError(f"--init {folder} has {src.config.num_hidden_layers} layers, --layers is {n_layers}")
    with torch.no_grad():
        for d, s in zip(draft.model.layers.parameters(), src.model.layers.parameters()):
            d.copy_(s)


def _trained_tokens(corpus: Corpus, cfg: DistillConfig, total: int, steps_per_epoch: int) -> int:
    n = 0
    loss = corpus.lengths - corpus.prompt_lengths
    for step in range(total):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:
            order = epoch_order(len(corpus), cfg.seed, epoch)
        n += int(loss[order[k * cfg.batch_size: (k + 1) * cfg.batch_size]].sum())
    return n


@torch.no_grad()
def mean_kl(draft: Any, corpus: Corpus, batch_size: int = 8, kl_chunk: int = 128) -> dict:
    """Mean forward KL(target || draft) (and mean target entropy) over every loss position of ``corpus``, in
    float32 - a deterministic measure of how well ``draft`` matches the target on that corpus."""
    draft.eval()
    device = next(draft.parameters()).device
    W = draft.get_output_embeddings().weight.detach().float()
    tot_kl = tot_ent = 0.0
    n = 0
    for s in range(0, len(corpus), batch_size):
        ids, mask, hid = corpus.batch(list(range(s, min(len(corpus), s + batch_size))))
        h = draft.model(input_ids=ids.to(device), use_cache=False).last_hidden_state
        _, kl, ent = fused_kl(h[mask.to(device)].float(), hid.to(device).float(), W, kl_chunk)
        tot_kl += float(kl.sum())
        tot_ent += float(ent.sum())
        n += kl.numel()
    return {"kl": tot_kl / max(n, 1), "target_entropy": tot_ent / max(n, 1), "positions": n}
