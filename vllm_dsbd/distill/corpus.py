"""The training corpus: text the target generates itself, cached on disk with the target's final hidden states.

The target samples continuations of prompts at ``temperature`` (1 by default: the distribution speculative sampling
verifies against) with a KV cache, ``gen_batch_size`` sequences at a time; or (``beam_width`` W >= 2) runs its own
beam search of width W on each prompt and keeps the W final beams as W rows: the contexts a beam request's draft
forest is drafted from (:func:`generate_beam_batch`). For every position whose next token was
*generated* (the last prompt position and every generated token but the last) the cache keeps the target's final
hidden state (after its final norm, float16): the target's full next-token distribution there is
``softmax(lm_head(h))``, recomputed at training time for the cost of one LM-head product, so the training loss is
the forward KL on the full vocabulary without storing 49k logits per token (1.1 KB per token instead of 98 KB).

Layout of ``<cache_dir>``::

    meta.json                 what the corpus is (target fingerprint, prompts, lengths, seed, dtype)
    shard-00000.safetensors   ids [N, seq_len] int32 (padded with pad_id), lengths [N], prompt_lengths [N],
    shard-00001.safetensors   hidden [n_loss, D] float16: the loss positions of row 0, then row 1, ...
    ...

Shard ``k`` is generated from training prompts ``k*G .. k*G+G-1`` (G = gen_batch_size) of the seeded prompt order,
with a random generator seeded by ``(seed, k)``: a shard's content does not depend on which run wrote it, so an
interrupted generation resumes at the first missing shard, and asking for more tokens later appends shards.
Sequence ``i`` holds ``lengths[i]`` tokens (prompt + generated, ending at EOS or at ``seq_len``); its loss positions
are ``prompt_lengths[i]-1 .. lengths[i]-2`` (the target's hidden state at position t predicts token t+1).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

META = "meta.json"
_FORMAT = 1


def _atomic_save_safetensors(tensors: dict, path: pathlib.Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def shard_path(cache_dir: pathlib.Path, k: int) -> pathlib.Path:
    return cache_dir / f"shard-{k:05d}.safetensors"


@dataclass
class Shard:
    ids: torch.Tensor  # [N, L] int32
    lengths: torch.Tensor  # [N]
    prompt_lengths: torch.Tensor  # [N]
    hidden: torch.Tensor  # [n_loss, D] float16

    @property
    def n_loss(self) -> int:
        return int((self.lengths - self.prompt_lengths).sum())


def load_shard(path: pathlib.Path) -> Shard:
    from safetensors.torch import load_file

    t = load_file(str(path))
    return Shard(t["ids"], t["lengths"].long(), t["prompt_lengths"].long(), t["hidden"])


def shard_loss_tokens(path: pathlib.Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["n_loss"])


def shard_generation_seconds(paths: list[pathlib.Path]) -> float | None:
    """Total generation time recorded in the shards (None if a shard predates the record)."""
    from safetensors import safe_open

    total = 0.0
    for path in paths:
        with safe_open(str(path), "pt") as f:
            sec = f.metadata().get("seconds")
        if sec is None:
            return None
        total += float(sec)
    return total


def check_meta(cache_dir: pathlib.Path, meta: dict) -> None:
    """Writes ``meta.json`` on first use; afterwards refuses a corpus made differently (clear error, no silent mix)."""
    path = cache_dir / META
    if path.is_file():
        old = json.loads(path.read_text())
        if old != meta:
            diff = {k: (old.get(k), meta.get(k)) for k in set(old) | set(meta) if old.get(k) != meta.get(k)}
            raise ValueError(
                f"the generation cache {cache_dir} was made with other settings {diff} (cached, asked); "
                "use another --work-dir or delete that folder")
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, P], attention mask [B, P], prompt lengths [B]) of the prompts left-padded to the longest, P."""
    plen = torch.tensor([len(p) for p in prompts])
    P = int(plen.max())
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask, plen


