"""Stop token ids and stop strings of one beam request (``extra_args["dsbd_beam"]``: ``stop_token_ids``, ``stop``).

A beam whose new token is a stop token id, or whose generated text now contains a stop string, becomes a finished
hypothesis and leaves the live beams: the rule of EOS in vLLM's beam search loop and in HF's (``BeamSearchScorer``
treats every id of ``eos_token_id`` alike), applied to every candidate of a step (the 2W best tokens of each live
beam's row, as EOS is). A stop token id counts as EOS does everywhere (the finished beam ends with it; its score's
length leaves it out); a stop string's last token is an ordinary token of the beam (its length counts it).

Stop strings are checked on the new tail only: the generated tokens of the beam's last ``window`` tokens plus the
candidate, decoded (``window`` = the longest stop string's length in characters + 1: every token but a partial UTF-8
byte decodes to at least one character, so a stop string completed by the candidate lies in that tail). A match that
the tail would have had without the candidate cannot be there (the beam would have finished then), so a match in the
tail is a new one. This module imports no vLLM: the tokenizer is handed in (its ``decode``).
"""
from __future__ import annotations

from typing import Callable, Sequence


class StopRule:
    """What finishes a beam besides EOS and ``max_tokens``: ``check(tail, token)`` -> the stop reason or None."""

    def __init__(self, stop_token_ids: Sequence[int], stop: Sequence[str],
                 decode: Callable[[list[int]], str] | None):
        if stop and decode is None:
            raise ValueError("stop strings on a beam request need the model's tokenizer (not loaded)")
        self.ids = frozenset(int(t) for t in stop_token_ids)
        self.strings = tuple(stop)
        self.decode = decode
        self.window = max((len(s) for s in self.strings), default=0) + 1  # generated tokens before the candidate

    def __bool__(self) -> bool:
        return bool(self.ids or self.strings)

    def check(self, tail: Callable[[int], list[int]], token: int) -> int | str | None:
        """The stop reason of a beam extended by ``token`` (the id, or the stop string matched first in the tail);
        None when it goes on. ``tail(k)``: the beam's last (up to) ``k`` generated tokens before ``token``."""
        if token in self.ids:
            return token
        if not self.strings:
            return None
        text = self.decode(tail(self.window) + [token])
        hits = [(text.find(s), k) for k, s in enumerate(self.strings) if s in text]
        return self.strings[min(hits)[1]] if hits else None


def cut_at_stop(text: str, stop: str, include: bool) -> str:
    """A finished beam's text cut at its stop string's first occurrence (vLLM's rule for stop strings): up to the
    string's start, or its end with ``include_stop_str_in_output``."""
    at = text.find(stop)
    if at < 0:
        return text
    return text[: at + len(stop)] if include else text[:at]
