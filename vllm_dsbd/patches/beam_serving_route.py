"""Patch: the OpenAI server's beam search (``use_beam_search``) on a DSBD engine runs inside the engine, one request
per prompt.

What: on a DSBD engine, ``BeamSearchOnlineMixin.beam_search`` (the beam search behind ``/v1/completions`` and
``/v1/chat/completions`` with ``use_beam_search: true``; ``n`` is the beam width) sends ONE engine request per prompt,
as patch ``beam_search_route`` does for ``LLM.beam_search``: ``extra_args["dsbd_beam"]`` (``beam_request_params``),
the DSBD runner keeps the W beams as a trie in the request's own KV slots, and the finished request's
``kv_transfer_params["dsbd_beam"]`` carries the beams (patch ``beam_scheduler``). They become the one finished
``RequestOutput`` vLLM's loop yields, with what that loop puts in it: n = beam_width outputs, best first, each with
the generated tokens (a final EOS only with ``include_stop_str_in_output``), the text of those tokens without a final
EOS, the cumulative log-probability, per-token logprobs, finish reason "stop" (EOS; ``stop_reason`` = the EOS id) or
"length". At temperature 0 the choices are vLLM's own (tests/serve/test_engine_beams_serve.py: same text, token ids,
finish reasons and token logprobs as a plain vLLM server).

Why: vLLM's online beam search (``entrypoints/generate/beam_search/online.py:28-220``) is a front-end loop: per
token, one new engine request per live beam (``max_tokens=1``, ``logprobs=2 * beam_width``), each a prefill of
prompt + beam; on a DSBD engine each of those is also a one-token DSBD request. In the engine, one request advances
all W beams per step, batched with every other request.

How: wrap ``beam_search``; engines whose ``speculative_config.method`` is not "dsbd" get the original unchanged. For
"dsbd" an async generator (the original is one) validates, sends the request through ``self.engine_client.generate``
(``output_kind`` FINAL_ONLY; same lora_request and trace headers as the original's requests; a disconnecting client
aborts it, as any engine request) and yields one finished ``RequestOutput``; a request that ends with finish reason
"error" yields vLLM's error output. Bad requests raise ``VLLMValidationError`` (a ``ValueError``: the server's
handler answers 400 with ``param``, and the engine never sees the request) from inside the generator, where the
original's errors come from: a width (``n``) above the engine's ``max_beam_width`` (``param`` "n"), a trie that may
not fit the engine's KV slots per request (``prompt + max_tokens * (n + 1) + 2`` slots against ``max_model_len``, or
``max_beam_slots`` when larger, ``param`` "max_tokens"; a chat request without
``max_tokens`` gets vLLM's default ``max_model_len - prompt`` and is refused; completions default to 16), prompts
other than text/tokens (``param`` "prompt"; embeddings raise the original's ``NotImplementedError``). The
request's ``stop`` and ``stop_token_ids`` (which vLLM's loop ignores silently: ``BeamSearchParams`` has no such field)
go to the beams (``beam_request_params``), and so do ``num_beam_groups`` / ``diversity_penalty`` (extra request
fields, diverse beam search: engine/beams/groups.py; a bad value is a 400 naming it). Completions ``logprobs`` and chat ``logprobs``/``top_logprobs`` are served:
every output's per-token logprobs are the 2 * beam_width-entry dicts of vLLM's loop (its one-token requests' 2W best
tokens of the row, with ranks, ``position_dict``), from the beams' top rows in ``kv_transfer_params["dsbd_beam"]``;
the OpenAI serializer keeps the requested number of alternatives from them, as for vLLM's loop.
The request's ``response_format`` (``json_object``, ``json_schema``) and ``structured_outputs`` (which vLLM's loop
also ignores silently: ``to_beam_search_params`` drops them) go to the beams as well: they follow the grammar as
``LLM.beam_search``'s beams do (``engine/beams/grammar.py``).
The engine request runs at temperature 0 whatever the request's temperature: vLLM's loop ranks the raw log-probabilities its one-token requests return
(``entrypoints/generate/beam_search/online.py:59-65`` passes the temperature to those requests, whose logprobs are
computed before any temperature, v1/sample/sampler.py:80-93), so its beams do not depend on the temperature and the
OpenAI endpoints' default temperature 1 gives the same beams as temperature 0 (one exception, random on vLLM too:
the token a one-token request samples is among its logprobs, so above temperature 0 a sampled EOS outside the top
2 * beam_width adds a finished candidate to vLLM's loop, which the engine does not draw). Beam sampling is asked for explicitly
(``vllm_xargs`` ``dsbd_beam`` on a request without ``use_beam_search``).

When it can go: vLLM's online beam search runs in the engine and lets a speculative method serve it (with
``beam_search_route``).
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "beam_serving_route"
MODULE = "vllm.entrypoints.generate.beam_search.online"
# the OpenAI request classes whose ``to_beam_search_params`` build the params of ``use_beam_search`` requests
REQUEST_MODULES = {"vllm.entrypoints.openai.completion.protocol": "CompletionRequest",
                   "vllm.entrypoints.openai.chat_completion.protocol": "ChatCompletionRequest"}
STOPS_ATTR = "_dsbd_stops"  # the request's stop strings and stop token ids, for the beams (``beam_request_params``)
# the request's ``response_format`` / ``structured_outputs`` as ``StructuredOutputsParams``, for the beams
STRUCTURED_ATTR = "_dsbd_structured"


def apply() -> None:
    when_imported(MODULE, _patch)
    for module, cls in REQUEST_MODULES.items():
        when_imported(module, lambda mod, cls=cls: _patch_request(getattr(mod, cls)))


GROUP_FIELDS = ("num_beam_groups", "diversity_penalty")  # diverse beam search: extra fields of an OpenAI request


def request_stops(request) -> dict:
    """The ``dsbd_beam`` keys an OpenAI request adds to its beams (empty when none): its ``stop`` and
    ``stop_token_ids``, and diverse beam search's ``num_beam_groups`` / ``diversity_penalty``, extra fields of the
    request (vLLM's request models keep unknown fields in ``model_extra``; its own loop ignores them)."""
    stop = getattr(request, "stop", None) or []
    ids = getattr(request, "stop_token_ids", None) or []
    out = {}
    if stop:
        out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if ids:
        out["stop_token_ids"] = list(ids)
    extra = getattr(request, "model_extra", None) or {}
    out.update({k: extra[k] for k in GROUP_FIELDS if extra.get(k) is not None})
    return out


def _patch_request(cls: type) -> None:
    def make(orig):
        def to_beam_search_params(self, *args, **kwargs):
            params = orig(self, *args, **kwargs)
            setattr(params, STOPS_ATTR, request_stops(self))
            extract = getattr(self, "extract_structured_outputs", None)
            setattr(params, STRUCTURED_ATTR, extract() if extract is not None else None)
            return params

        return to_beam_search_params

    wrap_method(PATCH_ID, cls, "to_beam_search_params", make)


# request field of a ``BeamParams.parse`` key (``beam_request_params``' messages name ``extra_args['dsbd_beam'][key]``)
_FIELDS = {"width": "n", "max_tokens": "max_tokens", "length_penalty": "length_penalty", "ignore_eos": "ignore_eos",
           **{k: k for k in GROUP_FIELDS}}


def _validation_error(message: str):
    """A ``VLLMValidationError`` whose ``parameter`` is the request field the message is about (or None)."""
    from vllm.exceptions import VLLMValidationError

    head = message.split(":", 1)[0]
    param = head if head.isidentifier() else next((f for k, f in _FIELDS.items() if f"[{k!r}]" in message), None)
    return VLLMValidationError(message, parameter=param)


def position_dict(token: int, logprob: float, top) -> dict:
    """One position's logprobs as vLLM's loop returns them (its one-token request at temperature 0 with ``logprobs``
    2W): the 2W best tokens of the row, best first, with their ranks, the chosen one among them, no decoded text
    (its requests do not detokenize); the chosen token alone where the row is not known."""
    from vllm.logprobs import Logprob

    if not top:
        return {token: Logprob(logprob=logprob)}
    return {int(t): Logprob(logprob=float(v), rank=r + 1) for r, (t, v) in enumerate(top)}


def beam_request_output(prompt, request_id: str, out, tokenizer, params):
    """The ``RequestOutput`` vLLM's online beam search yields, from a finished DSBD beam request's ``out``.

    ``prompt``: the original's (decoder-only token) engine input; ``params``: its ``BeamSearchParams``. Mirrors the
    end of ``BeamSearchOnlineMixin.beam_search``: an EOS-finished beam's tokens keep the EOS only with
    ``include_stop_str_in_output`` while its logprobs always have the EOS step; the text skips a final EOS. A beam
    finished by a stop token id is treated as by EOS; one finished by a stop string keeps its tokens, and its text is
    cut at the stop string (kept with ``include_stop_str_in_output``), as vLLM cuts a plain request's. One its grammar
    completed (finish reason "stop", no stop reason: ``engine/beams/grammar.py``) keeps its tokens and text."""
    from vllm import CompletionOutput, RequestOutput
    from vllm.logprobs import Logprob

    from vllm_dsbd.engine.beams.stops import cut_at_stop
    from vllm_dsbd.patches.beam_search_route import finished_beams

    eos = tokenizer.eos_token_id
    prompt_token_ids = list(prompt["prompt_token_ids"])
    n_prompt = len(prompt_token_ids)
    outputs = []
    for i, b in enumerate(finished_beams(out)):
        gen = list(b["token_ids"])
        stop = b["finish_reason"] == "stop"
        reason = b.get("stop_reason", eos) if stop else None
        logprobs = [position_dict(t, lp, top) for t, lp, top in
                    zip(b["token_ids"], b["logprobs"], b.get("top_logprobs") or [None] * len(b["token_ids"]))]
        if isinstance(reason, str):  # a stop string: the tokens stay, the text is cut
            outputs.append(CompletionOutput(
                index=i, text=cut_at_stop(tokenizer.decode(gen), reason, params.include_stop_str_in_output),
                token_ids=gen, cumulative_logprob=b["cum_logprob"], logprobs=logprobs, finish_reason="stop",
                stop_reason=reason))
            continue
        if stop and reason is not None and reason != eos:  # a stop token id: vLLM's rule for a plain request's
            # (kept with include_stop_str_in_output)
            gen = gen if params.include_stop_str_in_output else gen[:-1]
            outputs.append(CompletionOutput(index=i, text=tokenizer.decode(gen), token_ids=gen,
                                            cumulative_logprob=b["cum_logprob"], logprobs=logprobs,
                                            finish_reason="stop", stop_reason=reason))
            continue
        if stop and reason is not None and not params.include_stop_str_in_output:
            gen = gen[:-1]  # vLLM's completed beam: the tokens before EOS (its logprobs keep the EOS step)
        tokens = prompt_token_ids + gen
        if tokens[-1] == eos and not params.ignore_eos:  # vLLM's test, literally (tokens may be the prompt alone)
            text = tokenizer.decode(tokens[n_prompt:-1])
        else:
            text = tokenizer.decode(tokens[n_prompt:])
        outputs.append(CompletionOutput(index=i, text=text, token_ids=gen, cumulative_logprob=b["cum_logprob"],
                                        logprobs=logprobs, finish_reason=b["finish_reason"] or "length",
                                        stop_reason=reason))
    return RequestOutput(request_id=request_id, prompt=prompt.get("prompt"), outputs=outputs, finished=True,
                         prompt_token_ids=prompt_token_ids, prompt_logprobs=None)


async def _dsbd_beam_search(serving, cfg, prompt, request_id, params, lora_request, trace_headers):
    from vllm import CompletionOutput, RequestOutput
    from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils import random_uuid

    from vllm_dsbd.config import DSBDConfig
    from vllm_dsbd.patches.beam_search_route import beam_request_params

    if prompt["type"] == "embeds":
        raise NotImplementedError("Embedding prompt not supported for beam search")  # the original's error
    if prompt["type"] != "token":
        raise VLLMValidationError("prompt: only text and token prompts are supported for beam search on a DSBD "
                                  "engine", parameter="prompt", value=prompt["type"])
    dcfg = DSBDConfig.from_vllm_config(cfg)
    width = dcfg.max_beam_width
    if isinstance(params.beam_width, int) and params.beam_width > width:
        raise VLLMValidationError(f"n: a beam search of width n = {params.beam_width} is above the engine's {width} "
                                  "beams per request (max_beam_width: a beam request of width W takes W - 1 scheduler "
                                  f"slots for its leaves; up to {width} fit, or start the server with a larger "
                                  "'max_beam_width' in --speculative-config)", parameter="n", value=params.beam_width)
    tokenizer = serving.renderer.get_tokenizer()
    prompt_token_ids = prompt["prompt_token_ids"]
    try:
        sp = beam_request_params(params, tokenizer.eos_token_id, len(prompt_token_ids),
                                 cfg.model_config.max_model_len, width, temperature=0.0,
                                 stops=getattr(params, STOPS_ATTR, None),
                                 slot_len=dcfg.slot_len(cfg.model_config.max_model_len),
                                 structured=getattr(params, STRUCTURED_ATTR, None))
    except ValueError as e:
        raise _validation_error(str(e)) from e
    sp.output_kind = RequestOutputKind.FINAL_ONLY
    engine_prompt = BeamSearchSequence(orig_prompt=prompt, tokens=list(prompt_token_ids), logprobs=[],
                                       lora_request=lora_request).get_prompt()
    final = None
    async for res in serving.engine_client.generate(engine_prompt, sp, f"{request_id}-{random_uuid()}-dsbd-beam",
                                                    lora_request=lora_request, trace_headers=trace_headers):
        final = res
    if final is None:
        raise RuntimeError(f"DSBD beam request for {request_id} returned no output")
    if final.outputs and final.outputs[0].finish_reason == "error":  # as the original: an error output, then stop
        yield RequestOutput(request_id=request_id, prompt=prompt.get("prompt"),
                            outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                                      logprobs=None, finish_reason="error")],
                            finished=True, prompt_token_ids=prompt_token_ids, prompt_logprobs=None)
        return
    yield beam_request_output(prompt, request_id, final, tokenizer, params)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def beam_search(self, prompt, request_id, params, lora_request=None, trace_headers=None):
            cfg = self.engine_client.vllm_config
            if not uses_dsbd(cfg):
                return orig(self, prompt, request_id, params, lora_request, trace_headers)
            return _dsbd_beam_search(self, cfg, prompt, request_id, params, lora_request, trace_headers)

        return beam_search

    wrap_method(PATCH_ID, mod.BeamSearchOnlineMixin, "beam_search", make)
