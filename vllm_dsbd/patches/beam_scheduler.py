"""Patch: vLLM's scheduler serves DSBD beam requests (``extra_args["dsbd_beam"]``, ``engine/beams/``).

A beam request's tokens in vLLM are ``prompt + trie nodes``: vLLM neither knows when its beam search is over nor may
cache its trie blocks for other requests, and must not output the trie's slots as the request's tokens. Three changes
to ``vllm.v1.core.sched.scheduler.Scheduler``, all inert for any request without ``dsbd_beam`` and for every non-DSBD
engine (whose requests may carry ``dsbd_*`` keys: patch ``request_validation`` refuses them only on DSBD engines, and
the runner of other engines ignores them):

* ``_update_request_with_output``: a beam request the DSBD runner finished this step (``ModelRunnerOutput
  .dsbd_finished``, which ``update_from_output`` keeps on the scheduler while it runs, see patch
  ``spec_stats_depths``) stops, as a stop token would stop it, with its best beam's finish reason ("stop" or
  "length"). vLLM appends the step's trie tokens to the request as ever (its token list stays the trie), but the new
  tokens it outputs for a beam request (``EngineCoreOutput.new_token_ids``, the only tokens the front end sees, in or
  across processes) are the ones the runner settled this step (``ModelRunnerOutput.dsbd_settled``,
  ``BeamRequest.settle``): the beams' common prefix while they run, never retracted, and at the finish the rest of the
  best beam. So a streamed beam request (``DELTA`` / ``CUMULATIVE``, or the server's ``"stream": true``) streams the
  settled prefix, and every beam request's final ``CompletionOutput`` is its best beam (tokens, text). Engine
  logprobs are refused for beam requests (``requests.check_request``): vLLM slices them by the number of tokens
  output, and those are not the step's sampled rows.
* ``_update_request_with_output`` also **shrinks** a beam request at a re-layout (``ModelRunnerOutput
  .dsbd_relayout``, ``BeamRequest._relayout``): after vLLM appended the step's row, the request's output tokens
  become the runner's new list (the beams' common prefix as linear context, then the trie without dead slots, up to
  its last token), its ``num_computed_tokens`` shrinks by as many tokens as the list lost (the runner moved the K/V of
  the kept slots there already), its block hashes past the first changed token are recomputed, and the KV blocks
  past the slots it uses (the list plus the forest the runner just drafted after it) go back to the pool. The runner
  does the same to its own copy of the tokens and its block table, so the next step's lengths and block tables
  agree; the list never outgrows what vLLM checked at admission.
* ``_update_request_with_output`` switches vLLM's token stops (EOS, ``stop_token_ids``) off for a beam request:
  they would look at trie slots (the generation config's extra EOS ids are ordinary beam tokens).
* ``_free_request``: that request's ``kv_transfer_params`` (the one per-request dict vLLM carries from the engine
  core to ``RequestOutput.kv_transfer_params`` in the front end, across processes) are its beams: the front end
  (patch ``beam_search_route``) turns them into vLLM's beam-search outputs. Requests with a KV connector's own params
  are never beam requests (a KV connector is refused for DSBD beams).
* ``__init__``: prefix caching commits a beam request's blocks only up to its prompt: trie blocks hold K/V computed
  under the trie's masks and positions, which another request with the same tokens must not be served.
* ``__init__`` also lifts the scheduler's and KV cache manager's per-request token bound from ``max_model_len`` to the
  engine's slot length (``DSBDConfig.slot_len``: ``max_beam_slots`` when larger), so a beam request's slots (every
  beam's tokens; its positions stay the true ones, at most prompt + max_tokens) do not count against the model's
  context length; it refuses to start when the KV pool cannot hold one request of that many slots. ``add_request``
  keeps every other request within ``max_model_len``: its ``max_tokens`` is cut to ``max_model_len - prompt``, where
  vLLM's own ``check_stop`` would have stopped it ("length"), so it stops at the same token with the same reason.
* ``__init__`` keeps a draft model's lookahead (KV slots vLLM reserves per running request for the draft's K/V) at a
  full forest step's slots (``DSBDConfig.forest_slots``), not vLLM's ``num_speculative_tokens``, which also covers the
  leaves of the widest beam request (``max_beam_width - 1``: scheduled tokens, which get their slots anyway).

When it can go: vLLM gains in-engine beam search with its own finish/output path (or lets a request finish from the
model runner, carry a payload and output other tokens than the ones it appends), a per-request cap on prefix-cache
commits and a per-request KV slot bound apart from the context length.
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "beam_scheduler"
MODULE = "vllm.v1.core.sched.scheduler"
BEAM_KEY = "dsbd_beam"


def is_beam_request(request) -> bool:
    sp = getattr(request, "sampling_params", None)
    return sp is not None and bool(sp.extra_args) and BEAM_KEY in sp.extra_args


def _finished_payload(scheduler, request):
    out = getattr(scheduler, "_dsbd_model_runner_output", None)
    done = getattr(out, "dsbd_finished", None)
    return done.get(request.request_id) if done else None


def _relayout_of(scheduler, request) -> tuple[list[int], int] | None:
    out = getattr(scheduler, "_dsbd_model_runner_output", None)
    relayout = getattr(out, "dsbd_relayout", None)
    return relayout.get(request.request_id) if relayout else None


def relayout(request, tokens: list[int], hash_block_size: int) -> None:
    """Makes ``tokens`` the request's output tokens (its list after the prompt), shrinking ``num_computed_tokens`` by
    the tokens the list lost and recomputing the block hashes from the first changed token on."""
    out = request._output_token_ids
    same = 0
    n = min(len(out), len(tokens))
    while same < n and out[same] == tokens[same]:
        same += 1
    old = request.num_tokens
    P = request.num_prompt_tokens
    del out[same:]
    out.extend(tokens[same:])
    del request._all_token_ids[P + same:]
    request._all_token_ids.extend(tokens[same:])
    request.num_computed_tokens -= old - request.num_tokens
    del request.block_hashes[(P + same) // hash_block_size:]
    request.update_block_hashes()


def free_tail_blocks(kv_cache_manager, request_id: str, used_slots: int) -> None:
    """Hands back to the pool a request's KV blocks past its first ``used_slots`` slots, in every KV-cache group (the
    runner cuts its block table the same way: ``engine/runner.py`` ``_relayout_requests``). Only blocks past the
    prompt can go, and those are never cached (``__init__`` below), so no other request holds them."""
    for mgr in kv_cache_manager.coordinator.single_type_managers:
        blocks = mgr.req_to_blocks.get(request_id)
        keep = -(-used_slots // mgr.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            mgr.block_pool.free_blocks(reversed(tail))


def ignore_token_stops(sp) -> None:
    """vLLM's stop on EOS and on ``stop_token_ids`` (``check_stop``) looks at the tokens it appends, which for a beam
    request are trie slots, not a sequence: off for it (the engine's copy of its ``SamplingParams``). A beam's own EOS
    never enters the trie (it finishes the beam), but a request that does not ignore EOS gets the generation config's
    other EOS ids as ``stop_token_ids`` (``SamplingParams.update_from_generation_config``), which are ordinary trie
    tokens; user-given ``stop_token_ids`` are refused in the front end (``requests.check_request``)."""
    sp._eos_token_id = None
    if sp.stop_token_ids:
        sp.stop_token_ids = []


def _settled_tokens(scheduler, request) -> list[int]:
    out = getattr(scheduler, "_dsbd_model_runner_output", None)
    settled = getattr(out, "dsbd_settled", None)
    return list(settled.get(request.request_id, ())) if settled else []


def keep_context_len(request, max_model_len: int) -> None:
    """A request that is not a beam request stops at ``max_model_len`` tokens on an engine whose slot length is
    larger: its ``max_tokens`` is cut to ``max_model_len - prompt`` (vLLM's ``check_stop`` stops it there, "length",
    as the context-length bound would)."""
    room = max_model_len - request.num_prompt_tokens
    if request.max_tokens > room:
        request.max_tokens = max(room, 1)


def lift_slot_len(scheduler) -> None:
    """The scheduler's and KV cache manager's per-request token bound becomes the engine's slot length
    (``DSBDConfig.slot_len``); ``ValueError`` when the KV pool cannot hold one request of that many slots."""
    from vllm_dsbd.config import DSBDConfig

    cfg = scheduler.vllm_config
    max_model_len = cfg.model_config.max_model_len
    slot_len = DSBDConfig.from_vllm_config(cfg).slot_len(max_model_len)
    if slot_len <= max_model_len:
        return
    kv = scheduler.kv_cache_manager
    free = kv.block_pool.get_num_free_blocks()
    for mgr in kv.coordinator.single_type_managers:
        need = -(-slot_len // mgr.block_size)
        if need > free:
            raise ValueError(f"DSBD config: 'max_beam_slots' = {slot_len} needs {need} KV blocks of {mgr.block_size} "
                             f"tokens for one beam request, and the KV cache holds {free}; lower 'max_beam_slots' or "
                             "give the KV cache more memory (--kv-cache-memory / --gpu-memory-utilization)")
    scheduler.max_model_len = slot_len
    kv.max_model_len = slot_len
    kv.coordinator.max_model_len = slot_len


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    from vllm.v1.request import RequestStatus

    def make_update(orig):
        def _update_request_with_output(self, request, new_token_ids):
            beam = getattr(self, "_dsbd_engine", False) and is_beam_request(request)
            if beam:
                ignore_token_stops(request.sampling_params)
            new_token_ids, stopped = orig(self, request, new_token_ids)
            if not beam:
                return new_token_ids, stopped
            payload = _finished_payload(self, request)
            if not stopped and payload is not None:
                beams = payload.get(BEAM_KEY) or [{}]
                length = beams[0].get("finish_reason") == "length"
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED if length else RequestStatus.FINISHED_STOPPED
                stopped = True
            elif not stopped and (new := _relayout_of(self, request)) is not None:
                tokens, used_slots = new
                relayout(request, tokens, self.hash_block_size)
                free_tail_blocks(self.kv_cache_manager, request.request_id, used_slots)
            # the request's output: the tokens its beams settled, not the trie slots vLLM appended
            return _settled_tokens(self, request), stopped

        return _update_request_with_output

    def make_free(orig):
        def _free_request(self, request, *args, **kwargs):
            kv_params, ec_params = orig(self, request, *args, **kwargs)
            payload = _finished_payload(self, request)
            if payload is not None:
                kv_params = dict(kv_params or {}, **payload)
            return kv_params, ec_params

        return _free_request

    def make_init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            self._dsbd_engine = uses_dsbd(self.vllm_config)
            if not self._dsbd_engine:
                return
            coordinator = self.kv_cache_manager.coordinator
            cache_blocks = coordinator.cache_blocks

            def cache_prompt_blocks_only(request, num_tokens):
                if is_beam_request(request):
                    num_tokens = min(num_tokens, request.num_prompt_tokens)
                return cache_blocks(request, num_tokens)

            coordinator.cache_blocks = cache_prompt_blocks_only
            lift_slot_len(self)
            if self.num_lookahead_tokens:  # a draft model writes a forest's K/V ahead: a full forest step's slots,
                # not the leaves of the widest beam request (max_beam_width - 1), which are scheduled tokens
                from vllm_dsbd.config import DSBDConfig

                self.num_lookahead_tokens = min(self.num_lookahead_tokens,
                                                DSBDConfig.from_vllm_config(self.vllm_config).forest_slots)

        return __init__

    def make_add(orig):
        def add_request(self, request):
            if getattr(self, "_dsbd_engine", False) and not is_beam_request(request) \
                    and getattr(request, "sampling_params", None) is not None:
                keep_context_len(request, self.vllm_config.model_config.max_model_len)
            return orig(self, request)

        return add_request

    wrap_method(PATCH_ID, mod.Scheduler, "_update_request_with_output", make_update)
    wrap_method(PATCH_ID, mod.Scheduler, "_free_request", make_free)
    wrap_method(PATCH_ID, mod.Scheduler, "__init__", make_init)
    wrap_method(PATCH_ID, mod.Scheduler, "add_request", make_add)
