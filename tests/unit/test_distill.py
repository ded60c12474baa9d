"""Tests of vllm_dsbd.distill (draft distillation) on a tiny random Llama target: the loss, training (KL goes down),
resume, the written folder, artifact export / assemble, the acceptance measurement helper and argument checks; and the
options for beam requests (``--beam-width``: the corpus rows are the target's own beams; ``--loss topk`` and its
gradient; ``--init``), and the cached assembly of a replaced artifact.

All runs use float32 training, no torch.compile and one torch thread (CPU shared with other jobs: a multi-threaded
run can stall there), so each takes a second or two.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import torch  # noqa: E402
import transformers  # noqa: E402

from vllm_dsbd.testing import models  # noqa: E402
from vllm_dsbd.distill import (  # noqa: E402
    DistillConfig,
    PrefixCachedLM,
    assemble,
    build_draft,
    distill,
    export_artifact,
    fused_kl,
    measure_acceptance,
)
from vllm_dsbd.distill import __main__ as cli  # noqa: E402
from vllm_dsbd.distill import corpus as corp  # noqa: E402
from vllm_dsbd.distill import data  # noqa: E402
from vllm_dsbd.distill import train as tr  # noqa: E402

PROMPTS = [
    "the king and the queen of the river",
    "def walk(n):",
    "12 + 30 = 42; 7 *",
    "Paris is the capital of",
    "a quiet road to the old bridge",
    "red blue green white",
    "The teacher will read the letter to",
    "return [x * i for i in",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    # init_std 0.15: peaky next-token distributions, so that the truncated draft starts far from the target
    target_dir, _ = models.tiny_llama_pair(root / "pair", init_std=0.15, target_layers=3)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 4) + "\n")
    return root, target_dir, prompts


def _cfg(root, target_dir, prompts, name, **kw):
    base = dict(target=str(target_dir), out=str(root / name), layers=1, tokens=1200, seq_len=40, max_prompt_len=12,
                batch_size=4, epochs=2, lr=3e-3, warmup_steps=2, prompts=str(prompts), gen_batch_size=16,
                train_dtype="float32", compile_loss=False, save_every=5, threads=1, progress=False)
    base.update(kw)
    return DistillConfig(**base)


def _state(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------------------- loss
def test_fused_kl_matches_autograd():
    torch.manual_seed(0)
    N, D, V = 37, 16, 300
    W = torch.randn(V, D)
    h = torch.randn(N, D, requires_grad=True)
    t = torch.randn(N, D)
    loss, kl, ent = fused_kl(h, t, W, chunk=8)
    loss.backward()
    g = h.grad.clone()
    h2 = h.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(t @ W.T, -1)
    lq = torch.log_softmax(h2 @ W.T, -1)
    ref_kl = (lp.exp() * (lp - lq)).sum(-1)
    ref_kl.mean().backward()
    torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_kl.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, -(lp.exp() * lp).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, h2.grad, rtol=1e-4, atol=1e-6)
    assert float(fused_kl(t, t, W)[0]) == pytest.approx(0.0, abs=1e-5)


# ------------------------------------------------------------------------------------------------------ corpus
def test_corpus_positions_and_hidden_states(tiny):
    root, target_dir, prompts = tiny
    tok = models.load_tokenizer(target_dir)
    target = models.load_hf(target_dir)
    ids = [data.encode_prompt(tok, p, 12) for p in PROMPTS[:5]]
    g = torch.Generator().manual_seed(0)
    shard = corp.generate_batch(target, ids, seq_len=30, temperature=1.0, eos_id=2, pad_id=3, generator=g,
                                device=torch.device("cpu"))
    assert shard.hidden.shape == (shard.n_loss, target.config.hidden_size)
    off = 0
    for i in range(len(ids)):
        n, p = int(shard.lengths[i]), int(shard.prompt_lengths[i])
        assert shard.ids[i, :p].tolist() == ids[i] and p < n <= 30
        # the cached hidden states are the target's final (normed) states at positions p-1 .. n-2
        with torch.no_grad():
            ref = target.model(input_ids=shard.ids[i:i + 1, :n].long()).last_hidden_state[0, p - 1: n - 1]
        torch.testing.assert_close(shard.hidden[off: off + n - p].float(), ref, rtol=0, atol=2e-2)
        off += n - p


# ---------------------------------------------------------------------------------------------------- training
def test_distill_reduces_kl_and_writes_loadable_folder(tiny):
    root, target_dir, prompts = tiny
    out = distill(_cfg(root, target_dir, prompts, "d1"), log=lambda s: None)
    meta = json.loads((out / "distill.json").read_text())
    paths, _ = corp.corpus_paths(root / "d1.work" / "corpus", 1200)
    corpus = tr.Corpus(paths)
    assert corpus.n_loss_tokens >= 1200
    target = models.load_hf(target_dir)
    before = tr.mean_kl(build_draft(target, 1), corpus)["kl"]
    draft = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    after = tr.mean_kl(draft, corpus)["kl"]
    assert after < 0.8 * before, (before, after)
    assert meta["training"]["loss_log"][-1][1] < meta["training"]["loss_log"][0][1]
    # a standard HF folder: config with the draft's depth, weights, tokenizer
    assert isinstance(draft, transformers.LlamaForCausalLM) and draft.config.num_hidden_layers == 1
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)("def walk").input_ids
    # embedding, final norm and LM head are the target's, untouched
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(draft.state_dict()[k], target.state_dict()[k]), k


def test_resume_continues_from_checkpoint(tiny):
    root, target_dir, prompts = tiny
    logs = []
    full = distill(_cfg(root, target_dir, prompts, "r_full", max_steps=9), log=logs.append)
    cfg = _cfg(root, target_dir, prompts, "r_cut", max_steps=9, stop_after=4)
    distill(cfg, log=logs.append)
    ck = torch.load(root / "r_cut.work" / tr.CKPT, weights_only=False)
    assert ck["step"] == 4 and not (root / "r_cut" / "model.safetensors").exists()
    logs.clear()
    # the re-run reuses the cached corpus (no generation) and continues at step 4 (stopping again at 8)
    assert cli.main(["--target", str(target_dir), "--out", str(root / "r_cut"), "--layers", "1", "--tokens", "1200",
                     "--seq-len", "40", "--max-prompt-len", "12", "--batch-size", "4", "--epochs", "2", "--lr",
                     "3e-3", "--warmup-steps", "2", "--prompts", str(prompts), "--gen-batch-size", "16",
                     "--train-dtype", "float32", "--no-compile", "--save-every", "5", "--threads", "1",
                     "--max-steps", "9", "--stop-after", "4", "--no-progress"]) == 0
    assert torch.load(root / "r_cut.work" / tr.CKPT, weights_only=False)["step"] == 8
    cfg.stop_after = None
    distill(cfg, log=logs.append)
    assert any("resuming" in m and "step 8/9" in m for m in logs), logs
    assert not any(m.startswith("generated") for m in logs)
    # same data order and optimizer state: the interrupted run ends where the uninterrupted one does
    a, b = _state(full), _state(root / "r_cut")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    # a checkpoint of another run is refused, not silently mixed
    with pytest.raises(ValueError, match="another run"):
        distill(_cfg(root, target_dir, prompts, "r_cut", max_steps=9, lr=1e-2), log=logs.append)


# ----------------------------------------------------------------------------------------------------- artifact
def test_export_assemble_roundtrip_bit_exact(tiny, tmp_path):
    root, target_dir, prompts = tiny
    out = root / "d1"
    if not (out / "model.safetensors").is_file():
        distill(_cfg(root, target_dir, prompts, "d1"), log=lambda s: None)
    art = export_artifact(out, tmp_path / "artifact")
    from safetensors.torch import load_file

    layers = load_file(str(art / "layers.safetensors"))
    assert layers and all(k.startswith("model.layers.") and v.dtype == torch.float16 for k, v in layers.items())
    info = json.loads((art / "draft.json").read_text())
    assert info["num_hidden_layers"] == 1 and info["target_fingerprint"]
    rebuilt = assemble(target_dir, art, tmp_path / "rebuilt")
    a, b = _state(out), _state(rebuilt)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text()) == json.loads((rebuilt / "config.json").read_text())
    m1 = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    m2 = transformers.AutoModelForCausalLM.from_pretrained(str(rebuilt), local_files_only=True)
    x = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.equal(m1(x).logits, m2(x).logits)
    # the CLI does the same
    assert cli.main(["assemble", "--target", str(target_dir), "--artifact", str(art), "--out",
                     str(tmp_path / "rebuilt2")]) == 0
    assert all(torch.equal(v, _state(tmp_path / "rebuilt2")[k]) for k, v in a.items())
    # another target is refused
    other, _ = models.tiny_llama_pair(root / "pair", init_std=0.15, target_layers=3, seed=1)
    with pytest.raises(ValueError, match="not the target"):
        assemble(other, art, tmp_path / "bad")


# --------------------------------------------------------------------------------------------------- evaluation
def test_prefix_cached_lm_matches_full_recompute(tiny):
    _, target_dir, _ = tiny
    model = models.load_hf(target_dir)
    full, cached = models.next_token_logits_fn(model), PrefixCachedLM(model)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(4, 1000, (1, 9), generator=g)[0].tolist()
    b = torch.randint(4, 1000, (1, 7), generator=g)[0].tolist()
    seqs = [[a, b], [a + [5], b + [6]], [a + [5, 7, 8]], [a + [9]], [b + [6, 6], a + [9, 10]], [a]]  # incl. rollbacks
    for batch in seqs:
        for s in batch:
            torch.testing.assert_close(cached(torch.tensor([s])), full(torch.tensor([s])), rtol=1e-4, atol=1e-4)
    assert len(cached.lanes) == 2


def test_measure_acceptance_runs(tiny):
    root, target_dir, prompts = tiny
    target = models.load_hf(target_dir)
    tok = models.load_tokenizer(target_dir)
    pids = [data.encode_prompt(tok, p, 12) for p in PROMPTS[:2]]
    r = measure_acceptance(target, target, pids, gamma=3, max_new_tokens=8, eos_token_id=None)
    assert r["acceptance_length"] == pytest.approx(8 / 2)  # draft == target: every draft accepted (3 + 1, 3 + 1)
    r = measure_acceptance(target, models.truncated_draft(target, 1), pids, gamma=3, max_new_tokens=8)
    assert 1.0 <= r["acceptance_length"] <= 4.0 and r["generated_tokens"] == 16


# -------------------------------------------------------------------------------------------------------- errors
def test_bad_arguments(tiny, tmp_path, capsys):
    root, target_dir, prompts = tiny
    with pytest.raises(ValueError, match="--layers must be a positive integer"):
        distill(_cfg(root, target_dir, prompts, "bad", layers=0))
    with pytest.raises(ValueError, match=r"--layers must be in \[1, 3\]"):
        distill(_cfg(root, target_dir, prompts, "bad", layers=4))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        distill(_cfg(root, tmp_path / "missing", prompts, "bad"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        distill(_cfg(root, tmp_path, prompts, "bad"))
    with pytest.raises(ValueError, match="--max-prompt-len"):
        distill(_cfg(root, target_dir, prompts, "bad", max_prompt_len=40))
    with pytest.raises(ValueError, match="--prompts must be"):
        data.load_prompts("no-such-source")
    assert cli.main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--layers", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["--target", str(target_dir), "--out", str(tmp_path / "o"), "--layers", "-1"]) == 2
    assert "--layers must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_heldout_split_is_disjoint(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(f"prompt number {i}" for i in range(400)))
    train, held = data.load_prompts(str(f), "train"), data.load_prompts(str(f), "eval")
    assert not set(train) & set(held) and len(train) + len(held) == 400 and 5 <= len(held) <= 40


def test_generation_workers_give_the_same_corpus(tiny, tmp_path):
    """Shard k depends only on (prompts, seed, k): two worker processes write what one process writes."""
    _, target_dir, _ = tiny
    tok = models.load_tokenizer(target_dir)
    pids = [data.encode_prompt(tok, p, 12) for p in PROMPTS]
    kw = dict(n_tokens=300, seq_len=40, gen_batch_size=4, temperature=1.0, seed=3, device="cpu", eos_id=2, pad_id=3,
              gen_dtype="float32", threads=1, progress=False, log=lambda s: None)
    one, _ = corp.build_corpus(str(target_dir), pids, tmp_path / "one", workers=1, **kw)
    two, stats = corp.build_corpus(str(target_dir), pids, tmp_path / "two", workers=2, **kw)
    assert len(one) == len(two) >= 2 and stats["generated_tokens_new"] >= 300
    for a, b in zip(one, two):
        sa, sb = corp.load_shard(a), corp.load_shard(b)
        assert torch.equal(sa.ids, sb.ids) and torch.equal(sa.lengths, sb.lengths)
        torch.testing.assert_close(sa.hidden, sb.hidden, rtol=0, atol=1e-3)
    assert corp.shard_generation_seconds(two) > 0
    # asking again generates nothing
    again, stats = corp.build_corpus(str(target_dir), pids, tmp_path / "two", workers=2, **kw)
    assert again == two and stats["generated_tokens_new"] == 0

# ------------------------------------------------------------------------------ for beam requests (--beam-width ...)
SMALL = dict(tokens=600, seq_len=28, gen_batch_size=4)  # the beam runs' corpus: W rows per prompt


def _reference_beams(model, prompt, width, steps):
    """Beam search by full recompute (no EOS): the W best sequences by cumulative log-probability."""
    beams = [(list(prompt), 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            x = torch.tensor([b[0] for b in beams])
            lp = torch.log_softmax(model(input_ids=x).logits[:, -1].double(), -1)
            joint = (lp + torch.tensor([b[1] for b in beams], dtype=torch.float64)[:, None]).flatten()
            top = torch.topk(joint, width).indices.tolist()
            V = lp.shape[1]
            beams = [(beams[i // V][0] + [i % V], float(joint[i])) for i in top]
    return beams


def test_beam_corpus_rows_are_the_targets_beams(tiny):
    root, target_dir, _ = tiny
    tok = models.load_tokenizer(target_dir)
    target = models.load_hf(target_dir)
    ids = [data.encode_prompt(tok, p, 12) for p in PROMPTS[:3]]
    W, steps = 3, 6
    seq_len = max(len(p) for p in ids) + steps
    shard = corp.generate_beam_batch(target, ids, seq_len=seq_len, beam_width=W, eos_id=None, pad_id=3,
                                     device=torch.device("cpu"))
    assert shard.ids.shape[0] == W * len(ids) and shard.hidden.shape == (shard.n_loss, target.config.hidden_size)
    off = 0
    for i, p in enumerate(ids):
        # every prompt is searched for the batch's horizon (seq_len - its shortest prompt), its rows cut at seq_len
        ref = [b[0][:seq_len] for b in _reference_beams(target, p, W, seq_len - min(map(len, ids)))]
        rows = []
        for r in range(i * W, (i + 1) * W):
            n, pl = int(shard.lengths[r]), int(shard.prompt_lengths[r])
            assert pl == len(p) and shard.ids[r, :pl].tolist() == p
            rows.append(shard.ids[r, :n].tolist())
            with torch.no_grad():
                h = target.model(input_ids=shard.ids[r:r + 1, :n].long()).last_hidden_state[0, pl - 1: n - 1]
            torch.testing.assert_close(shard.hidden[off: off + n - pl].float(), h, rtol=0, atol=2e-2)
            off += n - pl
        # the same W beams as an independent beam search (order: best first)
        assert rows == ref, (rows, ref)


def _reference_topk_loss(zq, zp, k, lam):
    lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
    lqd = lq.detach()
    out = []
    for r in range(zq.shape[0]):
        tp = sorted(range(zq.shape[1]), key=lambda j: -float(lp[r, j]))[:k]
        tq = sorted(range(zq.shape[1]), key=lambda j: -float(lqd[r, j]))[:k]
        floor = lp[r, tp[-1]]
        rank = sum((lq[r, j] - lp[r, j]) ** 2 for j in tp)
        rank = rank + sum(torch.relu(lq[r, j] - torch.maximum(lp[r, j], floor)) ** 2 for j in tq if j not in tp)
        out.append((lp[r].exp() * (lp[r] - lq[r])).sum() + lam * rank / k)
    return torch.stack(out)


def test_topk_loss_and_gradient_match_autograd():
    torch.manual_seed(1)
    N, D, V, k, lam = 23, 12, 90, 5, 0.8
    W = torch.randn(V, D)
    h = torch.randn(N, D, requires_grad=True)
    t = torch.randn(N, D) * 2
    loss, kl, _ = fused_kl(h, t, W, 8, False, k, lam)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    ref = _reference_topk_loss(h2 @ W.T, t @ W.T, k, lam)
    ref.mean().backward()
    torch.testing.assert_close(loss, ref.mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    # the per-position values stay the KL alone, and the loss adds a positive ranking term
    torch.testing.assert_close(kl, fused_kl(h.detach(), t, W, 8)[1], rtol=1e-5, atol=1e-6)
    assert float(loss) > float(kl.mean()) + 1e-3
    assert float(fused_kl(t, t, W, 8, False, k, lam)[0]) == pytest.approx(0.0, abs=1e-5)


def test_beam_topk_run_from_an_initial_draft(tiny):
    root, target_dir, prompts = tiny
    first = distill(_cfg(root, target_dir, prompts, "init", **SMALL), log=lambda s: None)
    logs = []
    out = distill(_cfg(root, target_dir, prompts, "beam", beam_width=2, loss="topk", topk=4, init=str(first),
                       lr=1e-3, **SMALL), log=logs.append)
    assert any("starting from the layers of" in s for s in logs), logs
    meta = json.loads((out / "distill.json").read_text())
    assert "beam-searched itself (width 2" in meta["method"] and "top-4" in meta["method"]
    assert meta["settings"]["beam_width"] == 2 and meta["settings"]["init"] == str(first)
    cache = root / "beam.work" / "corpus"
    assert json.loads((cache / "meta.json").read_text())["beam_width"] == 2
    corpus = tr.Corpus(corp.corpus_paths(cache, 600)[0])
    assert len(corpus) % 2 == 0 and corpus.n_loss_tokens >= 600
    # trained on the beam corpus from the initial draft: the KL there falls below the initial draft's
    before = tr.mean_kl(transformers.AutoModelForCausalLM.from_pretrained(str(first), local_files_only=True), corpus)
    after = tr.mean_kl(transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True), corpus)
    assert after["kl"] < before["kl"], (before, after)
    # --init with another depth is refused
    with pytest.raises(ValueError, match="layers"):
        distill(_cfg(root, target_dir, prompts, "badinit", layers=2, init=str(first), **SMALL), log=lambda s: None)


def test_bad_beam_arguments(tiny, tmp_path, capsys):
    _, target_dir, _ = tiny
    base = ["--target", str(target_dir), "--out", str(tmp_path / "o")]
    for flag, what in ((["--beam-width", "1"], "--beam-width"), (["--loss", "topk", "--topk", "0"], "--topk")):
        assert cli.main(base + flag) == 2
        assert what in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's choices
        cli.main(base + ["--loss", "mse"])
    assert e.value.code == 2


def test_cached_assembly_follows_a_replaced_artifact(tiny, tmp_path):
    """draft_folder rebuilds its cached assembly when the committed artifact's layers change."""
    from vllm_dsbd.testing.drafts import draft_folder

    root, target_dir, prompts = tiny
    repo = tmp_path / "repo"
    a = distill(_cfg(root, target_dir, prompts, "a1", epochs=1, **SMALL), log=lambda s: None)
    b = distill(_cfg(root, target_dir, prompts, "b1", epochs=1, lr=1e-2, **SMALL), log=lambda s: None)
    export_artifact(a, repo / "drafts" / "smollm2-test")
    target_copy = tmp_path / "models" / "target"
    target_copy.parent.mkdir()
    os.symlink(target_dir, target_copy)
    out, desc = draft_folder(target_copy, 1, repo)
    first = (out / "model.safetensors").read_bytes()
    assert desc.startswith("distilled")
    export_artifact(b, repo / "drafts" / "smollm2-test")
    out2, _ = draft_folder(target_copy, 1, repo)
    assert out2 == out and (out / "model.safetensors").read_bytes() != first
    same = (out / "model.safetensors").read_bytes()
    draft_folder(target_copy, 1, repo)  # unchanged artifact: not rebuilt
    assert (out / "model.safetensors").read_bytes() == same
