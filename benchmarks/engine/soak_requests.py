"""The soak's request mix: seeded random specs (plain, beam, disconnecting and bad requests) and their execution
against the server, one HTTP request each (``soak.py``)."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

from soak_server import MODEL_NAME, Client  # beside this file

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew strange potions in old "
         "castles near rivers of silver light and every morning bakers sell warm bread to sleepy travellers").split()
# bad request: (name the 400 message must contain, extra payload fields)
BAD_KINDS = (
    ("dsbd_width", {"vllm_xargs": {"dsbd_width": 99}}),
    ("prompt_logprobs", {"prompt_logprobs": 1}),
)



# ----------------------------------------------------------------------------------------------------------------
# the request mix
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Spec:
    index: int
    kind: str  # "plain", "beam", "disconnect", "bad"
    endpoint: str  # "completions" or "chat"
    stream: bool
    payload: dict
    width: int | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    bad_param: str | None = None
    n: int = 1


@dataclass
class Result:
    index: int
    kind: str
    endpoint: str
    stream: bool
    temperature: float | None
    width: int | None
    status: int | None = None
    ok: bool = False
    texts: list[str] | None = None
    finish_reasons: list[Any] | None = None
    completion_tokens: int | None = None
    events: int | None = None
    error: str | None = None
    bad_form: str | None = None
    latency_s: float | None = None
    replay_texts: list[str] | None = None
    replay_equal: bool | None = None


def _prompt(rng: random.Random, endpoint: str) -> Any:
    if endpoint == "completions" and rng.random() < 0.25:  # token ids
        return [rng.randrange(3, 390) for _ in range(rng.randint(2, 12))]
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))


def _base_payload(rng: random.Random, endpoint: str) -> dict:
    if endpoint == "completions":
        return {"model": MODEL_NAME, "prompt": _prompt(rng, endpoint)}
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _prompt(rng, endpoint)})
    messages.append({"role": "user", "content": _prompt(rng, endpoint)})
    return {"model": MODEL_NAME, "messages": messages}


def make_specs(num: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(num):
        u = rng.random()
        kind = "bad" if u < 0.10 else "disconnect" if u < 0.20 else "beam" if u < 0.28 else "plain"
        endpoint = "completions" if rng.random() < 0.55 else "chat"
        if kind == "beam":
            endpoint = "completions" if rng.random() < 0.6 else "chat"
            max_tokens = rng.randint(3, 8)
            payload = {**_base_payload(rng, endpoint), "use_beam_search": True, "n": 2, "temperature": 0,
                       "max_tokens": max_tokens, "ignore_eos": True}
            specs.append(Spec(i, kind, endpoint, False, payload, temperature=0.0, max_tokens=max_tokens,
                              ignore_eos=True, n=2))
            continue
        width = rng.choice((1, 2, 4))
        temperature = rng.choice((0.0, 1.0))
        payload = {**_base_payload(rng, endpoint), "temperature": temperature, "vllm_xargs": {"dsbd_width": width}}
        if temperature > 0:
            payload["seed"] = rng.randrange(1 << 30)
        if kind == "bad":
            param, extra = rng.choice(BAD_KINDS)
            payload.update(json.loads(json.dumps(extra)))
            if param == "dsbd_width":
                payload["vllm_xargs"] = {"dsbd_width": 99}
            stream = rng.random() < 0.5
            payload.update(max_tokens=rng.randint(2, 16), stream=stream)
            specs.append(Spec(i, kind, endpoint, stream, payload, width, temperature, bad_param=param))
            continue
        if kind == "disconnect":  # long enough that the client leaves well before the end
            max_tokens = rng.randint(64, 120)
            payload.update(max_tokens=max_tokens, ignore_eos=True, stream=True)
            specs.append(Spec(i, kind, endpoint, True, payload, width, temperature, max_tokens, True))
            continue
        stream = rng.random() < 0.5
        max_tokens = rng.randint(4, 24)
        ignore_eos = rng.random() < 0.8
        payload.update(max_tokens=max_tokens, stream=stream)
        if ignore_eos:
            payload["ignore_eos"] = True
        if stream:
            payload["stream_options"] = {"include_usage": True}
        if rng.random() < 0.15:
            if endpoint == "completions":
                payload["logprobs"] = 2
            else:
                payload.update(logprobs=True, top_logprobs=2)
        specs.append(Spec(i, kind, endpoint, stream, payload, width, temperature, max_tokens, ignore_eos))
    return specs


def _path(endpoint: str) -> str:
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


def _choice_text(endpoint: str, choice: dict) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    return (choice.get("message") or {}).get("content") or ""


def _delta_text(endpoint: str, choice: dict) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def execute(client: Client, spec: Spec) -> Result:
    """Sends one request and checks its answer; never raises."""
    res = Result(spec.index, spec.kind, spec.endpoint, spec.stream, spec.temperature, spec.width)
    t0 = time.monotonic()
    try:
        _execute(client, spec, res)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the soak
        res.ok, res.error = False, f"{type(e).__name__}: {e}"
    res.latency_s = round(time.monotonic() - t0, 3)
    return res


def _execute(client: Client, spec: Spec, res: Result) -> None:
    path = _path(spec.endpoint)
    if spec.kind == "bad":
        if spec.stream:
            status, events, _, body = client.post_stream(path, spec.payload)
        else:
            status, body = client.post(path, spec.payload)
        res.status = status
        if status == 400:
            msg = body.decode(errors="replace")
            res.ok = spec.bad_param in msg
            res.bad_form = "http 400"
        elif status == 200 and spec.stream:
            # vLLM validates a streaming request's sampling parameters only once the response has started (plain
            # vLLM does the same with its own checks): the 400 then comes as the stream's only event,
            # {"error": {"code": 400, "message": ...}}, with no tokens.
            errs = [ev.get("error") for ev in events if ev.get("error")]
            msg = json.dumps(errs)
            res.ok = (len(events) == 1 and len(errs) == 1 and errs[0].get("code") == 400
                      and spec.bad_param in (errs[0].get("message") or ""))
            res.bad_form = "stream error event 400"
        else:
            msg = body.decode(errors="replace")
        if not res.ok:
            res.error = f"expected 400 naming {spec.bad_param}, got {status}: {msg[:300]}"
        return
    if spec.kind == "disconnect":
        status, events, done, body = client.post_stream(path, spec.payload, stop_after=2)
        res.status, res.events = status, len(events)
        res.ok = status == 200 and len(events) == 2 and not done
        if not res.ok:
            res.error = f"expected 200 and 2 events before closing, got {status}, {len(events)} events, " \
                        f"done={done}: {body[:300]!r}"
        return
    if spec.stream:
        status, events, done, body = client.post_stream(path, spec.payload)
        res.status, res.events = status, len(events)
        if status != 200:
            res.error = f"status {status}: {body[:300]!r}"
            return
        texts: dict[int, list[str]] = {}
        finish: dict[int, Any] = {}
        usage = None
        for ev in events:
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                k = ch.get("index", 0)
                texts.setdefault(k, []).append(_delta_text(spec.endpoint, ch))
                if ch.get("finish_reason") is not None:
                    finish[k] = ch["finish_reason"]
        res.texts = ["".join(texts.get(k, [])) for k in range(spec.n)]
        res.finish_reasons = [finish.get(k) for k in range(spec.n)]
        res.completion_tokens = usage.get("completion_tokens") if usage else None
        problems = []
        if not done:
            problems.append("no [DONE]")
        if usage is None:
            problems.append("no usage chunk")
    else:
        status, body = client.post(path, spec.payload)
        res.status = status
        if status != 200:
            res.error = f"status {status}: {body[:300]!r}"
            return
        out = json.loads(body)
        choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        res.texts = [_choice_text(spec.endpoint, c) for c in choices]
        res.finish_reasons = [c.get("finish_reason") for c in choices]
        res.completion_tokens = (out.get("usage") or {}).get("completion_tokens")
        problems = []
        if len(choices) != spec.n:
            problems.append(f"{len(choices)} choices, expected {spec.n}")
        if "logprobs" in spec.payload and spec.payload.get("logprobs"):
            for c in choices:
                lp = c.get("logprobs")
                count = (len(lp.get("token_logprobs") or []) if spec.endpoint == "completions"
                         else len(lp.get("content") or [])) if lp else 0
                if spec.ignore_eos and count != spec.max_tokens:
                    problems.append(f"{count} logprobs entries, expected {spec.max_tokens}")
    if any(f is None for f in res.finish_reasons):
        problems.append(f"finish_reason missing: {res.finish_reasons}")
    if spec.kind == "plain" and spec.ignore_eos and res.completion_tokens != spec.max_tokens:
        problems.append(f"completion_tokens {res.completion_tokens}, expected {spec.max_tokens}")
    if spec.kind == "plain" and spec.ignore_eos and res.finish_reasons != ["length"]:
        problems.append(f"finish_reason {res.finish_reasons}, expected ['length'] (ignore_eos)")
    if spec.kind == "plain" and not spec.ignore_eos and res.completion_tokens is not None \
            and not 1 <= res.completion_tokens <= spec.max_tokens:
        problems.append(f"completion_tokens {res.completion_tokens} not in [1, {spec.max_tokens}]")
    res.ok = not problems
    if problems:
        res.error = "; ".join(problems)
