"""DSBD through vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.cli.main serve``) on CPU.

One server (module fixture) in a subprocess, tiny random Llama pair (target 3 layers, draft = its first 2), DSBD
width 2, depth 2. Checked over HTTP with the stdlib only: completions (temperature 0), chat completions (with a
trivial chat template: the tiny tokenizer has none), streaming, the per-request width ``vllm_xargs.dsbd_width``, and
``/metrics`` showing speculative drafts and DSBD's own metrics; every request test reads DSBD's counters around its
requests and asserts that they drafted forests and passed layers (so drafting switched off would fail them). The server runs as ``vllm serve`` does by default: the
engine core in a child process of the API server, so DSBD's metrics must cross processes to reach ``/metrics``.
Separately, a misspelt DSBD key makes ``serve`` exit non-zero naming it (in-process engine: faster to fail).

Temperature-0 texts are compared with plain vLLM on the same weights (an offline engine run before the server
starts, same prompts as token ids). Requests that used to take the server down (logprobs, ``use_beam_search``) are
answered, a setting DSBD does not apply is a 400 naming it, and a good request afterwards still succeeds. Structured
outputs (``response_format`` ``json_schema`` and ``json_object``) give plain vLLM's greedy text.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

from server_utils import running_server  # noqa: E402

from vllm_dsbd.testing.server import free_port, server_env  # noqa: E402  (the soak's server environment too)

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
MODEL_NAME = "tiny-dsbd"


def _serve_cmd(target, draft, port, spec_config, chat_template=None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target),
           "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port),
           "--speculative-method", "dsbd", "--spec-model", str(draft), "--spec-tokens", "2",
           "--speculative-config", spec_config,
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--seed", "0",
           "--max-num-seqs", "8", "--structured-outputs-config", json.dumps(STRUCTURED_CONFIG)]
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    return cmd


PROMPT_IDS = [[5, 6, 7, 8, 9], [100, 101, 102], [250, 3, 77, 12]]
MAX_TOKENS = 12
# structured outputs: xgrammar without whitespace between JSON tokens (a random model's greedy JSON is otherwise all
# whitespace), a schema with a finite language (the object closes)
STRUCTURED_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def plain_texts(tiny_pair):
    """Plain vLLM (no speculation), temperature 0, in this process; runs before the server starts."""
    from engine_utils import dsbd_llm
    from vllm.sampling_params import BeamSearchParams

    from vllm.sampling_params import StructuredOutputsParams

    with dsbd_llm(tiny_pair[0], enable_prefix_caching=None, disable_log_stats=True,  # vLLM's defaults for these
                  structured_outputs_config=STRUCTURED_CONFIG) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPT_IDS],
                            vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        tok = llm.get_tokenizer()
        beam_texts = {}
        for n in (2, 4):
            beams = llm.beam_search([{"prompt_token_ids": PROMPT_IDS[0]}],
                                    BeamSearchParams(beam_width=n, max_tokens=6))
            beam_texts[n] = []
            for seq in beams[0].sequences:  # the server's choice text: generated tokens without a final EOS
                gen = seq.tokens[len(PROMPT_IDS[0]):]
                beam_texts[n].append(tok.decode(gen[:-1] if gen and gen[-1] == tok.eos_token_id else gen))
        structured = {}
        for name, so, n in (("json_schema", StructuredOutputsParams(json=SCHEMA), 40),
                            ("json_object", StructuredOutputsParams(json_object=True), MAX_TOKENS)):
            (o,) = llm.generate([{"prompt_token_ids": PROMPT_IDS[0]}], vllm.SamplingParams(
                temperature=0, max_tokens=n, structured_outputs=so), use_tqdm=False)
            structured[name] = o.outputs[0].text
    return texts, beam_texts, structured


def _request(url, payload=None, timeout=120):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


@pytest.fixture(scope="module")
def server(tiny_pair, plain_texts, tmp_path_factory):  # plain_texts first: its engine is gone before the server starts
    target, draft = tiny_pair
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = free_port()
    # the cost model off: the metrics test needs forests, which it would switch off for this tiny draft
    spec = '{"width": 2, "cost_model": null}'
    with running_server(_serve_cmd(target, draft, port, spec, template), port, server_env(),
                        tmp / "server.log", STARTUP_TIMEOUT_S) as (base, proc, tail):
        yield base, proc, tail


def _completion(base, **extra):
    payload = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 12, "temperature": 0, **extra}
    with _request(base + "/v1/completions", payload) as r:
        assert r.status == 200
        return json.loads(r.read())


def _dsbd_counts(base) -> dict:
    """DSBD's counters on the server's ``/metrics``: forest iterations, forest nodes verified, layers passed (the sum
    of the per-iteration histogram)."""
    with _request(base + "/metrics") as r:
        text = r.read().decode()
    names = {"forests": "vllm:dsbd_iterations_total", "nodes": "vllm:dsbd_draft_nodes_total",
             "layers_passed": "vllm:dsbd_layers_passed_sum"}
    return {k: sum(v for _, v in _samples(text, name)) for k, name in names.items()}


@contextlib.contextmanager
def drafted(base):
    """Asserts that the requests made inside the block drafted forests and passed layers (DSBD's counters on
    ``/metrics`` grew): a server with drafting switched off would fail here. Yields the counts' growth."""
    before = _dsbd_counts(base)
    grown = {}
    yield grown
    after = _dsbd_counts(base)
    grown.update({k: after[k] - before[k] for k in after})
    assert grown["forests"] > 0 and grown["nodes"] > 0 and grown["layers_passed"] > 0, grown


