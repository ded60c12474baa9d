"""``use_beam_search`` through vLLM's OpenAI-compatible server on a DSBD engine (patch ``beam_serving_route``): one
engine request per prompt (beams inside the engine) instead of vLLM's front-end loop, answers equal to plain vLLM.

Two servers, one after the other (``python -m vllm.entrypoints.cli.main serve``, CPU): plain vLLM, then DSBD
(width 4, depth 2, engine core in a child process as ``vllm serve`` runs by default, so the beams cross processes in
``kv_transfer_params``). Tiny random Llama pair of ``test_engine_serve.py``, with the target tokenizer's EOS moved (in
a copy of the folder, as ``test_engine_beams.py`` does) to token 102, picked so that the beams of these requests end
both ways: on EOS after 0 to 3 tokens and at ``max_tokens`` (asserted); the tiny tokenizer has no chat template, both
servers get the same trivial one.

The same requests go to both, temperature 0: ``/v1/completions`` with ``n`` = 2 and 4 (length penalty 0.5, 1.3 and 2,
``include_stop_str_in_output``, two prompts in one request), ``/v1/chat/completions`` with ``n`` = 2; and one at
temperature 1 (the OpenAI default), where vLLM's beams are its temperature-0 beams and DSBD's too (beam sampling is
only asked for with ``dsbd_beam``). Every choice is
equal (text, token ids, finish and stop reasons, the chosen tokens' logprobs to 1e-4), and with top-logprob
alternatives (completions ``logprobs`` 2, chat ``top_logprobs`` 2: the 2 * n best tokens of the row per step in
vLLM's loop, the beams' top rows on DSBD) those alternatives too (tokens equal, values to 1e-4). A width above the
DSBD server's ``max_beam_width`` (64) and a beam search that cannot fit ``max_model_len`` are 400s naming the
parameter, and a good request
afterwards still gets the same answer (``stop`` strings are served: test_beam_serving_stops.py). DSBD's beam
counters on ``/metrics`` show draft forests verified
and layers passed for the beam searches, and forests verified for the streamed requests.

Diverse beam search (DSBD server only; vLLM's loop ignores the fields): ``use_beam_search`` with
``num_beam_groups`` / ``diversity_penalty`` returns the beams of the same ``dsbd_beam`` request, not the beams without
groups, and a width the groups do not divide is a 400 naming ``num_beam_groups``.

Streaming (DSBD server only; vLLM refuses ``"stream": true`` with ``use_beam_search``): a ``/v1/completions`` request
with ``"stream": true`` and the beam settings in ``vllm_xargs`` (``{"dsbd_beam": "<JSON object>"}``: vllm_xargs
carry strings and numbers, a mapping is a 400 from vLLM) streams the beams' settled prefix in chunks before the last
one, a prefix of every beam the same request returns unstreamed (``kv_transfer_params["dsbd_beam"]``), and all the
chunks together are the best beam, tokens, text and finish reason. Engine ``logprobs`` on a streamed beam request
are refused (the stream's one event is the error); unstreamed, they are served.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

import pytest
import vllm  # noqa: F401  (a broken vLLM must fail the suite, never skip it)

from engine_utils import tiny_pair, with_eos
from server_utils import running_server

from vllm_dsbd.testing.server import free_port, server_env

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
MODEL_NAME = "tiny-dsbd"
WIDTH = 4
PROMPT = [5, 6, 7, 8]
EOS = 102  # a token in the beams' top 2 * n candidates now and then, not at every step
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _cmpl(**kw):
    return ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "use_beam_search": True, "temperature": 0,
                                "max_tokens": 6, "return_token_ids": True, "logprobs": 0,
                                "return_tokens_as_token_ids": True, **kw})


# (name, path, payload): sent to both servers
REQUESTS = [
    ("n2", *_cmpl(n=2)),
    ("n4", *_cmpl(n=4, length_penalty=1.3)),
    ("n4_lp05", *_cmpl(n=4, length_penalty=0.5)),
    ("n4_lp2", *_cmpl(n=4, length_penalty=2.0)),
    ("n4_stop_str", *_cmpl(n=4, include_stop_str_in_output=True)),
    ("two_prompts", *_cmpl(n=2, prompt=[PROMPT, [10, 20, 30]], max_tokens=5)),
    ("chat", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "use_beam_search": True, "n": 2,
      "temperature": 0, "max_tokens": 6, "return_token_ids": True, "logprobs": True, "top_logprobs": 0,
      "return_tokens_as_token_ids": True}),
    # temperature 1 (the OpenAI default): vLLM's beam search all the same, not beam sampling
    ("n4_t1", *_cmpl(n=4, length_penalty=1.3, temperature=1.0)),
    # top-logprob alternatives: vLLM's loop's 2 * n best tokens of each step's row, the requested 2 of them returned
    ("n2_lp2", *_cmpl(n=2, logprobs=2)),
    ("chat_top2", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "use_beam_search": True, "n": 2,
      "temperature": 0, "max_tokens": 6, "return_token_ids": True, "logprobs": True, "top_logprobs": 2,
      "return_tokens_as_token_ids": True}),
]
STREAM_TOKENS = 10
STREAMS = [("w2", [83, 60], 2), ("w4", [10, 20, 30], 4)]  # (name, prompt, width): beams that share a long prefix


def _beam_xargs(width):
    return {"dsbd_beam": json.dumps({"width": width, "max_tokens": STREAM_TOKENS, "eos_token_id": EOS})}


def _beam_cmpl(prompt, width, **kw):
    """A completion with the beam settings in vllm_xargs (``max_tokens``: room for the trie, ``engine_tokens``)."""
    return {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "max_tokens": STREAM_TOKENS * (width + 1) + 2,
            "return_token_ids": True, "vllm_xargs": _beam_xargs(width), **kw}


BAD = [  # (path, payload, parameter named): DSBD server only
    (*_cmpl(n=65), "n"),  # above max_beam_width 64 (the default, whatever the server's width)
    (*_cmpl(n=WIDTH, max_tokens=100), "max_tokens"),  # 4 + 100 * 5 + 2 trie slots > max_model_len 256
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target folder with EOS moved to ``EOS``, draft folder, eos id, chat template)."""
    target, draft = tiny_pair()
    eos = EOS
    tmp = tmp_path_factory.mktemp("beams_serve")
    folder = tmp / "target"
    with_eos(target, folder, eos)
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    return folder, draft, eos, template


