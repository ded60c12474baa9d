"""Stop token ids and stop strings on beam requests (``extra_args["dsbd_beam"]``: ``stop_token_ids``, ``stop``), real
vLLM 0.26.0 on CPU, one DSBD engine (the tiny random Llama pair, width 4, depth 3: beams with draft forests).

vLLM's beam search loops drop stops (``BeamSearchParams`` has none; its server loop ignores a request's ``stop`` and
``stop_token_ids``), so the reference is an independent brute-force beam search over the HF model here (vLLM's loop
written out: per live beam the 2W best tokens of its log-softmax row; a candidate ending in EOS, a stop token id, or
whose *whole* decoded generated text contains a stop string finishes; the W best others by cumulative log-probability
go on; the finished and last live beams ranked by vLLM's length-normalised score, where EOS and a stop token id count
one token less). Checked, per prompt:

* without stops the reference gives the engine's beams (tokens, finish reasons, cumulative log-probabilities): the
  reference is the vLLM loop the engine equals (``test_engine_beams.py``), and the HF and vLLM logits agree here;
* with stop token ids (two tokens of the unstopped best beam) and with stop strings (a piece of the unstopped best
  beam's text), the engine's beams equal the reference's, stop reasons included, and some beam stopped on them;
* the engine drafted forests for these requests (``vllm:dsbd_beam_draft_nodes`` moved).
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import beam_counters, dsbd_llm, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.patches.beam_search_route import finished_beams  # noqa: E402
from vllm_dsbd.requests import BeamParams  # noqa: E402
from vllm_dsbd.testing.models import load_hf, load_tokenizer, next_token_logits_fn  # noqa: E402

WIDTH, DEPTH, STEPS = 4, 3, 10
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [83, 60, 71, 9, 14]]


def reference(fn, decode, prompt, eos, stop_ids=(), stops=(), width=WIDTH, steps=STEPS, lp=1.0):
    """Beam search written out (vLLM's loop with HF's stop rule): [(tokens, cum_logprob, finish_reason, reason)]."""
    live, done = [([], 0.0)], []
    for _ in range(steps):
        cands = []
        for toks, s in live:
            row = torch.log_softmax(fn(torch.tensor([prompt + toks]))[0].double(), -1)
            vals, idx = row.topk(2 * width)
            for v, t in zip(vals.tolist(), idx.tolist()):
                new, cum = toks + [t], s + v
                if t == eos or t in stop_ids:
                    done.append((new, cum, "stop", t))
                    continue
                text = decode(new)
                hits = sorted((text.find(x), x) for x in stops if x in text)
                if hits:
                    done.append((new, cum, "stop", hits[0][1]))
                else:
                    cands.append((new, cum))
        live = sorted(cands, key=lambda c: c[1], reverse=True)[:width]
        if not live:
            break
    done += [(t, s, "length", None) for t, s in live]

    def score(d):
        return d[1] / ((len(prompt) + len(d[0]) - (1 if isinstance(d[3], int) else 0)) ** lp)

    return sorted(done, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def run():
    target, draft = tiny_pair()
    fn, tok = next_token_logits_fn(load_hf(target)), load_tokenizer(target)
    eos = tok.eos_token_id
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH}
    with dsbd_llm(target, speculative_config=spec) as llm:
        def beams(prompt, **stops):
            bp = {"width": WIDTH, "max_tokens": STEPS, "eos_token_id": eos, **stops}
            sp = vllm.SamplingParams(temperature=0.0, max_tokens=BeamParams.parse(bp, WIDTH).engine_tokens(),
                                     extra_args={"dsbd_beam": bp})
            (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            return [(list(b["token_ids"]), b["cum_logprob"], b["finish_reason"], b["stop_reason"])
                    for b in finished_beams(o)]

        before = beam_counters(llm)
        out = []
        for p in PROMPTS:
            plain = beams(p)
            best = plain[0][0]
            ids = [best[1], best[3]]
            text = decode(best)
            piece = text[len(text) // 3: len(text) // 3 + 2]
            out.append({"prompt": p, "plain": (plain, reference(fn, decode, p, eos)),
                        "ids": (beams(p, stop_token_ids=ids), reference(fn, decode, p, eos, stop_ids=ids), ids),
                        "str": (beams(p, stop=[piece]), reference(fn, decode, p, eos, stops=[piece]), piece)})
        after = beam_counters(llm)
    return out, {k: after[k] - before[k] for k in before}


def _same(got, want):
    assert [(t, r, w) for t, _, r, w in got] == [(t, r, w) for t, _, r, w in want]
    assert all(abs(a - b) < 1e-3 for (_, a, _, _), (_, b, _, _) in zip(got, want))


def test_reference_is_the_engine_without_stops(run):
    for case in run[0]:
        _same(*case["plain"])


def test_stop_token_ids(run):
    stopped = 0
    for case in run[0]:
        got, want, ids = case["ids"]
        _same(got, want)
        stopped += sum(w in ids for *_, w in got)
    assert stopped > 0


def test_stop_strings(run):
    stopped = 0
    for case in run[0]:
        got, want, piece = case["str"]
        _same(got, want)
        stopped += sum(w == piece for *_, w in got)
    assert stopped > 0


def test_forests_were_drafted(run):
    assert run[1]["beam_draft_nodes"] > 0 and run[1]["beam_steps"] > 0
