"""Training of an EAGLE-3 head for a Llama-family target (``python -m vllm_dsbd.distill --head eagle3``).

Data: the target's own generations, cached by ``corpus.py`` exactly as the draft distillation caches them (sampled at
``temperature``, and optionally ``--beam-tokens`` of its beam searches of width ``--beam-width``). One extra pass of
the target over every row gives its auxiliary hidden states (the residual stream entering layers
``aux_layer_ids``, vLLM's default (2, L // 2, L - 3)) and final hidden state at every position, cached in
``<work>/features-*.safetensors`` (float16).

Vocabulary: the ``--draft-vocab`` tokens the target generated most often in the corpus (ties: lower id); the
target's probability mass inside it is reported. The head's LM head is the target's LM head rows of those tokens,
frozen (so the committed artifact need not store it: ``eagle3_artifact.py``).

Training-time test (EAGLE-3): depth 0 runs the head at every position t on (fc(target features at t), token t + 1);
depth k feeds back the head's own pre-norm hidden state of depth k - 1 with token t + k + 1 at position t + k, its
query attending to depth 0's keys at positions <= t and to its own chain's keys of depths 1..k (what a drafted chain
rooted at t sees at inference). The loss at depth k is the forward KL from the target's distribution at position
t + k + 1 (renormalised over the draft vocabulary) to the head's, at generated positions, weighted ``decay**k``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import artifact as art
from . import eagle3
from .train import Corpus, machine_info, prepare_corpus, special_ids


@dataclass
class HeadConfig:
    """Settings of one head training run (the flags of ``python -m vllm_dsbd.distill --head eagle3``)."""

    target: str
    out: str
    draft_vocab: int = 8192
    depth: int = 3  # training-time test unroll (forest depths)
    depth_decay: float = 0.8
    tokens: int = 60_000  # sampled corpus (generated tokens)
    beam_tokens: int = 0  # beam-search corpus (generated tokens), 0: none
    beam_width: int = 4
    seq_len: int = 128
    max_prompt_len: int = 64
    prompts: str = "sharegpt"
    temperature: float = 1.0
    gen_batch_size: int = 32
    beam_gen_batch_size: int = 8
    gen_dtype: str = "bfloat16"
    feature_dtype: str = "bfloat16"  # dtype of the target pass that computes the features
    train_dtype: str = "bfloat16"  # autocast dtype of the head's matmuls; weights and softmax stay float32
    batch_size: int = 8
    epochs: float = 2.0
    max_steps: int | None = None
    max_minutes: float | None = None  # stop training after this wall time (the lr schedule follows the time)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gen_workers: int = 1
    gen_engine: str = "hf"  # "hf" or "vllm" (train.DistillConfig.gen_engine)
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    work_dir: str | None = None
    corpus_dir: str | None = None  # default <work>/corpus
    beam_corpus_dir: str | None = None  # default <work>/corpus-beam<W>
    artifact: str | None = None
    progress: bool = True

    def validate(self) -> None:
        for name in ("draft_vocab", "depth", "tokens", "seq_len", "max_prompt_len", "batch_size", "gen_batch_size",
                     "beam_gen_batch_size", "gen_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.beam_tokens < 0 or self.beam_width < 2:
            raise ValueError("--beam-tokens must be >= 0 and --beam-width >= 2")
        if self.max_prompt_len >= self.seq_len:
            raise ValueError(f"--max-prompt-len ({self.max_prompt_len}) must be < --seq-len ({self.seq_len})")
        if self.lr <= 0 or self.epochs <= 0 or not 0 < self.depth_decay <= 1:
            raise ValueError("--lr and --epochs must be > 0, --depth-decay in (0, 1]")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError("--max-minutes must be > 0")
        if self.gen_engine not in ("hf", "vllm"):
            raise ValueError(f"--gen-engine must be hf or vllm, got {self.gen_engine!r}")
        for name in ("gen_dtype", "feature_dtype", "train_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"--{name.replace('_', '-')} must be float32, bfloat16 or float16")
        art.check_target_dir(self.target)

    @property
    def work_path(self) -> pathlib.Path:
        out = pathlib.Path(self.out).expanduser()
        return pathlib.Path(self.work_dir).expanduser() if self.work_dir else out.with_name(out.name + ".work")


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ----------------------------------------------------------------------------------------------------------------
# features, vocabulary
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def target_features(model: Any, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T, len(layer_ids) * D], final hidden after the norm [B, T, D]) of the target on ``ids`` [B, T]
    (right padding is harmless: attention is causal)."""
    o = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([o.hidden_states[i] for i in layer_ids], -1), o.last_hidden_state