@torch.no_grad()
def generate_batch(model: Any, prompts: list[list[int]], *, seq_len: int, temperature: float, eos_id: int | None,
                   pad_id: int, generator: torch.Generator, device: torch.device) -> Shard:
    """Samples one continuation per prompt (left-padded batch, KV cache) until EOS or ``seq_len`` tokens in all."""
    from transformers import DynamicCache

    B = len(prompts)
    ids, mask, plen = _left_padded(prompts, pad_id)
    P = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    h = out.last_hidden_state[:, -1]  # after the final norm
    gen: list[list[int]] = [[] for _ in range(B)]
    hid: list[list[torch.Tensor]] = [[] for _ in range(B)]
    budget = (seq_len - plen).tolist()
    active = [b > 0 for b in budget]
    next_pos = pos[:, -1] + 1
    while any(active):
        logits = model.lm_head(h).float()
        if temperature > 0:
            # inverse-CDF sampling (10x faster than torch.multinomial on a CPU over a 49k vocabulary)
            cdf = torch.softmax(logits / temperature, dim=-1).double().cumsum_(-1)
            u = torch.rand((B, 1), generator=generator, device=device, dtype=torch.float64) * cdf[:, -1:]
            tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        else:
            tok = logits.argmax(-1)
        h16 = h.to(torch.float16).cpu()
        tok_cpu = tok.cpu().tolist()
        for i in range(B):
            if not active[i]:
                continue
            hid[i].append(h16[i])
            gen[i].append(tok_cpu[i])
            if (eos_id is not None and tok_cpu[i] == eos_id) or len(gen[i]) >= budget[i]:
                active[i] = False
        if not any(active):
            break
        feed = torch.tensor([t if a else pad_id for t, a in zip(tok_cpu, active)], device=device)[:, None]
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model.model(input_ids=feed, attention_mask=mask, position_ids=next_pos[:, None], past_key_values=cache,
                          use_cache=True)
        next_pos = next_pos + 1
        h = out.last_hidden_state[:, -1]
    rows = torch.full((B, seq_len), pad_id, dtype=torch.int32)
    lengths = torch.zeros(B, dtype=torch.int32)
    for i, p in enumerate(prompts):
        seq = list(p) + gen[i]
        rows[i, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        lengths[i] = len(seq)
    hidden = torch.cat([torch.stack(hs) for hs in hid if hs]) if any(hid) else torch.zeros(0, h.shape[-1])
    # loss positions of row i: prompt_len-1 .. length-2, i.e. one hidden state per generated token
    return Shard(rows, lengths.long(), plen.long(), hidden.to(torch.float16))


@torch.no_grad()
def generate_beam_batch(model: Any, prompts: list[list[int]], *, seq_len: int, beam_width: int, eos_id: int | None,
                        pad_id: int, device: torch.device) -> Shard:
    """The target's own beam search (``transformers``' ``generate``, ``num_beams`` = W, deterministic) on each
    prompt; its W final beams become W rows (prompt + beam, cut at the first EOS), and one forward pass over the rows
    gives the hidden states at every generated position (same layout as :func:`generate_batch`)."""
    B, W = len(prompts), beam_width
    ids, mask, plen = _left_padded(prompts, pad_id)
    P = ids.shape[1]
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), num_beams=W,
                         num_return_sequences=W, do_sample=False, max_new_tokens=int(seq_len - plen.min()),
                         eos_token_id=eos_id, pad_token_id=pad_id, length_penalty=1.0, early_stopping=True)
    gen = out[:, P:].cpu()
    seqs = []
    for r in range(B * W):
        i = r // W
        g = gen[r].tolist()[: seq_len - len(prompts[i])]
        if eos_id is not None and eos_id in g:
            g = g[: g.index(eos_id) + 1]
        seqs.append(list(prompts[i]) + (g or [eos_id if eos_id is not None else pad_id]))
    return rows_shard(model, seqs, plen.repeat_interleave(W).tolist(), seq_len=seq_len, pad_id=pad_id, device=device)


