"""Temperature 0: DSBD is token-identical to deterministic beam search, which follows vLLM's LLM.beam_search."""
from __future__ import annotations

import pytest
import torch

from vllm_dsbd.core import reference
from vllm_dsbd.core.synthetic import NGramLM, draft_of, random_table


def vllm_style_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """A line-by-line port of vLLM 0.26's LLM.beam_search loop (entrypoints/generate/beam_search/offline.py):
    each beam proposes its top 2W tokens by raw log-probability; EOS candidates complete, the best W others live;
    finally completed + live sorted by cum_logprob / len(tokens incl. prompt, minus a last EOS) ** length_penalty."""
    def score(b):
        toks, cum = b
        n = len(toks) - (1 if toks[-1] == eos else 0)
        return cum / (n ** length_penalty)
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        new = []
        for toks, cum in beams:
            lp = torch.log_softmax(model(torch.tensor([toks])).double()[0], -1)
            top = torch.topk(lp, min(2 * width, lp.numel()))
            for x, l in zip(top.indices.tolist(), top.values.tolist()):
                cand = (toks + [x], cum + l)
                (completed if x == eos else new).append(cand)
        beams = sorted(new, key=score, reverse=True)[:width]
    best = sorted(completed + beams, key=score, reverse=True)[:width]
    return [(t[len(prompt):], score((t, c))) for t, c in best]


def greedy(model, prompt, n, eos):
    seq = list(prompt)
    for _ in range(n):
        x = int(model(torch.tensor([seq]))[0].argmax())
        seq.append(x)
        if x == eos:
            break
    return seq[len(prompt):]


def synthetic_pairs(count):
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        vocab = int(torch.randint(4, 12, (1,), generator=g))
        order = 2 + i % 2
        t = random_table(vocab, order, concentration=0.3 + (i % 3) * 0.5, generator=g)
        d = draft_of(t, [0.0, 0.5, 0.8, 0.95][i % 4], generator=g)
        # jitter: n-gram scores tie exactly for permuted transitions; ties would make "the" top-W ambiguous
        yield i, NGramLM(t, jitter=0.05), NGramLM(d), vocab, order


def tokens(out):
    return [b[0] for b in out.beams]


def test_dsbd_greedy_equals_beam_search_on_many_synthetic_models():
    passed = 0
    for i, target, draft, vocab, order in synthetic_pairs(40):
        width, depth = 1 + i % 4, 1 + (i // 4) % 3
        eos = vocab - 1 if i % 3 else None
        prompt = [0] * (order - 1) + [i % vocab]
        kw = dict(width=width, max_new_tokens=7, temperature=0.0, eos_token_id=eos)
        base = reference.beam_decode(target, prompt, **kw)
        ds = reference.dsbd_decode(target, draft, prompt, depth=depth, **kw)
        assert tokens(ds) == tokens(base), f"case {i}"
        assert [round(b[1], 5) for b in ds.beams] == [round(b[1], 5) for b in base.beams]
        ref = vllm_style_beam_search(target, prompt, width, 7, eos)
        assert tokens(base) == [t for t, _ in ref], f"case {i}: beam_decode differs from vLLM's loop"
        passed += ds.stats.layers_passed
        assert ds.stats.target_calls <= base.stats.target_calls
    assert passed > 40  # drafts were accepted, so verification decided something


def test_single_width_one_greedy_is_plain_greedy():
    for i, target, draft, vocab, order in synthetic_pairs(20):
        prompt = [0] * (order - 1) + [1]
        out = reference.dsbd_decode(target, draft, prompt, width=1, depth=3, max_new_tokens=9, temperature=0.0,
                                    eos_token_id=vocab - 1, mode="single")
        assert tokens(out) == [greedy(target, prompt, 9, vocab - 1)]


@pytest.fixture(scope="module")
def llama_pair():
    import transformers
    def make(layers, seed):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       max_position_embeddings=128)
        m = transformers.LlamaForCausalLM(cfg).double().eval()
        # sharpen the random model so that beams differ clearly (logit gaps far above float64 noise)
        with torch.no_grad():
            m.lm_head.weight.mul_(40.0)
        return m
    target, draft = make(2, 0), make(1, 1)
    # a draft that agrees partly with the target: its first layer, embeddings, norm and head
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if "layers.1." not in k})
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(0.3)  # keep the second layer's effect moderate
    def fn(m):
        @torch.no_grad()
        def call(ids):
            return m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
        return call
    return fn(target), fn(draft)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_dsbd_greedy_equals_beam_search_on_tiny_llama(llama_pair, width):
    target, draft = llama_pair
    prompt = [5, 17, 42, 8]
    kw = dict(width=width, max_new_tokens=10, temperature=0.0, eos_token_id=3)
    base = reference.beam_decode(target, prompt, **kw)
    ds = reference.dsbd_decode(target, draft, prompt, depth=3, **kw)
    assert tokens(ds) == tokens(base)
    assert tokens(base) == [t for t, _ in vllm_style_beam_search(target, prompt, width, 10, 3)]
    assert ds.stats.layers_passed > 0
    print(f"tiny llama W={width}: target passes {ds.stats.target_calls} vs {base.stats.target_calls}, "
          f"layers passed {ds.stats.layers_passed}")