def corpus_features(model: Any, corpus: Corpus, layer_ids: list[int], cache: pathlib.Path, *, batch: int = 8,
                    progress: bool = True, log: Callable[[str], None] = print) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of every corpus row ([N, L, 3D] and [N, L, D], float16), cached in ``cache``."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    if cache.is_file():
        t = load_file(str(cache))
        log(f"features read from {cache}")
        return t["aux"], t["final"]
    N, L = corpus.ids.shape
    dt = next(model.parameters()).dtype
    aux = torch.zeros(N, L, len(layer_ids) * model.config.hidden_size, dtype=torch.float16)
    fin = torch.zeros(N, L, model.config.hidden_size, dtype=torch.float16)
    order = sorted(range(N), key=lambda i: int(corpus.lengths[i]))
    t0 = time.time()
    for s in tqdm(range(0, N, batch), desc="features", disable=not progress, dynamic_ncols=True):
        idx = order[s: s + batch]
        T = int(corpus.lengths[idx].max())
        a, f = target_features(model, corpus.ids[idx, :T], layer_ids)
        aux[idx, :T], fin[idx, :T] = a.to(torch.float16), f.to(torch.float16)
    log(f"features of {N} rows ({int(corpus.lengths.sum())} positions, {dt}) in {time.time() - t0:.0f} s")
    tmp = cache.with_name(cache.name + ".tmp")
    save_file({"aux": aux, "final": fin}, str(tmp))
    tmp.replace(cache)
    return aux, fin


def generated_mask(corpus: Corpus, T: int) -> torch.Tensor:
    """[N, T] bool: positions holding a generated token."""
    pos = torch.arange(T)[None]
    return (pos >= corpus.prompt_lengths[:, None]) & (pos < corpus.lengths[:, None])