@torch.no_grad()
def rows_shard(model: Any, seqs: list[list[int]], prompt_lengths: list[int], *, seq_len: int, pad_id: int,
               device: torch.device, batch: int = 16) -> Shard:
    """A shard of finished rows (prompt + generated tokens, ``prompt_lengths[r]`` of them the prompt): the target's
    final hidden state at every generated position comes from forward passes over the rows, ``batch`` at a time."""
    N = len(seqs)
    rows = torch.full((N, seq_len), pad_id, dtype=torch.int32)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    plen = torch.tensor(prompt_lengths, dtype=torch.long)
    for r, s in enumerate(seqs):
        rows[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    hidden = []
    for a in range(0, N, batch):
        L = int(lengths[a: a + batch].max())
        x = rows[a: a + batch, :L].long()
        am = (torch.arange(L)[None, :] < lengths[a: a + batch, None]).long()
        h = model.model(input_ids=x.to(device), attention_mask=am.to(device), use_cache=False).last_hidden_state.cpu()
        hidden += [h[r - a, plen[r] - 1: lengths[r] - 1] for r in range(a, min(a + batch, N))]
    return Shard(rows, lengths, plen, torch.cat(hidden).to(torch.float16))


def present_shards(cache_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """Index -> path of every complete shard in ``cache_dir``."""
    out = {}
    for f in cache_dir.glob("shard-*.safetensors"):
        try:
            out[int(f.name[6:11])] = f
        except ValueError:
            pass
    return out


def corpus_paths(cache_dir: pathlib.Path, n_tokens: int) -> tuple[list[pathlib.Path], int]:
    """The shards 0, 1, ... (in order, stopping at the first gap) that hold ``n_tokens`` loss tokens, and their
    token count (less than ``n_tokens`` when the cache is short)."""
    have, paths = 0, []
    shards = present_shards(cache_dir)
    k = 0
    while have < n_tokens and k in shards:
        paths.append(shards[k])
        have += shard_loss_tokens(shards[k])
        k += 1
    return paths, have


def _shard_prompts(prompt_ids: list[list[int]], k: int, gen_batch_size: int) -> list[list[int]]:
    batch = [prompt_ids[(k * gen_batch_size + j) % len(prompt_ids)] for j in range(gen_batch_size)]
    return sorted(batch, key=len)  # similar lengths together: little left padding


def _make_shard(model, prompt_ids, k, cache_dir, *, seq_len, gen_batch_size, temperature, seed, device, eos_id,
                pad_id, beam_width=0) -> int:
    t0 = time.time()
    g = torch.Generator(device=device)
    g.manual_seed(random.Random(f"{seed}/{k}").getrandbits(63))
    if beam_width:
        shard = generate_beam_batch(model, _shard_prompts(prompt_ids, k, gen_batch_size), seq_len=seq_len,
                                    beam_width=beam_width, eos_id=eos_id, pad_id=pad_id, device=device)
    else:
        shard = generate_batch(model, _shard_prompts(prompt_ids, k, gen_batch_size), seq_len=seq_len,
                               temperature=temperature, eos_id=eos_id, pad_id=pad_id, generator=g, device=device)
    _atomic_save_safetensors(
        {"ids": shard.ids, "lengths": shard.lengths.int(), "prompt_lengths": shard.prompt_lengths.int(),
         "hidden": shard.hidden},
        shard_path(cache_dir, k), {"n_loss": str(shard.n_loss), "shard": str(k),
                                   "seconds": f"{time.time() - t0:.2f}", "threads": str(torch.get_num_threads())})
    return shard.n_loss


def _load_gen_model(target_dir: str, dtype: str, device: str):
    from ..testing import models

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return models.load_hf(target_dir, dtype=torch.float32).to(dt).to(device).eval()


def _gen_worker(rank: int, job: dict, todo: list[int], threads: int | None) -> None:
    """Generates the shards ``todo`` (in a worker process: ``python -m vllm_dsbd.distill._worker JOB RANK``)."""
    if threads:
        torch.set_num_threads(threads)
    model = _load_gen_model(job["target_dir"], job["gen_dtype"], job["device"])
    for k in todo:
        _make_shard(model, job["prompt_ids"], k, pathlib.Path(job["cache_dir"]), seq_len=job["seq_len"],
                    gen_batch_size=job["gen_batch_size"], temperature=job["temperature"], seed=job["seed"],
                    device=torch.device(job["device"]), eos_id=job["eos_id"], pad_id=job["pad_id"],
                    beam_width=job.get("beam_width", 0))


def build_corpus(target_dir: str, prompt_ids: list[list[int]], cache_dir: pathlib.Path, *, n_tokens: int,
                 seq_len: int, gen_batch_size: int, temperature: float, seed: int, device: str, eos_id: int | None,
                 pad_id: int, gen_dtype: str = "bfloat16", workers: int = 1, threads: int | None = None,
                 progress: bool = True, log: Callable[[str], None] = print,
                 beam_width: int = 0, maker: Callable[[], Any] | None = None) -> tuple[list[pathlib.Path], dict]:
    """Makes sure ``cache_dir`` holds shards 0..k-1 with at least ``n_tokens`` loss (generated) tokens; returns
    their paths and generation stats. ``prompt_ids``: the (already shuffled, encoded) training prompts; they are
    reused cyclically when the corpus needs more sequences than there are prompts (with other samples each time).

    ``workers`` > 1 generates shards in that many processes (``threads`` torch threads each): on a CPU shared with
    other jobs, single-threaded processes degrade gracefully where one multi-threaded process stalls.
    ``beam_width`` W >= 2: each prompt gives its W final beams of the target's beam search instead of one sample.
    ``maker``: makes, once, an object whose ``make(todo, prompt_ids, cache_dir, ...)`` writes the shards instead of
    the HF loop and whose ``close()`` ends it (``corpus_vllm.build_corpus``: vLLM; ``workers`` is then ignored)."""
    from tqdm.auto import tqdm

    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths, have = corpus_paths(cache_dir, n_tokens)
    stats = {"generated_tokens_before": have, "generation_seconds": 0.0, "generated_tokens_new": 0}
    if have >= n_tokens:
        return paths, stats
    if not prompt_ids:
        raise ValueError("no prompts to generate the corpus from")
    # shards to make: the missing indices from the first gap on, enough for n_tokens by the prompts' budgets
    rows = max(1, beam_width)  # rows per prompt
    present = present_shards(cache_dir)
    first = len(paths)
    todo, expect, k = [], have, first
    while expect < n_tokens:
        if k not in present:
            todo.append(k)
            expect += int(0.9 * rows * sum(seq_len - len(p) for p in _shard_prompts(prompt_ids, k, gen_batch_size)))
        else:
            expect += shard_loss_tokens(present[k])
        k += 1
    bar = tqdm(total=n_tokens, initial=have, desc="generating", unit="tok", disable=not progress, dynamic_ncols=True)
    t0 = time.time()
    job = {"target_dir": str(target_dir), "gen_dtype": gen_dtype, "device": str(device), "prompt_ids": prompt_ids,
           "cache_dir": str(cache_dir), "seq_len": seq_len, "gen_batch_size": gen_batch_size,
           "temperature": temperature, "seed": seed, "eos_id": eos_id, "pad_id": pad_id, "beam_width": beam_width}
    vgen = None
    while True:
        if maker is not None:
            if vgen is None:
                vgen = maker()
            vgen.make(todo, prompt_ids, cache_dir, gen_batch_size=gen_batch_size, temperature=temperature,
                      eos_id=eos_id, pad_id=pad_id, on_shard=lambda k, n: bar.update(n))
        elif workers <= 1:
            if threads:
                torch.set_num_threads(threads)
            model = _load_gen_model(str(target_dir), gen_dtype, str(device))
            for k in todo:
                n = _make_shard(model, prompt_ids, k, cache_dir, seq_len=seq_len, gen_batch_size=gen_batch_size,
                                temperature=temperature, seed=seed, device=torch.device(device), eos_id=eos_id,
                                pad_id=pad_id, beam_width=beam_width)
                bar.update(n)
                bar.set_postfix(shard=k, tok_s=f"{(bar.n - have) / max(time.time() - t0, 1e-9):.0f}")
            del model
        else:
            # workers are separate interpreters (python -m vllm_dsbd.distill._worker JOB RANK): no reliance on the
            # caller's __main__ being import-safe, as multiprocessing's spawn would need
            import subprocess
            import sys

            job_path = cache_dir / "job.json"
            job_path.write_text(json.dumps({**job, "todo": todo, "workers": workers, "threads": threads}))
            procs = [subprocess.Popen([sys.executable, "-m", "vllm_dsbd.distill._worker", str(job_path), str(r)])
                     for r in range(workers)]
            done: set[int] = set()
            try:
                while True:
                    alive = any(p.poll() is None for p in procs)
                    for k in todo:
                        if k not in done and shard_path(cache_dir, k).is_file():
                            done.add(k)
                            bar.update(shard_loss_tokens(shard_path(cache_dir, k)))
                            bar.set_postfix(shards=len(done),
                                            tok_s=f"{(bar.n - have) / max(time.time() - t0, 1e-9):.0f}")
                    if not alive:
                        break
                    time.sleep(0.5)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                    p.wait()
            job_path.unlink(missing_ok=True)
            bad = [p.returncode for p in procs if p.returncode != 0]
            if bad:
                raise RuntimeError(f"a corpus generation worker failed (exit codes {bad})")
        paths, got = corpus_paths(cache_dir, n_tokens)
        if got >= n_tokens:
            break
        # the estimate was short (early EOS): one more round for the rest
        present = present_shards(cache_dir)
        k = max(present) + 1
        todo, expect = [], got
        while expect < n_tokens:
            todo.append(k)
            expect += int(0.9 * rows * sum(seq_len - len(p) for p in _shard_prompts(prompt_ids, k, gen_batch_size)))
            k += 1
    bar.close()
    if vgen is not None:
        vgen.close()
    stats["generation_seconds"] = round(time.time() - t0, 1)
    stats["generated_tokens_new"] = got - have
    log(f"generated {got - have} tokens in {stats['generation_seconds']:.0f} s "
        f"({type(vgen).__name__ if vgen is not None else f'{workers} worker(s)'}); corpus: {got} tokens in {len(paths)} shards")
    return paths, stats

