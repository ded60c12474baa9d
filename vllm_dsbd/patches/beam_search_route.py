"""Patch: ``LLM.beam_search`` on a DSBD engine runs inside the engine, one request per prompt.

vLLM's ``LLM.beam_search`` (``entrypoints/generate/beam_search/offline.py``) is a front-end loop: per token, one new
engine request per live beam, each a prefill of prompt + beam (prefix caching turns most of it into cache hits).
On a DSBD engine the same call sends one request per prompt with ``extra_args["dsbd_beam"]`` (width, max_tokens,
length_penalty, ignore_eos, the tokenizer's EOS): the DSBD runner keeps the W beams of the request as a trie in the
request's own KV slots (``engine/beams/``), batched with every other request, and the scheduler (patch
``beam_scheduler``) returns the finished beams in ``RequestOutput.kv_transfer_params``; here they become vLLM's
``BeamSearchOutput`` (the same fields: prompt + generated tokens, text of prompt + generated, cumulative
log-probability, per-token logprobs: at each position the 2W best tokens of the row the token was chosen from, with
their ranks, as vLLM's loop returns the candidates it saw; finish reason). The beams are those of vLLM's loop token
for token (tests/engine/test_engine_beams.py) at every temperature: vLLM's loop ranks the raw log-probabilities its
one-token requests return (``logprobs_mode`` "raw_logprobs", v1/sample/sampler.py:80-93), which the temperature does
not change, so the engine request runs at temperature 0 whatever ``BeamSearchParams.temperature`` says. It ranks
each step's candidates as vLLM's offline loop sorts them (``rank_by_score``: by ``get_beam_search_score``, which
differs from the cumulative log-probability for an EOS candidate kept with ``ignore_eos``). Beam sampling
(temperature > 0) is only asked for explicitly, with ``extra_args["dsbd_beam"]`` on a ``SamplingParams``
(``beam_request_params`` with its ``temperature`` left to the params' own builds such a request).

``BeamSearchParams.structured_outputs`` go on the engine request: its beams follow the grammar as vLLM's loop's do
(``engine/beams/grammar.py``; the grammar compiled by the backend vLLM's front end picks for the request).

Refused with a ``ValueError`` naming the parameter: a beam width above the engine's ``max_beam_width`` (64 by
default, whatever the plain requests' ``width``), a beam longer than
``max_model_len`` (prompt + max_tokens: its positions), and a request whose trie may not fit the engine's KV slots
per request
(``prompt + max_tokens * (beam_width + 1) + 2`` slots, ``BeamParams.engine_tokens``, against
``DSBDConfig.slot_len``: ``max_model_len``, or ``max_beam_slots`` when larger).

When it can go: vLLM's ``LLM.beam_search`` runs in the engine and lets a speculative method serve it.
"""

from __future__ import annotations

import gc
import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "beam_search_route"
MODULE = "vllm.entrypoints.generate.beam_search.offline"


def apply() -> None:
    when_imported(MODULE, _patch)


def beam_request_params(params, eos_token_id, prompt_len: int, max_model_len: int, max_width: int,
                        temperature: float | None = None, rank_by_score: bool = False, stops: dict | None = None,
                        slot_len: int | None = None, structured=None):
    """The engine request's ``SamplingParams`` for one prompt of a beam search (``ValueError`` on a bad request).

    ``temperature``: the engine request's; None takes ``params.temperature`` (above 0: beam sampling, the explicit
    ``dsbd_beam`` route). The ``LLM.beam_search`` and ``use_beam_search`` routes pass 0: vLLM's beam search ranks
    raw log-probabilities at every temperature. ``rank_by_score``: ``BeamParams.rank_by_score``, how the
    ``LLM.beam_search`` route ranks (vLLM's offline loop sorts candidates by the length-normalised score, its server
    loop by cumulative log-probability). ``stops``: ``dsbd_beam`` stop keys (``stop``, ``stop_token_ids``; the
    ``use_beam_search`` route's, from the OpenAI request), with ``params.include_stop_str_in_output``. ``slot_len``:
    the engine's KV slots per request (``DSBDConfig.slot_len``; None: ``max_model_len``).
    ``structured``: the ``StructuredOutputsParams`` of the beams (None: ``params.structured_outputs``; the
    ``use_beam_search`` route passes the OpenAI request's ``response_format`` / ``structured_outputs``), set on the
    engine request: its beams follow the grammar as vLLM's ``LLM.beam_search`` does (``engine/beams/grammar.py``)."""
    from vllm.sampling_params import SamplingParams

    from vllm_dsbd.requests import BEAM_KEY, BeamParams

    bp = BeamParams.parse({"width": params.beam_width, "max_tokens": params.max_tokens,
                           "length_penalty": params.length_penalty, "ignore_eos": params.ignore_eos,
                           "eos_token_id": eos_token_id, "rank_by_score": rank_by_score, **(stops or {}),
                           "include_stop_str_in_output": bool(getattr(params, "include_stop_str_in_output", False))},
                          max_width)
    if prompt_len + bp.max_tokens > max_model_len:
        raise ValueError(f"max_tokens: a beam of {bp.max_tokens} tokens after the {prompt_len}-token prompt is longer "
                         f"than max_model_len {max_model_len}; lower max_tokens or raise max_model_len")
    slot_len = max_model_len if slot_len is None else slot_len
    if prompt_len + bp.engine_tokens() > slot_len:
        where = (f"max_model_len {max_model_len}" if slot_len <= max_model_len
                 else f"the engine's {slot_len} KV slots per beam request (max_beam_slots)")
        room = slot_len - prompt_len - 2  # BeamParams.engine_tokens: max_tokens * (width + 1) + 2
        fits = (f"up to {room // (bp.width + 1)} tokens fit at width {bp.width}"
                + (f", width {room // bp.max_tokens - 1} at {bp.max_tokens} tokens" if room // bp.max_tokens >= 2
                   else "")) if room > bp.width else "nothing fits"
        raise ValueError(f"max_tokens: a beam search of width {bp.width} and {bp.max_tokens} tokens may hold "
                         f"{bp.engine_tokens()} slots after the {prompt_len}-token prompt, more than {where} ({fits}); "
                         "lower max_tokens or beam_width, or start the engine with a larger 'max_beam_slots' in "
                         "--speculative-config (KV slots per beam request, beyond max_model_len)")
    if temperature is None:
        temperature = params.temperature
    return SamplingParams(temperature=temperature, max_tokens=bp.engine_tokens(), ignore_eos=True,
                          detokenize=False, skip_clone=True, extra_args={BEAM_KEY: bp.to_dict()},
                          structured_outputs=structured if structured is not None
                          else getattr(params, "structured_outputs", None))


