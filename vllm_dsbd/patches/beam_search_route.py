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

Refused with a ``ValueError`` naming the parameter: a beam width above the engine's DSBD width, and a request whose
trie may not fit ``max_model_len`` (``prompt + max_tokens * (beam_width + 1) + 2`` slots; see
``BeamParams.engine_tokens``).

When it can go: vLLM's ``LLM.beam_search`` runs in the engine and lets a speculative method serve it.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "beam_search_route"
MODULE = "vllm.entrypoints.generate.beam_search.offline"


def apply() -> None:
    when_imported(MODULE, _patch)


def beam_request_params(params, eos_token_id, prompt_len: int, max_model_len: int, max_width: int,
                        temperature: float | None = None, rank_by_score: bool = False, stops: dict | None = None,
                        structured=None):
    """The engine request's ``SamplingParams`` for one prompt of a beam search (``ValueError`` on a bad request).

    ``temperature``: the engine request's; None takes ``params.temperature`` (above 0: beam sampling, the explicit
    ``dsbd_beam`` route). The ``LLM.beam_search`` and ``use_beam_search`` routes pass 0: vLLM's beam search ranks
    raw log-probabilities at every temperature. ``rank_by_score``: ``BeamParams.rank_by_score``, how the
    ``LLM.beam_search`` route ranks (vLLM's offline loop sorts candidates by the length-normalised score, its server
    loop by cumulative log-probability). ``stops``: ``dsbd_beam`` stop keys (``stop``, ``stop_token_ids``; the
    ``use_beam_search`` route's, from the OpenAI request), with ``params.include_stop_str_in_output``.
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
    need = prompt_len + bp.engine_tokens()
    if need > max_model_len:
        raise ValueError(f"max_tokens: a beam search of width {bp.width} and {bp.max_tokens} tokens may hold "
                         f"{bp.engine_tokens()} slots after the {prompt_len}-token prompt, more than max_model_len "
                         f"{max_model_len}; lower max_tokens or beam_width, or raise max_model_len")
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

    def position(t: int, lp: float, top) -> dict:
        if not top:  # not known (T > 0): the chosen token alone
            return {t: Logprob(logprob=lp)}
        ids = [int(i) for i, _ in top]
        names = convert_ids_list_to_tokens(tokenizer, ids)
        return {i: Logprob(logprob=v, rank=r + 1, decoded_token=n) for r, (i, (_, v), n) in
                enumerate(zip(ids, top, names))}

    prompt = list(engine_input["prompt_token_ids"])
    seqs = []
    for b in finished_beams(out):
        tokens = prompt + list(b["token_ids"])
        tops = b.get("top_logprobs") or [None] * len(b["token_ids"])
        seqs.append(BeamSearchSequence(
            orig_prompt=engine_input, tokens=tokens,
            logprobs=[position(t, lp, top) for t, lp, top in zip(b["token_ids"], b["logprobs"], tops)],
            cum_logprob=b["cum_logprob"], text=tokenizer.decode(tokens), finish_reason=b["finish_reason"]))
    return BeamSearchOutput(sequences=seqs)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None):
            cfg = self.llm_engine.vllm_config
            if not uses_dsbd(cfg):
                return orig(self, prompts, params, lora_request, use_tqdm, concurrency_limit)
            from vllm_dsbd.config import DSBDConfig

            width = DSBDConfig.from_vllm_config(cfg).width
            tokenizer = self.renderer.get_tokenizer()
            inputs = self._preprocess_cmpl(prompts)
            sps = []
            for inp in inputs:
                if inp.get("type") != "token":
                    raise ValueError("prompts: only text and token prompts are supported for beam search on a "
                                     "DSBD engine")
                sps.append(beam_request_params(params, tokenizer.eos_token_id, len(inp["prompt_token_ids"]),
                                               cfg.model_config.max_model_len, width, temperature=0.0,
                                               rank_by_score=True))
            outs = self.generate([{"prompt_token_ids": list(inp["prompt_token_ids"])} for inp in inputs], sps,
                                 use_tqdm=use_tqdm, lora_request=lora_request)
            return [beam_outputs(inp, out, tokenizer) for inp, out in zip(inputs, outs)]

        return beam_search

    wrap_method(PATCH_ID, mod.BeamSearchOfflineMixin, "beam_search", make)