def test_completion(server):
    base, _, _ = server
    with drafted(base):
        out = _completion(base)
    assert out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 12
    again = _completion(base)  # temperature 0: deterministic
    assert again["choices"][0]["text"] == out["choices"][0]["text"]


def test_chat_completion(server):
    base, _, _ = server
    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10,
               "temperature": 0}
    with drafted(base), _request(base + "/v1/chat/completions", payload) as r:
        assert r.status == 200
        out = json.loads(r.read())
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert msg["content"]
    assert out["usage"]["completion_tokens"] == 10


def test_streaming_completion(server):
    base, _, _ = server
    payload = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 12, "temperature": 0, "stream": True}
    chunks, done = [], False
    with drafted(base), _request(base + "/v1/completions", payload) as r:
        assert r.status == 200
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done
    assert len(chunks) >= 2
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == _completion(base)["choices"][0]["text"]


def test_request_width_1(server):
    base, _, _ = server
    with drafted(base):  # width 1: a chain forest
        out = _completion(base, vllm_xargs={"dsbd_width": 1})
    assert out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 12


def test_metrics_show_drafts(server):
    base, _, _ = server
    _completion(base)
    with _request(base + "/metrics") as r:
        text = r.read().decode()
    # the counter's samples (not its "_created" timestamp)
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts{"))]
    assert values and sum(values) > 0, [l for l in text.splitlines() if "spec_decode" in l][:20]
    # one per-position series per draft depth (--spec-tokens 2), not one per forest slot (width * depth)
    positions = {line.split('position="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")}
    assert positions == {"0", "1"}, positions


def _samples(text: str, prefix: str) -> list[tuple[str, float]]:
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line.startswith(prefix)]


def test_dsbd_metrics_cross_processes(server):
    """DSBD's own Prometheus metrics, recorded in the engine core process, are on the API server's ``/metrics``:
    forest iterations, layers passed, per-layer widths, emitted tokens and pass rates per source and N, counted for
    the requests made."""
    base, _, _ = server
    for _ in range(2):
        _completion(base)
    with _request(base + "/metrics") as r:
        text = r.read().decode()
    iters = _samples(text, "vllm:dsbd_iterations_total")
    tokens = _samples(text, "vllm:dsbd_emitted_tokens_total")
    passed = _samples(text, "vllm:dsbd_layers_passed_count")
    widths = _samples(text, 'vllm:dsbd_layer_width_count{layer="1"}')
    assert iters and iters[0][1] > 0, [l for l in text.splitlines() if "dsbd" in l][:20]
    assert tokens and tokens[0][1] >= 2 * 12  # at least the two 12-token completions just made
    assert passed and passed[0][1] == iters[0][1]  # one layers-passed observation per forest iteration
    assert _samples(text, "vllm:dsbd_layers_passed_sum")[0][1] > 0  # and layers passed
    assert _samples(text, "vllm:dsbd_draft_nodes_total")[0][1] >= iters[0][1]
    assert widths and 0 < widths[0][1] <= iters[0][1]
    # the width of a verified layer is between 1 and the engine's width 2
    buckets = dict(_samples(text, 'vllm:dsbd_layer_width_bucket{layer="1",'))
    assert buckets['vllm:dsbd_layer_width_bucket{layer="1",le="2.0"}'] == widths[0][1]
    # the pass rates per source, kind and N: children made while serving, memory-mapped too (one layer tried or more
    # per forest; the cost model is off, so plain requests draft their width: 2, or 1 where a request asked for it)
    tried = dict(_samples(text, "vllm:dsbd_draft_layers_tried_total{"))
    name = 'vllm:dsbd_draft_layers_tried_total{kind="plain",nodes="%d",source="model"}'
    assert name % 2 in tried and set(tried) <= {name % 1, name % 2}, tried
    assert sum(tried.values()) >= iters[0][1]
    assert sum(v for _, v in _samples(text, "vllm:dsbd_draft_layers_passed_total{")) == _samples(
        text, "vllm:dsbd_layers_passed_sum")[0][1]


def test_bad_startup_config_exits_naming_key(tiny_pair):
    target, draft = tiny_pair
    proc = subprocess.run(_serve_cmd(target, draft, free_port(), '{"widht": 2}'),
                          env=server_env(multiprocessing=False),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "widht" in proc.stdout + proc.stderr


def test_temperature_zero_equals_plain_vllm(server, plain_texts):
    base, _, _ = server
    for width in (1, 2):
        with drafted(base):  # not vacuous: forests at each width
            for ids, expected in zip(PROMPT_IDS, plain_texts[0]):
                out = _completion(base, prompt=ids, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  vllm_xargs={"dsbd_width": width})
                assert out["choices"][0]["text"] == expected, (ids, width)


def test_logprobs_request_is_answered(server):
    base, _, _ = server
    out = _completion(base, prompt=PROMPT_IDS[0], logprobs=3, ignore_eos=True, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 12 and all(x is not None and x <= 0 for x in lp["token_logprobs"])
    # temperature 0: the emitted token is the most likely one (keys "token_id:N": the tiny tokenizer decodes several
    # ids to one text, which would merge entries keyed by text)
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) >= 3 and abs(max(top.values()) - chosen) < 1e-5 and top[tok] == chosen, (tok, chosen, top)
    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
               "temperature": 0, "logprobs": True, "top_logprobs": 2}
    with _request(base + "/v1/chat/completions", payload) as r:
        assert r.status == 200
        content = json.loads(r.read())["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 2 for c in content)


@pytest.mark.parametrize("n", [2, 4])
def test_use_beam_search_equals_plain_vllm(server, plain_texts, n):
    """``use_beam_search`` on the DSBD server equals vLLM's own beam search (its front-end loop on plain vLLM), also at
    n = 4, above the server's width 2 (a beam request's width does not depend on it: ``max_beam_width``)."""
    base, _, _ = server
    out = _completion(base, prompt=PROMPT_IDS[0], max_tokens=6, use_beam_search=True, n=n)
    assert [c["text"] for c in out["choices"]] == plain_texts[1][n]


def test_structured_outputs_equal_plain_vllm(server, plain_texts):
    """OpenAI ``response_format`` (``json_schema``, ``json_object``) on the DSBD server: the
    same greedy text as plain vLLM with the same structured outputs (its forests drafted under the grammar:
    docs/deviations.md D22), the schema's objects valid."""
    base, _, _ = server
    plain = plain_texts[2]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    text = _completion(base, prompt=PROMPT_IDS[0], max_tokens=40, response_format=fmt)["choices"][0]["text"]
    assert text == plain["json_schema"]
    assert set(json.loads(text)) == {"ok", "tag"}
    out = _completion(base, prompt=PROMPT_IDS[0], max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    assert out["choices"][0]["text"] == plain["json_object"]
    assert _completion(base)["choices"][0]["text"]  # and a plain request still drafts and is served


def test_unsupported_setting_is_400_and_server_survives(server):
    base, _, _ = server
    with pytest.raises(urllib.error.HTTPError) as err:
        _completion(base, repetition_detection={"max_pattern_size": 4, "min_count": 3})
    assert err.value.code == 400, err.value.code
    assert "repetition_detection: not supported with speculative method 'dsbd'" in err.value.read().decode()
    assert _completion(base)["choices"][0]["text"]


# The last test that uses the server: a bad width once killed the engine core and the server with it.
def test_bad_request_width_is_400_and_server_survives(server):
    base, _, _ = server
    with pytest.raises(urllib.error.HTTPError) as err:
        _completion(base, vllm_xargs={"dsbd_width": 99})
    assert err.value.code == 400, err.value.code
    assert "dsbd_width" in err.value.read().decode(errors="replace")
    out = _completion(base)  # a good request right after still succeeds
    assert out["choices"][0]["text"]
