"""Tests of the EAGLE-3 head trainer (``python -m vllm_dsbd.distill --head eagle3``) on a tiny random Llama target:
the training-time test equals drafting a chain step by step with a KV cache (what inference does), a short run
lowers the loss at every depth, the written folder reloads bit for bit, the artifact (no LM head) rebuilds it
exactly, the vocabulary is the most frequent generated tokens, and the offline measurement helpers agree with each
other. One run per module; one torch thread, float32.

The head's forward equals vLLM's module: tests/unit/test_eagle3_vllm.py.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_dsbd.distill import __main__ as cli  # noqa: E402
from vllm_dsbd.distill import eagle3, eagle3_artifact, eagle3_eval  # noqa: E402
from vllm_dsbd.distill import eagle3_train as et  # noqa: E402
from vllm_dsbd.distill.train import Corpus  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402

PROMPTS = ["the king and the queen of the river", "def walk(n):", "12 + 30 = 42; 7 *", "Paris is the capital of",
           "a quiet road to the old bridge", "red blue green white"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("head")
    td, _ = models.tiny_llama_pair(root / "pair", init_std=0.15, target_layers=4)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 3) + "\n")
    cfg = et.HeadConfig(target=str(td), out=str(root / "head"), draft_vocab=400, tokens=700, beam_tokens=250,
                        seq_len=36, max_prompt_len=12, batch_size=4, epochs=4, lr=3e-3, warmup_steps=2,
                        prompts=str(prompts), gen_batch_size=16, beam_gen_batch_size=4, gen_dtype="float32",
                        feature_dtype="float32", train_dtype="float32", threads=1, progress=False,
                        artifact=str(root / "artifact"))
    out = et.train_head(cfg, log=lambda *_: None)
    yield root, td, cfg, out
    torch.set_num_threads(n)


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / eagle3.WEIGHTS_FILE))


def test_loss_falls_at_every_depth(run):
    _, _, cfg, out = run
    meta = json.loads((out / "distill.json").read_text())
    log = meta["training"]["log"]
    assert meta["training"]["steps"] == log[-1][0] > 25
    first, last = log[0][2:], log[-1][2:]
    assert len(first) == cfg.depth
    for d in range(cfg.depth):
        assert last[d] < 0.8 * first[d], (d, first, last)
    assert 0 < meta["vocab_target_mass"] <= 1


def test_folder_reloads_bit_for_bit_and_artifact_rebuilds_it(run, tmp_path):
    root, td, cfg, out = run
    cfgj = json.loads((out / "config.json").read_text())
    assert cfgj["architectures"] == ["LlamaForCausalLMEagle3"] and cfgj["draft_vocab_size"] == cfg.draft_vocab
    assert cfgj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # vLLM's (2, L // 2, L - 3), L = 4
    saved = _tensors(out)
    assert not any("embed_tokens" in k for k in saved)  # vLLM shares the target's embedding
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight"} <= set(saved)
    tgt = models.load_hf(td, dtype=torch.float32)
    head = eagle3.load_head(out, tgt.get_input_embeddings().weight)
    again = eagle3.save_head(head, tmp_path / "again")
    re = _tensors(again)
    assert saved.keys() == re.keys()
    for k in saved:
        assert saved[k].dtype == re[k].dtype and torch.equal(saved[k], re[k]), k
    assert json.loads((again / "config.json").read_text()) == cfgj
    # the artifact holds no LM head; assembling it from the target gives the same folder
    from safetensors.torch import load_file

    art = load_file(str(root / "artifact" / eagle3_artifact.HEAD_FILE))
    assert art.keys() == saved.keys() - {"lm_head.weight"}
    built = eagle3_artifact.assemble_head(td, root / "artifact", tmp_path / "built")
    b = _tensors(built)
    assert b.keys() == saved.keys() and all(torch.equal(b[k], saved[k]) for k in saved)
    assert json.loads((built / "config.json").read_text()) == cfgj
    # the LM head is the target's rows of the draft vocabulary (float16 values)
    rows = tgt.get_output_embeddings().weight[head.target_ids].to(torch.float16)
    assert torch.equal(saved["lm_head.weight"], rows)


def test_training_time_test_equals_step_by_step_drafting(run, monkeypatch):
    _, td, _, out = run
    tgt = models.load_hf(td, dtype=torch.float32)
    head = eagle3.load_head(out, tgt.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(3)
    T, depth = 14, 3
    ids = torch.randint(0, 1000, (1, T), generator=g)
    aux, _ = et.target_features(tgt, ids, head.config.aux_layer_ids)
    chains = {}
    with torch.no_grad():
        for t in (0, 4, 9):  # a chain rooted at t: features of 0..t, then its own hidden states
            h = head.combine(aux[:, : t + 1])
            o, pre, kv = head(ids[:, 1: t + 2], h, torch.arange(t + 1)[None])
            chains[t] = [o[:, -1]]
            pre = pre[:, -1:]
            for k in range(1, depth):
                o, pre, kv = head(ids[:, t + k + 1: t + k + 2], pre, torch.tensor([[t + k]]), past=kv)
                chains[t].append(o[:, 0])
        outs = et.ttt_forward(head, ids, aux, depth)
        for t, chain in chains.items():
            for k in range(depth):
                torch.testing.assert_close(outs[k][:, t], chain[k], atol=1e-5, rtol=1e-5)
        # planted variant: deeper queries also see the other chains' keys (causal instead of diagonal) - differs
        right = et.ttt_mask

        def wrong(Lq, k, device=None):
            m = right(Lq, k, device)
            m[0, :, Lq:] = torch.ones(Lq, Lq, dtype=torch.bool).tril().repeat(1, k)
            return m

        monkeypatch.setattr(et, "ttt_mask", wrong)
        bad = et.ttt_forward(head, ids, aux, depth)
    assert not torch.allclose(bad[1][:, 9], chains[9][1], atol=1e-4)
    torch.testing.assert_close(bad[0][:, 9], chains[9][0], atol=1e-5, rtol=1e-5)  # depth 0 has no chain keys


def test_draft_callable_and_root_logits_agree(run):
    _, td, _, out = run
    tgt = models.load_hf(td, dtype=torch.float32)
    head = eagle3.load_head(out, tgt.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 1000, (1, 10), generator=g)
    logits, aux = eagle3_eval.features(tgt, ids, head.config.aux_layer_ids)
    torch.testing.assert_close(logits, tgt(input_ids=ids).logits[:, -1].float())
    want = eagle3_eval.root_logits(head, ids, aux)
    fn = eagle3_eval.HeadDraftFn(tgt, head)
    got = fn(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isinf(got[0, ~head.t2d]).all() and torch.isfinite(got[0, head.t2d]).all()
    # a deeper call extends the chain with the head's own hidden state
    nxt = torch.cat([ids, torch.tensor([[int(got.argmax())]])], 1)
    deeper = fn(nxt)
    assert not torch.allclose(deeper, eagle3_eval.root_logits(head, nxt, eagle3_eval.features(
        tgt, nxt, head.config.aux_layer_ids)[1]))  # not the target's features at the drafted token
    with pytest.raises(RuntimeError):
        fn(ids)  # neither a root nor an extension of the chain
    r = eagle3_eval.measure_head_acceptance(tgt, head, [[5, 6, 7, 8]], gamma=2, max_new_tokens=8, eos_token_id=None)
    assert r["generated_tokens"] == 8 and 1 <= r["acceptance_length"] <= 3


def test_vocabulary_is_the_most_frequent_generated_tokens(run):
    root, td, cfg, out = run
    from vllm_dsbd.distill import corpus as corp

    paths = sorted((root / "head.work" / "corpus").glob("shard-*.safetensors")) + sorted(
        (root / "head.work" / f"corpus-beam{cfg.beam_width}").glob("shard-*.safetensors"))
    c = Corpus(paths)
    gen = c.ids[et.generated_mask(c, c.ids.shape[1])]
    counts = torch.bincount(gen, minlength=1000)
    vocab = et.select_vocab(c, 1000, cfg.draft_vocab)
    inside = torch.zeros(1000, dtype=torch.bool)
    inside[vocab] = True
    assert counts[inside].min() >= counts[~inside].max()
    head = eagle3.load_head(out, torch.zeros(1000, 128))
    assert torch.equal(head.target_ids, vocab)
    assert len(corp.present_shards(root / "head.work" / "corpus")) >= 1


def test_cli_errors(run, capsys):
    _, td, _, _ = run
    assert cli.main(["--head", "eagle3", "--target", str(td), "--out", "x", "--draft-vocab", "0"]) == 2
    assert "--draft-vocab" in capsys.readouterr().err
    assert cli.main(["--head", "eagle3", "--target", "/nonexistent", "--out", "x"]) == 2