def finished_beams(out) -> list[dict]:
    """The beams a finished DSBD beam request carries (``kv_transfer_params["dsbd_beam"]``, best first)."""
    from vllm_dsbd.requests import BEAM_KEY

    params = out.kv_transfer_params or {}
    if BEAM_KEY not in params:
        raise RuntimeError(f"DSBD beam request {out.request_id} finished without beams (finish reason "
                           f"{out.outputs[0].finish_reason if out.outputs else None!r})")
    return params[BEAM_KEY]


def beam_outputs(engine_input, out, tokenizer):
    """vLLM's ``BeamSearchOutput`` from a finished beam request's ``RequestOutput``."""
    from vllm.entrypoints.generate.beam_search.utils import BeamSearchOutput, BeamSearchSequence
    from vllm.logprobs import Logprob

    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    beams = finished_beams(out)
    # each token id is decoded once (a token's text does not depend on the others here: convert_ids_list_to_tokens
    # decodes them one by one), and tokens chosen from the same row share its list of alternatives (the payload lists
    # a row once) and so its dict, as vLLM's loop shares a parent beam's dicts with its children: output building is
    # not 2W decodes per beam per token
    tops = {id(top): top for b in beams for top in (b.get("top_logprobs") or ()) if top}  # shared lists once
    ids_seen = {int(i) for top in tops.values() for i, _ in top}
    ids_seen = sorted(ids_seen)
    names = dict(zip(ids_seen, convert_ids_list_to_tokens(tokenizer, ids_seen)))
    made: dict[int, dict] = {}

    def position(t: int, lp: float, top) -> dict:
        if not top:  # not known (T > 0): the chosen token alone
            return {t: Logprob(logprob=lp)}
        d = made.get(id(top))  # the row's 2W best, whichever of them was chosen
        if d is None:
            d = made[id(top)] = {int(i): Logprob(logprob=v, rank=r + 1, decoded_token=names[int(i)])
                                 for r, (i, v) in enumerate(top)}
        return d

    prompt = list(engine_input["prompt_token_ids"])
    seqs = []
    # W x tokens x 2W acyclic objects: the cyclic collector would rescan the heap many times while they are made
    was = gc.isenabled()
    gc.disable()
    try:
        for b in beams:
            seqs.append(_sequence(engine_input, prompt, b, position, tokenizer, BeamSearchSequence))
    finally:
        if was:
            gc.enable()
    return BeamSearchOutput(sequences=seqs)


def _sequence(engine_input, prompt, b, position, tokenizer, BeamSearchSequence):
    """One returned beam as vLLM's ``BeamSearchSequence``."""
    tokens = prompt + list(b["token_ids"])
    tops = b.get("top_logprobs") or [None] * len(b["token_ids"])
    return BeamSearchSequence(
        orig_prompt=engine_input, tokens=tokens,
        logprobs=[position(t, lp, top) for t, lp, top in zip(b["token_ids"], b["logprobs"], tops)],
        cum_logprob=b["cum_logprob"], text=tokenizer.decode(tokens), finish_reason=b["finish_reason"])


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None):
            cfg = self.llm_engine.vllm_config
            if not uses_dsbd(cfg):
                return orig(self, prompts, params, lora_request, use_tqdm, concurrency_limit)
            from vllm_dsbd.config import DSBDConfig

            dcfg = DSBDConfig.from_vllm_config(cfg)
            width, max_model_len = dcfg.max_beam_width, cfg.model_config.max_model_len
            tokenizer = self.renderer.get_tokenizer()
            inputs = self._preprocess_cmpl(prompts)
            sps = []
            for inp in inputs:
                if inp.get("type") != "token":
                    raise ValueError("prompts: only text and token prompts are supported for beam search on a "
                                     "DSBD engine")
                sps.append(beam_request_params(params, tokenizer.eos_token_id, len(inp["prompt_token_ids"]),
                                               max_model_len, width, temperature=0.0, rank_by_score=True,
                                               slot_len=dcfg.slot_len(max_model_len)))
            outs = self.generate([{"prompt_token_ids": list(inp["prompt_token_ids"])} for inp in inputs], sps,
                                 use_tqdm=use_tqdm, lora_request=lora_request)
            return [beam_outputs(inp, out, tokenizer) for inp, out in zip(inputs, outs)]

        return beam_search

    wrap_method(PATCH_ID, mod.BeamSearchOfflineMixin, "beam_search", make)