def select_vocab(corpus: Corpus, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` target tokens generated most often in the corpus (ties and the rest: lower id first), ascending."""
    ids = corpus.ids[:, : corpus.ids.shape[1]]
    gen = ids[generated_mask(corpus, ids.shape[1])]
    counts = torch.bincount(gen, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)  # tie-break: lower id first
    return torch.topk(counts, n).indices.sort().values


@torch.no_grad()
def vocab_mass(final: torch.Tensor, W: torch.Tensor, vocab: torch.Tensor, n: int = 4096, seed: int = 0) -> float:
    """Mean target probability mass inside ``vocab`` at ``n`` random rows of ``final`` [M, D]."""
    g = torch.Generator().manual_seed(seed)
    rows = final[torch.randperm(final.shape[0], generator=g)[:n]].float()
    p = torch.softmax(rows @ W.float().T, -1)
    return float(p[:, vocab].sum(-1).mean())


# ----------------------------------------------------------------------------------------------------------------
# training-time test
# ----------------------------------------------------------------------------------------------------------------
def ttt_mask(Lq: int, k: int, device=None) -> torch.Tensor:
    """[1, Lq, Lq * (k + 1)]: depth-k queries see depth-0 keys causally and their own chain's keys (diagonal)."""
    blocks = [torch.ones(Lq, Lq, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(Lq, dtype=torch.bool, device=device)] * k
    return torch.cat(blocks, 1)[None]


def ttt_forward(head: eagle3.Eagle3Head, ids: torch.Tensor, aux: torch.Tensor, depth: int):
    """Normed head outputs per depth, [B, T - 1, D] each: depth k at query t drafts the token at t + k + 2."""
    B, T = ids.shape
    Lq = T - 1
    t = torch.arange(Lq, device=ids.device)
    h = head.combine(aux[:, :Lq])
    ks, vs, outs = [], [], []
    for k in range(depth):
        tok = ids[:, (t + k + 1).clamp(max=T - 1)]
        (q, kk, vv), resid = head.layer_input(tok, h, (t + k)[None].expand(B, Lq))
        ks.append(kk)
        vs.append(vv)
        a = head.midlayer.self_attn.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), ttt_mask(Lq, k, ids.device))
        out, h = head.layer_output(a, resid)
        outs.append(out)
    return outs


def ttt_loss(head, ids, aux, final, plen, length, W_d, depth: int, decay: float):
    """(weighted loss, [per-depth mean KL], [per-depth positions]) of a batch; ``W_d`` the target's LM head rows of
    the draft vocabulary. Target at query t, depth k: its distribution at position s = t + k + 1, for generated s."""
    T = ids.shape[1]
    outs = ttt_forward(head, ids, aux, depth)
    t = torch.arange(T - 1, device=ids.device)[None]
    loss, kls, ns = 0.0, [], []
    for k, out in enumerate(outs):
        s = t + k + 1
        m = (s >= plen[:, None] - 1) & (s <= length[:, None] - 2)
        if not bool(m.any()):
            kls.append(float("nan"))
            ns.append(0)
            continue
        zq = head.logits(out[m]).float()
        tgt = final[:, s[0].clamp(max=T - 1)]
        zp = tgt[m].float() @ W_d.T
        lp, lq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        loss = loss + decay ** k * kl.mean()
        kls.append(float(kl.detach().mean()))
        ns.append(int(kl.numel()))
    return loss, kls, ns


# ----------------------------------------------------------------------------------------------------------------
def train_head(cfg: HeadConfig, log: Callable[[str], None] = print) -> pathlib.Path:
    """Runs a head training (corpus, features, vocabulary, training-time test); returns the head folder."""
    from tqdm.auto import tqdm

    from ..testing import models

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.time()
    device = torch.device(cfg.device)
    target_dir = art.check_target_dir(cfg.target)
    work = cfg.work_path
    work.mkdir(parents=True, exist_ok=True)
    target = models.load_hf(target_dir, dtype=torch.float32)
    fingerprint = art.target_fingerprint(target)
    tok = models.load_tokenizer(target_dir)
    eos_id, pad_id = special_ids(tok, target)

    # 1. corpus: sampled (+ beam-searched) ----------------------------------------------------------------------
    sets = [("sampled", cfg.tokens, 0, cfg.gen_batch_size, cfg.corpus_dir or work / "corpus")]
    if cfg.beam_tokens:
        sets.append(("beam", cfg.beam_tokens, cfg.beam_width, cfg.beam_gen_batch_size,
                     cfg.beam_corpus_dir or work / f"corpus-beam{cfg.beam_width}"))
    paths, corpus_info = [], {}
    for name, n_tok, bw, gbs, cdir in sets:
        p, stats = prepare_corpus(cfg, target_dir, tok, fingerprint, pathlib.Path(cdir), eos_id=eos_id, pad_id=pad_id,
                                  tokens=n_tok, beam_width=bw, gen_batch_size=gbs, log=log)
        paths += p
        corpus_info[name] = {"shards": len(p), "asked_tokens": n_tok, **stats}
    corpus = Corpus(paths)
    corpus_info.update(sequences=len(corpus), generated_tokens=corpus.n_loss_tokens,
                       prompt_tokens=int(corpus.prompt_lengths.sum()))
    log(f"corpus: {len(corpus)} rows, {corpus.n_loss_tokens} generated tokens")

    # 2. features, vocabulary -----------------------------------------------------------------------------------
    layer_ids = eagle3.default_aux_layers(target.config.num_hidden_layers)
    key = hashlib.sha256(json.dumps([fingerprint, [str(p.name) + str(p.parent) for p in paths], layer_ids,
                                     cfg.feature_dtype]).encode()).hexdigest()[:16]
    fmodel = target.to(_dtype(cfg.feature_dtype)).to(device).eval()
    t_feat = time.time()
    aux, final = corpus_features(fmodel, corpus, layer_ids, work / f"features-{key}.safetensors",
                                 progress=cfg.progress, log=log)
    feat_seconds = time.time() - t_feat
    target.float().to("cpu")
    W_full = target.get_output_embeddings().weight.detach().float()
    vocab = select_vocab(corpus, target.config.vocab_size, cfg.draft_vocab)
    gm = generated_mask(corpus, corpus.ids.shape[1])
    lm = torch.zeros_like(gm)  # loss positions: the hidden state before each generated token
    lm[:, :-1] = gm[:, 1:]
    mass = vocab_mass(final[lm], W_full, vocab, seed=cfg.seed)
    log(f"draft vocabulary: {cfg.draft_vocab} tokens hold {mass:.4f} of the target's probability mass")

    # 3. head --------------------------------------------------------------------------------------------------
    hc = eagle3.Eagle3Config.for_target(target.config, cfg.draft_vocab)
    torch.manual_seed(cfg.seed)
    head = eagle3.Eagle3Head(hc, embed=target.get_input_embeddings().weight.detach().float())
    head.set_vocab(vocab)
    eagle3.init_from_target(head, target, seed=cfg.seed)
    del target
    head.to(device).train()
    head.embed = head.embed.to(device)
    head.lm_head.weight.requires_grad_(False)  # the target's rows, frozen
    W_d = head.lm_head.weight.detach()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(corpus) / cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    budget = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes
    amp = _dtype(cfg.train_dtype) != torch.float32

    def lr_at(frac: float, step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    step, trained, log_rows = 0, 0, []
    acc = [[0.0, 0] for _ in range(cfg.depth)]
    t_train = time.time()
    bar = tqdm(total=total, desc="training head", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    while step < total:
        elapsed = time.time() - t_train
        if budget is not None and elapsed >= budget:
            break
        epoch, k = divmod(step, steps_per_epoch)
        g = torch.Generator().manual_seed(random.Random(f"order/{cfg.seed}/{epoch}").getrandbits(63))
        idx = torch.randperm(len(corpus), generator=g)[k * cfg.batch_size: (k + 1) * cfg.batch_size].tolist()
        T = int(corpus.lengths[idx].max())
        ids = corpus.ids[idx, :T].to(device)
        a, f = aux[idx, :T].to(device).float(), final[idx, :T].to(device)
        frac = max(step / total, elapsed / budget if budget else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, step)
        with torch.autocast(device.type, dtype=_dtype(cfg.train_dtype), enabled=amp):
            loss, kls, ns = ttt_loss(head, ids, a, f, corpus.prompt_lengths[idx].to(device),
                                     corpus.lengths[idx].to(device), W_d, cfg.depth, cfg.depth_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        trained += ns[0]
        for d in range(cfg.depth):
            if ns[d]:
                acc[d][0] += kls[d] * ns[d]
                acc[d][1] += ns[d]
        bar.update(1)
        bar.set_postfix(kl0=f"{acc[0][0] / max(acc[0][1], 1):.3f}", lr=f"{group['lr']:.1e}")
        if step % 25 == 0 or step == total:
            log_rows.append([step, round(time.time() - t_train, 1)] + [round(s / max(n, 1), 4) for s, n in acc])
            acc = [[0.0, 0] for _ in range(cfg.depth)]
    bar.close()
    if acc[0][1]:
        log_rows.append([step, round(time.time() - t_train, 1)] + [round(s / max(n, 1), 4) for s, n in acc])
    train_seconds = time.time() - t_train

    # 4. output: float16 values, the public folder (+ the artifact) --------------------------------------------
    head.eval().to("cpu")
    head.embed = head.embed.cpu()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.float16).to(p.dtype))
    meta = {"target_fingerprint": fingerprint, "target": str(target_dir),
            "method": "EAGLE-3 head, training-time test over depth "
                      f"{cfg.depth} (weights {cfg.depth_decay}^k), forward KL to the target's distribution renormalised "
                      "over the draft vocabulary, at generated positions of the target's own generations; LM head = "
                      "the target's rows (frozen)",
            "settings": {k: v for k, v in dataclasses.asdict(cfg).items()
                         if k not in ("target", "out", "work_dir", "artifact", "progress", "corpus_dir",
                                      "beam_corpus_dir")},
            "corpus": corpus_info, "aux_layer_ids": layer_ids, "vocab_target_mass": round(mass, 5),
            "feature_seconds": round(feat_seconds, 1),
            "training": {"steps": step, "planned_steps": total, "trained_positions": trained,
                         "train_seconds": round(train_seconds, 1),
                         "log_columns": ["step", "seconds"] + [f"kl_depth{d}" for d in range(cfg.depth)],
                         "log": log_rows},
            "head_params": sum(p.numel() for p in head.parameters()), "machine": machine_info(device),
            "wall_seconds": round(time.time() - t_start, 1)}
    out = eagle3.save_head(head, cfg.out)
    (pathlib.Path(out) / "distill.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log(f"head written to {out} ({step} steps, {trained} positions, {train_seconds:.0f} s)")
    if cfg.artifact:
        from .eagle3_artifact import export_head_artifact

        export_head_artifact(out, cfg.artifact)
        log(f"artifact written to {cfg.artifact}")
    return pathlib.Path(out)