def _post(base, path, payload, timeout=300):
    req = urllib.request.Request(base + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _raw(base, path, payload, timeout=300):
    """(status, body text) of a request, streamed or not."""
    req = urllib.request.Request(base + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _stream(base, path, payload, timeout=300):
    """The chunks of a streamed request (server-sent events up to ``[DONE]``)."""
    req = urllib.request.Request(base + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")


def _server(cmd, env, log_path):
    port = free_port()
    return running_server(cmd + ["--host", "127.0.0.1", "--port", str(port)], port, env, log_path, STARTUP_TIMEOUT_S)


def _common(target, template):
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target), "--served-model-name",
            MODEL_NAME, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--seed", "0",
            "--max-num-seqs", "8", "--chat-template", str(template)]


@pytest.fixture(scope="module")
def plain(models, tmp_path_factory):
    target, _, _, template = models
    log = tmp_path_factory.mktemp("plain_server") / "server.log"
    with _server(_common(target, template), server_env(multiprocessing=False), log) as (base, _, tail):
        out = {}
        for name, path, payload in REQUESTS:
            out[name] = _post(base, path, payload)
            assert out[name][0] == 200, (name, out[name], tail())
        return out


@pytest.fixture(scope="module")
def dsbd(models, plain, tmp_path_factory):  # after plain: one server at a time
    target, draft, _, template = models
    cmd = _common(target, template) + ["--speculative-method", "dsbd", "--spec-model", str(draft), "--spec-tokens", "2",
                                       # the cost model off: the beams' forests as before (seeded T > 0 beams too)
                                       "--speculative-config", json.dumps({"width": WIDTH, "cost_model": None})]
    log = tmp_path_factory.mktemp("dsbd_server") / "server.log"
    with _server(cmd, server_env(), log) as (base, proc, tail):
        out = {}
        t0 = time.monotonic()
        for name, path, payload in REQUESTS:
            out[name] = _post(base, path, payload)
            assert out[name][0] == 200, (name, out[name], tail())
        out["time_s"] = time.monotonic() - t0
        out["bad"] = [_post(base, path, payload) for path, payload, _ in BAD]
        out["after_bad"] = _post(base, REQUESTS[0][1], REQUESTS[0][2])
        out["alive"] = proc.poll() is None
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            out["metrics"] = r.read().decode()
        # streamed beam requests (after the metrics: test_beams_ran_in_the_engine counts the requests above)
        out["streams"] = {name: (_stream(base, "/v1/completions", _beam_cmpl(p, w, stream=True)),
                                 _post(base, "/v1/completions", _beam_cmpl(p, w))) for name, p, w in STREAMS}
        out["stream_bad"] = [
            _raw(base, "/v1/completions", _beam_cmpl(PROMPT, 2, stream=True, logprobs=1)),
            _raw(base, "/v1/completions", _beam_cmpl(PROMPT, 2, logprobs=1)),
            _raw(base, "/v1/completions", _beam_cmpl(PROMPT, 2, stream=True,
                                                     vllm_xargs={"dsbd_beam": {"width": 2, "max_tokens": 4}})),
        ]
        out["stream_alive"] = proc.poll() is None
        # diverse beam search: use_beam_search with the extra fields, the same beams as a dsbd_beam request; a bad
        # num_beam_groups is a 400 naming it
        groups = {"num_beam_groups": 2, "diversity_penalty": 1.0}
        beam = {"width": WIDTH, "max_tokens": 6, "eos_token_id": EOS, **groups}
        out["groups"] = [_post(base, *_cmpl(n=WIDTH, **groups)), _post(base, *_cmpl(n=WIDTH)),
                         _post(base, "/v1/completions",
                               {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 6 * (WIDTH + 1) + 2,
                                "return_token_ids": True, "vllm_xargs": {"dsbd_beam": json.dumps(beam)}}),
                         _post(base, *_cmpl(n=WIDTH, num_beam_groups=3))]
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            out["metrics_end"] = r.read().decode()
        return out


def test_use_beam_search_takes_beam_groups(dsbd):
    """``num_beam_groups`` / ``diversity_penalty`` on a ``use_beam_search`` request (extra fields; vLLM's own loop
    ignores them): the choices are the beams of the same ``dsbd_beam`` request (diverse beam search,
    ``test_engine_beam_groups.py`` tests it against an oracle), not the request's beams without groups; a width that
    the groups do not divide is a 400 naming ``num_beam_groups``."""
    (c1, groups), (c2, plain), (c3, direct), (c4, bad) = dsbd["groups"]
    assert (c1, c2, c3) == (200, 200, 200), (groups, plain, direct)
    beams = [b["token_ids"] for b in direct["kv_transfer_params"]["dsbd_beam"]]
    # use_beam_search leaves a final EOS out of the tokens (vLLM's loop, without include_stop_str_in_output)
    assert [c["token_ids"] for c in groups["choices"]] == [t[:-1] if t and t[-1] == EOS else t for t in beams]
    assert [c["token_ids"] for c in groups["choices"]] != [c["token_ids"] for c in plain["choices"]]
    assert c4 == 400 and bad["error"]["param"] == "num_beam_groups", bad


def _split(choice):
    """(the choice without logprob values, the chosen tokens' and the alternatives' logprobs, the logprobs' tokens).
    Completions with ``logprobs`` 0 return one alternative, the first of vLLM's dict: its one-token request's sampled
    token, random at temperature 1 (``n4_t1``), so the alternatives are compared only where more were asked for."""
    c = json.loads(json.dumps(choice))
    lp = c.pop("logprobs")
    if "message" in c:  # chat: content entries {token, logprob, bytes, top_logprobs}
        vals = [v for e in lp["content"] for v in [e["logprob"]] + [a["logprob"] for a in e["top_logprobs"]]]
        return c, vals, [(e["token"], e["bytes"], [(a["token"], a["bytes"]) for a in e["top_logprobs"]])
                         for e in lp["content"]]
    tops = lp.get("top_logprobs") or []
    if all(len(d or {}) <= 1 for d in tops):
        tops = []
    vals = list(lp["token_logprobs"]) + [v for d in tops for v in (d or {}).values()]
    return c, vals, (lp["tokens"], lp["text_offset"], [list(d or {}) for d in tops])


def _assert_same(got, expected, name):
    assert len(got["choices"]) == len(expected["choices"]), name
    for g, e in zip(got["choices"], expected["choices"]):
        gc, glp, gtok = _split(g)
        ec, elp, etok = _split(e)
        assert gc == ec, (name, g, e)
        assert gtok == etok, (name, g, e)
        assert len(glp) == len(elp) and all(abs(a - b) < 1e-4 for a, b in zip(glp, elp)), (name, glp, elp)
    assert got["usage"] == expected["usage"], name


@pytest.mark.parametrize("name", [r[0] for r in REQUESTS])
def test_beam_search_choices_equal_plain_vllm(dsbd, plain, name):
    _assert_same(dsbd[name][1], plain[name][1], name)


def test_requests_not_vacuous(plain, models):
    eos = models[2]
    n = {name: len(plain[name][1]["choices"]) for name, *_ in REQUESTS}
    assert n == {"n2": 2, "n4": 4, "n4_lp05": 4, "n4_lp2": 4, "n4_stop_str": 4, "two_prompts": 4, "chat": 2,
                 "n4_t1": 4, "n2_lp2": 2, "chat_top2": 2}
    # the length penalty changes vLLM's answer here (its beams end on EOS at different lengths)
    assert [c["token_ids"] for c in plain["n4_lp05"][1]["choices"]] != \
        [c["token_ids"] for c in plain["n4_lp2"][1]["choices"]]
    # the alternatives are there: per token the first 3 of the loop's 2 * n (completions return logprobs + 1), chat 2
    for c in plain["n2_lp2"][1]["choices"]:
        tops = c["logprobs"]["top_logprobs"]
        assert len(tops) == len(c["logprobs"]["tokens"]) > 0 and all(len(d) == 3 for d in tops), tops
    for c in plain["chat_top2"][1]["choices"]:
        assert all(len(e["top_logprobs"]) == 2 for e in c["logprobs"]["content"]), c
    # vLLM's beams do not depend on the temperature
    _assert_same(plain["n4_t1"][1], plain["n4"][1], "n4_t1 vs n4")
    reasons = {name: [c["finish_reason"] for c in plain[name][1]["choices"]] for name, *_ in REQUESTS}
    assert all("length" in r for r in reasons.values()), reasons
    assert all("stop" in reasons[name] for name in ("n2", "n4", "n4_stop_str")), reasons
    # an EOS-finished beam with tokens before its EOS (the trie held it for more than one step)
    assert any(c["finish_reason"] == "stop" and len(c["token_ids"]) >= 2 for c in plain["n2"][1]["choices"])
    # include_stop_str_in_output: an EOS-finished beam's token ids end in EOS, its text does not hold it
    stopped = [c for c in plain["n4_stop_str"][1]["choices"] if c["finish_reason"] == "stop"]
    assert stopped and all(c["token_ids"][-1] == eos and c["stop_reason"] == eos for c in stopped)
    stopped = [c for c in plain["n4"][1]["choices"] if c["finish_reason"] == "stop"]
    assert stopped and all(eos not in c["token_ids"] for c in stopped)


def test_beams_ran_in_the_engine(dsbd):
    """The DSBD server made one engine request per prompt (vLLM's loop makes one per live beam per token; the bad
    requests never reached the engine)."""
    vals = [float(line.rsplit(" ", 1)[1]) for line in dsbd["metrics"].splitlines()
            if line.startswith("vllm:request_success_total")]
    n_prompts = len(REQUESTS) + 1 + 1  # two_prompts has 2; after_bad is one more
    assert vals and sum(vals) == n_prompts, [l for l in dsbd["metrics"].splitlines() if "request_success" in l]


def _beam_counts(text: str) -> dict:
    """DSBD's beam counters on ``/metrics``: target passes, beam steps, forest nodes verified, layers passed."""
    names = {"passes": "vllm:dsbd_beam_target_passes_total", "steps": "vllm:dsbd_beam_steps_total",
             "nodes": "vllm:dsbd_beam_draft_nodes_total", "layers_passed": "vllm:dsbd_beam_layers_passed_total"}
    return {k: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
            for k, name in names.items()}


def test_beam_requests_drafted_forests_and_passed_layers(dsbd):
    """The beam searches had draft forests verified and forest layers passed, so fewer target passes than beam steps;
    the streamed ``dsbd_beam`` requests had forests verified (a server without drafting would fail here). Measured:
    the beam searches 44 passes for 46 steps (82 nodes, 2 layers passed), the streamed requests 40 for 40 (72 nodes:
    their forests never passed at T = 0 on this random pair)."""
    first, end = _beam_counts(dsbd["metrics"]), _beam_counts(dsbd["metrics_end"])
    streamed = {k: end[k] - first[k] for k in end}
    print("beam counters after the beam searches:", first, "; the streamed requests:", streamed)
    assert first["nodes"] > 0 and first["layers_passed"] > 0, first
    assert first["steps"] <= first["passes"] + first["layers_passed"] and first["passes"] < first["steps"], first
    assert streamed["nodes"] > 0 and streamed["passes"] > 0, streamed


def test_bad_beam_requests_are_400_and_server_keeps_serving(dsbd, plain):
    for (code, body), (*_, param) in zip(dsbd["bad"], BAD):
        assert code == 400, (code, body)
        assert body["error"]["param"] == param, body
        assert body["error"]["message"].startswith(f"{param}: "), body
    assert dsbd["alive"]
    assert dsbd["after_bad"][0] == 200
    _assert_same(dsbd["after_bad"][1], plain["n2"][1], "after_bad")


@pytest.mark.parametrize("name", [n for n, *_ in STREAMS])
def test_streamed_beam_request_streams_the_settled_prefix(dsbd, name):
    chunks, (code, whole) = dsbd["streams"][name]
    assert code == 200, whole
    beams = [b["token_ids"] for b in whole["kv_transfer_params"]["dsbd_beam"]]
    best = whole["kv_transfer_params"]["dsbd_beam"][0]
    (choice,) = whole["choices"]
    # unstreamed, the request's choice is its best beam
    assert choice["token_ids"] == best["token_ids"] and choice["finish_reason"] == best["finish_reason"]
    parts = [(c["choices"][0].get("token_ids") or [], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
             for c in chunks if c["choices"]]
    assert [r for *_, r in parts] == [None] * (len(parts) - 1) + [best["finish_reason"]]
    before = [t for ids, *_ in parts[:-1] for t in ids]
    assert before, parts  # tokens arrived before the request finished
    for b in beams:  # never retracted: every beam starts with what was streamed before the end
        assert b[: len(before)] == before, (before, beams)
    assert before + parts[-1][0] == best["token_ids"]
    assert "".join(t for _, t, _ in parts) == choice["text"]


def test_streamed_beam_request_refusals(dsbd):
    (code, body), (code2, body2), (code3, body3) = dsbd["stream_bad"]
    # engine logprobs on a streamed (DELTA) beam request: refused (the error is the stream's one event)
    msg = "logprobs: not supported on a streamed beam request"
    assert code == 200 and msg in body and '"finish_reason"' not in body, body
    # unstreamed: served, the best beam's tokens with their logprobs (the chosen token and its row's best one)
    assert code2 == 200, body2
    (choice,) = json.loads(body2)["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(choice["token_ids"]) > 0, choice
    assert all(1 <= len(d) <= 2 for d in lp["top_logprobs"]), lp
    assert code3 == 400 and "vllm_xargs" in body3, body3  # vLLM's own: no mappings in vllm_xargs
    assert dsbd["stream_alive"]
