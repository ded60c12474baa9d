"""``--gen-engine vllm``: corpus shards written by a vLLM engine (distill/corpus_vllm.py) hold what the target
generates, in the HF loop's shard format. Greedy sampled shards equal the HF loop's greedy shards token for token;
beam shards (a DSBD engine's in-engine beams) equal an independent full-recompute beam search; the hidden states
equal HF's final hidden states at the generated positions; the cache refuses to mix with an HF-made one.
"""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_dsbd.distill import corpus as corp  # noqa: E402
from vllm_dsbd.distill import corpus_vllm  # noqa: E402
from vllm_dsbd.distill import data  # noqa: E402
from vllm_dsbd.distill import train as tr  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402

from test_distill import PROMPTS, _reference_beams  # noqa: E402


@pytest.fixture(scope="module")
def target(tiny_pair):
    target_dir = tiny_pair[0]
    tok = models.load_tokenizer(target_dir)
    return target_dir, models.load_hf(target_dir).eval(), [data.encode_prompt(tok, p, 12) for p in PROMPTS]


def _hidden_ok(model, shard):
    off = 0
    for r in range(shard.ids.shape[0]):
        n, pl = int(shard.lengths[r]), int(shard.prompt_lengths[r])
        with torch.no_grad():
            h = model.model(input_ids=shard.ids[r:r + 1, :n].long()).last_hidden_state[0, pl - 1: n - 1]
        torch.testing.assert_close(shard.hidden[off: off + n - pl].float(), h, rtol=0, atol=2e-2)
        off += n - pl
    assert off == shard.hidden.shape[0] == shard.n_loss


def test_vllm_greedy_shards_equal_the_hf_loop(target, tmp_path):
    target_dir, model, pids = target
    kw = dict(n_tokens=120, seq_len=36, gen_batch_size=4, temperature=0.0, seed=0, device="cpu", eos_id=None,
              pad_id=3, gen_dtype="float32", progress=False, log=lambda s: None)
    hf, _ = corp.build_corpus(str(target_dir), pids, tmp_path / "hf", **kw)
    vl, stats = corpus_vllm.build_corpus(str(target_dir), pids, tmp_path / "vllm", **kw)
    assert len(vl) == len(hf) >= 2 and stats["generated_tokens_new"] >= 120
    for a, b in zip(hf, vl):
        sa, sb = corp.load_shard(a), corp.load_shard(b)
        assert torch.equal(sa.ids, sb.ids) and torch.equal(sa.lengths, sb.lengths)
        assert torch.equal(sa.prompt_lengths, sb.prompt_lengths)
        _hidden_ok(model, sb)
    assert corp.shard_generation_seconds(vl) > 0


def test_vllm_beam_shards_are_the_targets_beams(target, tmp_path):
    target_dir, model, pids = target
    W, seq_len = 3, 18
    paths, _ = corpus_vllm.build_corpus(str(target_dir), pids[:3], tmp_path / "beam", n_tokens=1, seq_len=seq_len,
                                        gen_batch_size=3, temperature=1.0, seed=0, device="cpu", eos_id=None,
                                        pad_id=3, gen_dtype="float32", progress=False, log=lambda s: None,
                                        beam_width=W)
    shard = corp.load_shard(paths[0])
    prompts = corp._shard_prompts(pids[:3], 0, 3)
    assert shard.ids.shape[0] == W * len(prompts)
    horizon = seq_len - min(map(len, prompts))
    for i, p in enumerate(prompts):
        ref = [b[0][:seq_len] for b in _reference_beams(model, p, W, horizon)]
        rows = [shard.ids[r, : int(shard.lengths[r])].tolist() for r in range(i * W, (i + 1) * W)]
        assert rows == ref, (rows, ref)
    _hidden_ok(model, shard)


def test_vllm_cache_is_kept_apart_from_an_hf_cache(tmp_path):
    meta = {"format": corp._FORMAT, "seed": 0}
    corp.check_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="gen_engine"):
        corp.check_meta(tmp_path, {**meta, "gen_engine": "vllm"})
    with pytest.raises(ValueError, match="--gen-engine"):
        tr.DistillConfig(target=".", out=str(tmp_path / "o"), gen_engine="sglang").validate()
