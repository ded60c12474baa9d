"""Tests of the distillation for beam requests (``--beam-width``, ``--loss topk``, ``--init``) on a tiny random
Llama target: the corpus rows are the target's own beams, the top-k loss and its gradient, a run from an initial
draft, argument checks, and the cached assembly of a replaced artifact. One torch thread, float32, no compile.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_dsbd.distill import DistillConfig, distill, export_artifact, fused_kl  # noqa: E402
from vllm_dsbd.distill import __main__ as cli  # noqa: E402
from vllm_dsbd.distill import corpus as corp  # noqa: E402
from vllm_dsbd.distill import data  # noqa: E402
from vllm_dsbd.distill import train as tr  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402

PROMPTS = ["the king and the queen of the river", "def walk(n):", "12 + 30 = 42; 7 *", "Paris is the capital of",
           "a quiet road to the old bridge", "red blue green white"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_beam")
    target_dir, _ = models.tiny_llama_pair(root / "pair", init_std=0.15, target_layers=3)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 4) + "\n")
    return root, target_dir, prompts


def _cfg(root, target_dir, prompts, name, **kw):
    base = dict(target=str(target_dir), out=str(root / name), layers=1, tokens=600, seq_len=28, max_prompt_len=12,
                batch_size=4, epochs=2, lr=3e-3, warmup_steps=2, prompts=str(prompts), gen_batch_size=4,
                train_dtype="float32", compile_loss=False, save_every=5, threads=1, progress=False)
    base.update(kw)
    return DistillConfig(**base)


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
    first = distill(_cfg(root, target_dir, prompts, "init"), log=lambda s: None)
    logs = []
    out = distill(_cfg(root, target_dir, prompts, "beam", beam_width=2, loss="topk", topk=4, init=str(first),
                       lr=1e-3), log=logs.append)
    assert any("starting from the layers of" in s for s in logs), logs
    meta = json.loads((out / "distill.json").read_text())
    assert "beam-searched itself (width 2" in meta["method"] and "top-4" in meta["method"]
    assert meta["settings"]["beam_width"] == 2 and meta["settings"]["init"] == str(first)
    cache = root / "beam.work" / "corpus"
    assert json.loads((cache / "meta.json").read_text())["beam_width"] == 2
    corpus = tr.Corpus(corp.corpus_paths(cache, 600)[0])
    assert len(corpus) % 2 == 0 and corpus.n_loss_tokens >= 600
    # trained on the beam corpus from the initial draft: the KL there falls below the initial draft's
    import transformers
    before = tr.mean_kl(transformers.AutoModelForCausalLM.from_pretrained(str(first), local_files_only=True), corpus)
    after = tr.mean_kl(transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True), corpus)
    assert after["kl"] < before["kl"], (before, after)
    # --init with another depth is refused
    with pytest.raises(ValueError, match="layers"):
        distill(_cfg(root, target_dir, prompts, "bad", layers=2, init=str(first)), log=lambda s: None)


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
    a = distill(_cfg(root, target_dir, prompts, "a1", epochs=1), log=lambda s: None)
    b = distill(_cfg(root, target_dir, prompts, "b1", epochs=1, lr=1e-2), log=lambda s: None)
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
