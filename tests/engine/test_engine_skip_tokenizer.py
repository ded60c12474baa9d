"""A DSBD engine without a tokenizer (``skip_tokenizer_init=True``) refuses a beam request's ``stop`` strings and keeps
serving (they used to raise inside the beam step, ``engine/state.py``, and kill the engine core: finding 3 of the
2026-12-06 audit).

Real vLLM 0.26.0 on CPU, the tiny random Llama pair with its draft (width 4, depth 2), token-id prompts, no
detokenisation: a beam request with ``dsbd_beam`` ``stop`` strings is a ``ValueError`` naming the field
(``requests.RequestLimits.tokenizer``); then a beam request with ``stop_token_ids`` and a plain request are served.
"""
from __future__ import annotations

import pytest

from engine_utils import dsbd_llm, tiny_pair  # the CPU engine environment, before vllm
import vllm  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def _beam(**fields) -> vllm.SamplingParams:
    return vllm.SamplingParams(temperature=0, max_tokens=3 * 3 + 2, ignore_eos=True, detokenize=False,
                               extra_args={"dsbd_beam": {"width": 2, "max_tokens": 3, **fields}})


def test_beam_stop_strings_refused_without_tokenizer():
    target, draft = tiny_pair()
    with dsbd_llm(target, max_num_seqs=4, skip_tokenizer_init=True,
                  speculative_config={"method": "dsbd", "model": str(draft), "width": 4,
                                      "num_speculative_tokens": 2}) as llm:
        with pytest.raises(ValueError, match=r"^extra_args\['dsbd_beam'\]\['stop'\]: stop strings need the model's "
                                             r"tokenizer"):
            llm.generate([PROMPT], _beam(stop=["ab"]), use_tqdm=False)
        beam = llm.generate([PROMPT], _beam(stop_token_ids=[166]), use_tqdm=False)[0]
        plain = llm.generate([PROMPT], vllm.SamplingParams(temperature=0, max_tokens=3, detokenize=False),
                             use_tqdm=False)[0]
    assert len(beam.kv_transfer_params["dsbd_beam"]) == 2
    assert len(plain.outputs[0].token_ids) == 3
