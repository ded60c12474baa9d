"""The DSBD engine inside vLLM 0.26.0: plain requests verified against draft forests, and beam requests (beam search
and beam sampling) whose beams live inside the engine, with or without a draft model.

Following one request from the plugin to the kernels:

* ``vllm_dsbd.plugin.register()`` applies the patches; ``dsbd_knobs`` turns ``speculative_config={"method": "dsbd",
  "model": DRAFT, "num_speculative_tokens": G, "width": W}`` into vLLM's draft-model configuration with
  ``num_speculative_tokens = W * G + W - 1`` (one scheduler slot per forest node, plus a beam request's W - 1
  leaves) and ``additional_config["dsbd"]`` (without ``model``: an engine without a draft model, ``max(1, W - 1)``
  slots, :class:`.drafter.NoDrafter`);
  ``dsbd_worker`` makes the engine's workers :mod:`.worker`'s, which build :mod:`.runner`'s DSBD runner.
* :mod:`.runner` (``DSBDRunnerMixin``) hooks the five places of an engine step: request states (:mod:`.state`),
  positions and the forest attention batch of the target pass, the forward pass under forest attention
  (:mod:`.attention`), verification instead of rejection sampling (:mod:`.sampler`, over ``core.verify_forest``;
  on a device the host-read-free ``core.verify_static`` / ``core.chain_static``)
  followed by the KV commit (:mod:`.kv`), and the next forests (:mod:`.drafter`, over ``core.beam_step``).
* :mod:`.attention` and :mod:`.kv` call ``dsbd_kernels`` (forest attention, KV commit): their torch references on CPU.
* :mod:`.beams`: beam requests (``extra_args["dsbd_beam"]``, parsed by ``vllm_dsbd.requests``, or
  ``LLM.beam_search`` / OpenAI ``use_beam_search`` through patches ``beam_search_route`` / ``beam_serving_route``):
  the W beams of one vLLM request as a trie in its own KV slots (:mod:`.beams.trie`), stepped by the runner
  (:mod:`.beams.step`: vLLM's beam search at T = 0 from each row's best tokens, beam sampling at T > 0 on the device
  for all beam requests of a step: :mod:`.beams.sampling`), drafted by :mod:`.beams.drafter`; patch
  ``beam_scheduler`` finishes the request and carries the beams to the front end.
* :mod:`.reads`: the readers protocol: code that reads the device yields the tensors it needs and gets their host
  copies back, so that a step's kinds of work share one copy per round.
* :mod:`.metrics`: layers passed per iteration and width per layer; beam passes, steps and KV blocks; the draft
  depth load-aware speculation allowed; :mod:`.prometheus` carries them to the front end's ``/metrics``.
* :mod:`.load`: load-aware speculation, each request's draft width and depth per step from the batch's shapes and a
  verified-token budget (``verify_budget``); :mod:`.load_probe` measures the ``"auto"`` budget at start-up.
* :mod:`.graphs`: no CUDA graph replays over forest attention (PIECEWISE split at attention, or NONE), set when the
  config is built (patch ``vllm_post_init``) and checked by :mod:`.worker`; :mod:`.support`: what the engine
  cannot do (model features, logits processors, thinking budgets), refused at start-up with the reason.

Importing this package imports nothing from vLLM; :mod:`.runner` and :mod:`.drafter` do.
"""
