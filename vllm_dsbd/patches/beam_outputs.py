"""Patch: the front end of a plain beam request (``extra_args["dsbd_beam"]`` on ``generate``): its logprobs and the
text of a best beam stopped by a stop string.

On ``vllm.v1.engine.output_processor`` (ledger entry 21 in ``patches/__init__.py``):

* ``LogprobsProcessor``: a beam request's output tokens are its beams' settled prefix, then the rest of the best beam
  (patch ``beam_scheduler``), not the rows the runner sampled, so the logprobs vLLM slices for it from those rows
  are not its tokens'; when the request finishes (its ``kv_transfer_params["dsbd_beam"]`` arrive, from a DSBD engine
  only) its logprobs are replaced by the best beam's, in vLLM's shape: per token a dict with the chosen token first (its rank among the row's best) and the
  ``logprobs`` best tokens of the row it was chosen from (ranks 1..k; the 2W best are known at T = 0, the chosen
  token alone at T > 0: ``requests.check_beam_logprobs``), and ``cumulative_logprob`` the best beam's. A
  CUMULATIVE request's intermediate outputs carry vLLM's own logprobs of the settled tokens (rows the runner
  sampled); its final output carries the beams'. Streamed (DELTA) requests with logprobs are refused.

* ``RequestState.make_request_output``: when the request finishes and its best beam stopped on a stop string (the
  beams' ``stop_reason`` in ``kv_transfer_params["dsbd_beam"]``), the detokenized text is cut at the string's first
  occurrence, as vLLM cuts a plain request's (``stops.cut_at_stop``; kept with the beam's
  ``include_stop_str_in_output``), and the output's ``stop_reason`` is the string (a stop token id's: the id). vLLM's
  detokenizer leaves the last token of a request finished as "stop" undecoded (a stop token's text), which a stop
  string's last token is not: it is decoded here first. The final text of a FINAL_ONLY or
  CUMULATIVE request is cut; a streamed request's text holds back the last (longest stop string - 1) characters
  until it finishes, as vLLM's detokenizer does for a plain request's stop strings (the settled prefix never holds a
  whole stop string, at most its start), so streamed text is never retracted.

When it can go: with ``beam_scheduler`` (vLLM gains in-engine beams with their own outputs).
"""

from __future__ import annotations

import json
import types

from vllm_dsbd.patches._patching import when_imported, wrap_method

BEAM_KEY = "dsbd_beam"
_ATTR = "_dsbd_beam"  # the request's dsbd_beam settings, on its LogprobsProcessor (a dict)
PATCH_ID = "beam_outputs"
MODULE = "vllm.v1.engine.output_processor"


def apply() -> None:
    when_imported(MODULE, patch_output_processor)


def _beam_settings(request) -> dict | None:
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) or {}
    value = extra.get(BEAM_KEY)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def position_logprobs(token: int, logprob: float, top, k: int) -> tuple[list[int], list[float], int]:
    """(token ids, log-probabilities, rank of the chosen token) of one position, as vLLM's sampler gives them: the
    chosen token first, then the ``k`` best of its row (``top``: (token, log-probability) best first, or None)."""
    top = [(int(t), float(v)) for t, v in (top or ())]
    rank = next((r + 1 for r, (t, _) in enumerate(top) if t == token), len(top) + 1)
    return [int(token)] + [t for t, _ in top[:k]], [float(logprob)] + [v for _, v in top[:k]], rank


def best_beam_logprobs(proc, beam: dict) -> None:
    """Makes ``proc`` (a ``LogprobsProcessor``) hold ``beam``'s per-token logprobs and cumulative log-probability."""
    from vllm.logprobs import append_logprobs_for_next_position
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    k = proc.num_logprobs
    out = type(proc.logprobs)() if proc.logprobs is not None else []
    tops = beam.get("top_logprobs") or [None] * len(beam["token_ids"])
    for token, lp, top in zip(beam["token_ids"], beam["logprobs"], tops):
        ids, lps, rank = position_logprobs(token, lp, top, k)
        if proc.tokenizer is None:
            names = [None] * len(ids)
        else:
            names = proc._verify_tokens(decoded_tokens_list=convert_ids_list_to_tokens(proc.tokenizer, ids),
                                        tokens=ids, context_token_ids=proc._get_sampled_context_ids(out))
        append_logprobs_for_next_position(out, ids, lps, names, rank, k)
    proc.logprobs = out
    proc.cumulative_logprob = float(beam["cum_logprob"])


def patch_output_processor(mod: types.ModuleType) -> None:
    procs = mod.LogprobsProcessor

    def make_new(orig):
        def from_new_request(cls, *args, **kwargs):
            proc = orig(cls, *args, **kwargs)
            request = kwargs.get("request", args[-1] if args else None)
            setattr(proc, _ATTR, _beam_settings(request))
            return proc

        return from_new_request

    def make_update(orig):
        def update_from_output(self, output):
            orig(self, output)
            # only a DSBD engine's finished beam request carries its beams (plain engines: untouched)
            beams = (output.kv_transfer_params or {}).get(BEAM_KEY) if getattr(self, _ATTR, None) else None
            if beams and self.num_logprobs is not None:
                best_beam_logprobs(self, beams[0])

        return update_from_output

    def make_output(orig):
        def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs):
            kv = args[0] if args else kwargs.get("kv_transfer_params")
            settings = getattr(self.logprobs_processor, _ATTR, None)
            beams = (kv or {}).get(BEAM_KEY) if settings and finish_reason is not None else None
            stop = beams[0].get("stop_reason") if beams else None
            det = self.detokenizer
            strings = settings.get("stop") if settings else None
            if strings and not settings.get("include_stop_str_in_output") and getattr(det, "stop_buffer_length", 1) == 0:
                # hold back the text a stop string's start may be, as vLLM does for a plain request's stop strings:
                # the settled prefix never holds a whole stop string, at most its first len - 1 characters
                strings = [strings] if isinstance(strings, str) else strings
                det.stop_buffer_length = max(len(x) for x in strings) - 1
            if isinstance(stop, str) and isinstance(getattr(det, "output_text", None), str):
                from vllm.v1.engine import FinishReason

                from vllm_dsbd.engine.beams.stops import cut_at_stop

                if finish_reason == FinishReason.STOP and not det.include_stop_str_in_output and det.token_ids:
                    # vLLM's detokenizer left a stop-finished request's last token undecoded (a stop token's text);
                    # a stop string's last token is an ordinary one: decode it where the stream left off
                    det.output_text += det.decode_next(det.token_ids[-1])
                det.output_text = cut_at_stop(det.output_text, stop, bool(settings.get("include_stop_str_in_output")))
                stop_reason = stop
            elif isinstance(stop, int) and stop in (settings.get("stop_token_ids") or ()):
                stop_reason = stop  # a stop token id: vLLM's stop_reason for a plain request
            return orig(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)

        return make_request_output

    wrap_method(PATCH_ID, procs, "from_new_request", make_new)  # a classmethod (kept one)
    wrap_method(PATCH_ID, procs, "update_from_output", make_update)
    wrap_method(PATCH_ID, mod.RequestState, "make_request_output", make_output)
