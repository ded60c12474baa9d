"""vllm_dsbd's changes to vLLM 0.26.0: one patch per file, applied by :func:`apply_all` through one mechanism
(``_patching.py``: originals recorded, a second patch of the same target raises ``PatchError``, patches of modules
not imported yet wait for their import). ``vllm_dsbd.plugin.register()`` is the only caller.

Every patch but two leaves other speculative methods and non-speculative configs exactly as vLLM made them: each
replacement first checks for method "dsbd" and otherwise calls the original. The exceptions are on the CPU platform
only: ``cpu_expand_kernel`` (10) fixes a vLLM bug that breaks vLLM's own speculative sampling on CPU (it makes the CPU
compute what the GPU does), and ``cpu_ray_executor`` (19) lets vLLM's Ray executor start on CPU, where it raised.

Ledger (What / Why / How / Upstream / When it can go). "vLLM has a method registry" below means a way for a plugin
to add a speculative method with its own config keys and proposer; no such registry or upstream issue exists for
0.26.0. File and line references are to vllm 0.26.0.

1. ``spec_method_literal`` - target ``vllm.config.speculative.SpeculativeConfig.method`` (+ module constant
   ``SpeculativeMethod``, field ``type``, ``__annotations__``, pydantic validator; clears
   ``engine.arg_utils._compute_kwargs``' cache).
   What: "dsbd" is a valid ``speculative_config["method"]`` and ``--spec-method`` choice.
   Why: the field is a pydantic ``Literal`` (config/speculative.py:66, 94) on an ``extra="forbid"`` dataclass.
   How: extend the Literal in the three places that hold it, ``pydantic.dataclasses.rebuild_dataclass(force=True)``.
   When it can go: vLLM accepts plugin-defined methods (a registry, or ``method: str`` validated at run time).

2. ``spec_post_init`` - target ``SpeculativeConfig.__post_init__``.
   What: "dsbd" gets the draft ``ModelConfig``/parallel config/max length that "draft_model" gets (an EAGLE-3 head,
   recognised by the architecture in its ``config.json``, those that "eagle3" gets).
   Why: ``__post_init__`` raises ``NotImplementedError("Unsupported speculative method")`` for unknown methods
   (config/speculative.py:906-911) and only builds draft configs for the known ones.
   How: run the original with ``method="draft_model"`` (a head: ``"eagle3"``), restore "dsbd"; refuse other drafts
   that vLLM auto-detects as EAGLE/DFlash/DSpark/Medusa/MLP-speculator/MTP checkpoints. Without ``model`` (an engine without a draft model)
   the original is not run (it only builds draft configs, and raises "num_speculative_tokens was provided but without
   speculative model", config/speculative.py:692-732): no draft configs.
   When it can go: with 1 (a registry that lets a method declare "I am a draft-model method").

3. ``uses_draft_model`` - target ``SpeculativeConfig.uses_draft_model``.
   What: true for "dsbd" with a draft model. Why/How: DSBD rides on the draft-model path; the call sites that then
   see "dsbd" as
   "draft_model": gpu_model_runner.py:603 (drafter = ``DraftModelProposer``), :4582 (drafter runs a model forward:
   GPU sampled tokens), :5100 (``propose_draft_token_ids`` branch), :6099 (drafter dummy run), :7080 (drafter
   attention backend in ``initialize_metadata_builders``), :7134 (drafter cudagraph dispatcher); cpu_model_runner.py:161
   (log); core/sched/scheduler.py:252 (``num_lookahead_tokens = num_spec_tokens``); config/speculative.py:1259
   (heterogeneous-vocab check), :1302 (``max_num_new_slots_for_drafting``: +1 slot per request).
   Deliberately NOT seeing "dsbd" as "draft_model": config/vllm.py:1040 and :1072 (async scheduling: "dsbd" is
   refused when ``--async-scheduling`` is set explicitly and disabled by default, as the DSBD sampler is
   synchronous); config/vllm.py:2158 (Model Runner V2 lists "dsbd" as unsupported, so dense targets that would
   default to V2 on a GPU fall back to the V1 runner that DSBD extends); llm_base_proposer.py method checks other
   than ``model_returns_tuple`` (all about eagle3/dflash/mtp).
   A "dsbd" engine without a draft model is not a draft-model engine (false: no draft load, draft KV cache, drafter
   dummy run or lookahead slots). vLLM's runner has no drafter for such a method (gpu_model_runner.py:595-653 raises
   "Unknown speculative decoding method"), so the DSBD runner runs vLLM's runner ``__init__`` with the config's
   method and model seen as vLLM's "custom_class" and ``engine.no_drafter.NoDrafter`` (``no_drafter.vllm_runner_init``,
   restored after; no vLLM code is replaced), and keeps a ``NoDrafter``.
   When it can go: with 1.

4. ``vocab_check`` - target ``SpeculativeConfig.verify_equal_vocab_size_if_draft_model``.
   What: target/draft vocabulary sizes must match for "dsbd". Why: the check tests ``method == "draft_model"``
   (config/speculative.py:1277). How: run the original with ``method="draft_model"``. When it can go: with 1.

5. ``proposer_returns_tuple`` - target ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer
   .model_returns_tuple`` (applied when that module is imported).
   What: False for "dsbd". Why: it returns ``method not in ("mtp", "draft_model", "dflash")`` (line 1015), so an
   unknown method would unpack a plain draft LM's output as a tuple. How: "dsbd" -> False, else the original.
   When it can go: with 1, or when the DSBD drafter no longer derives from ``SpecDecodeBaseProposer``.

6. ``cli_alias`` - target ``vllm.engine.arg_utils.EngineArgs.add_cli_args``.
   What: ``--speculative-method`` is an alias of ``--spec-method``. Why: vLLM 0.26 has only ``--spec-method``
   (arg_utils.py:1542); DSBD's documented interface is ``--speculative-method dsbd``. How: add the alias to the
   existing argparse action. When it can go: vLLM gains ``--speculative-method``, or we drop that spelling.

7. ``dsbd_knobs`` - target ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``.
   What: DSBD settings given in ``speculative_config`` (width, min_width, width_threshold, dynamic_width, mode,
   depth) or ``additional_config["dsbd"]`` are validated (``DSBDConfig``) and stored in
   ``additional_config["dsbd"]`` (with ``draft``: whether ``model`` names a draft model); vLLM's ``SpeculativeConfig``
   gets ``num_speculative_tokens = max(N * depth + width - 1, max_beam_width - 1)`` (N = ``beam_nodes`` or ``width``;
   ``max(1, width - 1)`` for the first without a forest source, where a depth given is refused).
   Why: ``SpeculativeConfig`` rejects unknown keys, and the scheduler must reserve one slot per forest node.
   How: see the module docstring. When it can go: with 1 if the registry lets a method bring its own config class
   and slot count.

8. ``dsbd_worker`` - target ``vllm.engine.arg_utils.EngineArgs.create_engine_config``.
   What: a "dsbd" engine's ``parallel_config.worker_cls`` is the DSBD subclass of the worker vLLM's platform picked
   (``vllm_dsbd.engine.worker``: CPUWorker / gpu_worker.Worker), whose ``init_device`` swaps in the DSBD model
   runner (vLLM's V1 runner + ``DSBDRunnerMixin``: forest drafter, forest attention, verification sampler, KV
   commit). Why: vLLM 0.26 has no hook to choose the runner class (``init_device`` builds it by name, cpu_worker.py:181,
   gpu_worker.py:411-416); the worker class is configurable, but the platform resolves "auto" inside ``VllmConfig``.
   How: after the original builds the config, map the platform's worker to ours (other worker classes are refused
   for "dsbd"). When it can go: vLLM lets a plugin choose the model runner (or a speculative-method registry brings
   its own runner hooks).

9. ``request_validation`` - target ``vllm.v1.engine.input_processor.InputProcessor._validate_params``.
   What: for a "dsbd" engine, also validate ``SamplingParams.extra_args["dsbd_width"]`` (``requests.request_width``)
   and the settings DSBD refuses (``requests.check_request``), and skip vLLM's refusal of ``min_p`` and ``logit_bias``
   with speculative decoding (DSBD applies them per forest node: ``engine/processors.py``).
   Why: checked only in the worker, a bad width raised inside the engine core and killed it (HTTP 500, server down);
   in the front end it is a ``ValueError``: 400 from the server, an exception offline, and the engine keeps serving.
   How: wrap the method; other methods and pooling params pass through unchanged. When it can go: vLLM lets a
   speculative method validate its request arguments (or extra_args get a validation hook).

10. ``cpu_expand_kernel`` - target ``vllm.utils.cpu_triton_utils.expand_kernel`` (applied when that module is
   imported, i.e. by the CPU model runner only). The one patch that changes a non-DSBD path: a bug fix.
   What: on CPU, ``rejection_sampler.expand_batch_to_tokens`` returns the per-token temperature / top-k / top-p.
   Why: vLLM's CPU stand-in converts the output buffer to int64 (a copy) and never writes back
   (cpu_triton_utils.py:408-421; upstream issue vllm-project/vllm#55005, open), so vLLM's own speculative sampling
   (``draft_model`` at temperature > 0, used as the benchmark baseline and in tests) divides target logits by
   uninitialised memory on CPU. How: a torch ``repeat_interleave`` stand-in in the caller's dtype, read by
   ``CPUModelRunner._postprocess_triton`` (cpu_model_runner.py:112). When it can go: vllm#55005 is fixed in the
   pinned vLLM.

11. ``vllm_post_init`` - target ``vllm.config.vllm.VllmConfig.__post_init__``.
   What: a "dsbd" config (a) never has a CUDA graph with attention inside: ``compilation_config.cudagraph_mode``
   FULL / FULL_DECODE_ONLY / FULL_AND_PIECEWISE becomes PIECEWISE where the graphs are split at the attention ops
   (``CompilationConfig.is_attention_compiled_piecewise()``, or ``VLLM_USE_BREAKABLE_CUDAGRAPH``), else NONE, logged
   at INFO (``engine/graphs.py``); with the DSBD setting ``full_cuda_graphs`` the full modes stay (FULL_AND_PIECEWISE
   becomes FULL_DECODE_ONLY where its pieces would contain attention) and the DSBD runner excludes FULL from every
   pass that has forest attention (``runner._determine_batch_execution_and_padding``); (b) refuses
   ``logits_processors`` and a ``--reasoning-config`` with thinking delimiters (thinking budgets) with a ValueError
   naming the setting (``engine/support.py``).
   Why: (a) GPU platforms default to FULL_AND_PIECEWISE (config/vllm.py:267, :290); a full graph is replayed for
   uniform decode batches (every request 1 + ``num_speculative_tokens`` tokens: each DSBD decode batch) and skips the
   forest recompute that runs in Python inside ``impl.forward`` (the ``unified_attention_with_output`` custom op,
   model_executor/layers/attention/attention.py:818-845), so the target would attend causally over the forest: wrong
   tokens, no error. PIECEWISE graphs split at that op (compilation.py:1146) keep it eager. (b) vLLM applies
   logits processors and ``thinking_token_budget`` in its samplers (sampler.py:404, rejection_sampler.py:341), which
   DSBD replaces; ``reasoning_config`` has no other consumer in vLLM 0.26.
   How: wrap ``__post_init__``; after the original (so no later vLLM override, e.g. sequence parallelism raising
   PIECEWISE to FULL, compilation.py:1215-1221, can undo it) run the checks and set the mode; the DSBD worker checks
   the mode again before building its runner. The GPU runner only lowers the mode later
   (``resolve_cudagraph_mode_and_sizes``, compilation.py:1353-1457); drafter graphs are PIECEWISE or NONE in vLLM
   (llm_base_proposer.py:411-426) and the DSBD drafter runs its passes with no runtime graph mode.
   When it can go: (a) when forest attention is captured correctly in full graphs (its metadata in static buffers;
   today only passes without it, chains, may replay full graphs, and only with ``full_cuda_graphs``),
   or vLLM lets a speculative method declare its CUDA-graph support; (b) with 1, if the registry lets a method say
   which sampler features it applies.

12. ``env_names`` - target ``vllm.envs.environment_variables`` (items ``VLLM_DSBD_*``).
   What: vLLM knows DSBD's environment variables. Why: ``vllm.envs.validate_environ`` (envs.py:2090) warns about
   every unknown ``VLLM_*`` variable in every process, and the plugin exports ``VLLM_DSBD_PROMETHEUS_DIR``/``_PID``
   to every engine process (two warnings per process of every DSBD server). How: add the names with getters, as
   vLLM's own entries are. When it can go: vLLM lets plugins declare environment variables, or DSBD drops the
   ``VLLM_`` prefix.

13. ``spec_stats_depths`` - target ``vllm.v1.core.sched.scheduler.Scheduler.make_spec_decoding_stats`` (and
   ``update_from_output``, which keeps its ``scheduler_output`` and ``model_runner_output`` on the scheduler while it
   runs; 15 reads the latter).
   What: vLLM's spec-decode statistics of a DSBD engine have one position per draft depth (position p: iterations
   that passed depth p + 1); drafted tokens = forest nodes scheduled, accepted = layers passed, as vLLM counts them.
   Why: vLLM sizes the per-position arrays by ``num_speculative_tokens`` (``width * depth`` forest slots for DSBD,
   scheduler.py:2455), so its log line and Prometheus showed ``width * depth`` positions of which all beyond ``depth``
   are always 0; and it counts the ``-1`` placeholder drafts it pads new one-token requests with (for full CUDA
   graphs, scheduler.py:843-859) as drafts. How: for "dsbd", drafted tokens are the scheduled nodes that are not
   placeholders (a step with only placeholders is no draft), the stats are made with ``depth`` positions and
   observed without the chain-only ``num_draft_tokens_per_pos`` (read nowhere in vLLM 0.26; left at 0). An engine
   without a draft model makes no spec-decode statistics (its beam requests' leaves in the draft slots are no drafts).
   Beam requests never count in them: vLLM would count the trie nodes a beam step kept as accepted drafts (one
   W = 4 request of 16 steps and no layer passed showed 27 accepted, "Mean acceptance length: 2.80"); they have
   their own ``vllm:dsbd_beam_*`` counters.
   When it can go: vLLM lets a method describe
   tree-shaped drafts (positions = depths).

14. ``spec_stats_prometheus`` - target ``vllm.v1.metrics.loggers.PrometheusStatLogger.__init__``.
   What: ``vllm:spec_decode_num_accepted_tokens_per_pos`` of a DSBD engine has ``depth`` series (positions = depths).
   Why: ``SpecDecodingProm`` makes one series per ``num_speculative_tokens`` position (spec_decode/metrics.py:260).
   How: for "dsbd" the logger's ``SpecDecodingProm`` is built from a copy of ``speculative_config`` with
   ``num_speculative_tokens = depth`` (that constructor call only). When it can go: with 13.

15. ``beam_scheduler`` - target ``vllm.v1.core.sched.scheduler.Scheduler._update_request_with_output``,
   ``._free_request``, ``.__init__`` and ``.add_request``.
   What: a DSBD beam request (``extra_args["dsbd_beam"]``, ``engine/beams/``) stops when the DSBD runner says its beam
   search is over (``ModelRunnerOutput.dsbd_finished``, kept on the scheduler by 13's ``update_from_output`` wrapper),
   with its best beam's finish reason; its beams travel to the front end as the request's ``kv_transfer_params``; prefix
   caching commits its blocks only up to its prompt; and the tokens vLLM outputs for it
   (``EngineCoreOutput.new_token_ids``) are the ones its step settled (``ModelRunnerOutput.dsbd_settled``,
   ``BeamRequest.settle``: the common prefix of its live beams and its n best finished beams, then at the end the rest
   of the best beam), not the trie slots vLLM appended; at a re-layout (``ModelRunnerOutput.dsbd_relayout``,
   ``BeamRequest._relayout``) the request's output token list becomes the runner's new one (the beams' common prefix as
   linear context, then the trie without dead slots), with ``num_computed_tokens`` and the block hashes past the first
   changed token following (DESIGN §2 "shrinking the request at re-layout"), and the blocks past the slots it uses go
   back to the pool; vLLM's token stops (EOS, ``stop_token_ids``, which for a request that does not ignore EOS include
   the generation config's other EOS ids) are off for it, as its appended tokens are trie slots
   (``tests/engine/test_engine_beam_eos_ids.py``); with ``max_beam_slots`` above ``max_model_len`` the scheduler's and
   KV cache manager's per-request token bound is the engine's slot length (``DSBDConfig.slot_len``; the engine refuses
   to start when its KV pool cannot hold one such request), and ``add_request`` cuts every other request's
   ``max_tokens`` to ``max_model_len - prompt``, where vLLM's own bound stops it (``tests/engine/
   test_engine_wide_beams.py``). Why: vLLM's token list of a beam request is prompt + trie nodes; vLLM cannot
   know when the search ends (the engine request has ``ignore_eos`` and a large ``max_tokens``), has no per-request
   output channel from the runner but ``kv_transfer_params`` (engine core -> ``RequestOutput``, across processes), would
   cache trie blocks (K/V under trie masks and positions) for any request with the same tokens, bounds every request's
   slots by ``max_model_len`` (scheduler.py:513-518, ``check_stop``, kv_cache_manager.py:430-432) though a beam
   request's slots hold W beams at positions at most prompt + max_tokens
   (``tests/engine/test_engine_beams.py`` sees 144 cached tokens served instead of 112 without the cap), and would output (and
   stream) the trie's slots, which are no beam. ``_update_request_with_output`` is where the tokens vLLM appends to a
   request become the tokens it outputs, and the only place where the two can differ (the front end, in or across
   processes, sees only the latter): a streamed beam request (``DELTA`` / ``CUMULATIVE``, the server's ``"stream":
   true`` with ``vllm_xargs``) streams the settled prefix, never retracted, and every beam request's final
   ``CompletionOutput`` is its best beam (``tests/engine/test_engine_beam_stream.py``). Engine ``logprobs`` of a beam
   request: vLLM slices them from the rows the runner sampled, which are not its tokens'; the final output's are the
   best beam's (21). vLLM's token list only grows (a rejected draft is rolled back by ``num_computed_tokens`` alone), so without the re-layout a beam request
   keeps every slot it ever kept (dead beams' nodes as holes) and its forest attention recomputes over them. With a
   draft model, ``__init__`` also keeps vLLM's lookahead (``num_lookahead_tokens = num_spec_tokens``,
   scheduler.py:252: KV slots reserved per running request) at a full forest step's slots
   (``DSBDConfig.forest_slots``), not the leaves of the widest beam request that ``num_spec_tokens`` also covers
   (``max_beam_width - 1``; scheduled tokens get their slots anyway). How: wrap
   the four; requests without ``dsbd_beam`` and non-DSBD engines are untouched (except a plain request's ``max_tokens``
   past ``max_model_len`` on an engine with ``max_beam_slots``, cut where vLLM stops it). When it can go: vLLM gains in-engine
   beam search (or a runner-side finish with a payload, output tokens that may differ from the appended ones, and a way
   for the runner to rewrite a request's token list), a per-request cap on prefix-cache commits and a per-request KV
   slot bound apart from the context length.

16. ``beam_search_route`` - target ``vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin
   .beam_search`` (``LLM.beam_search``).
   What: on a DSBD engine, one engine request per prompt with ``extra_args["dsbd_beam"]`` instead of vLLM's front-end
   loop (one request per live beam per token); the beams come back as vLLM's ``BeamSearchOutput``. Why: the loop
   runs at 0.07x plain decoding on an H100 (``docs/notebook``, GPU) and cannot use DSBD. How: wrap; other engines call the
   original; the engine request runs at temperature 0 whatever ``BeamSearchParams.temperature`` (vLLM's loop ranks raw
   log-probabilities at any temperature, so its beams are the T = 0 beams); ``structured_outputs`` go on the engine
   request (its beams follow the grammar as vLLM's loop's do, ``engine/beams/grammar.py``); a width above the
   engine's, a beam longer than ``max_model_len`` and a trie that may not fit the engine's slots per request
   (``max_model_len``, or ``max_beam_slots`` when larger) raise ``ValueError`` naming the parameter. When it can go: vLLM runs ``LLM.beam_search`` in the engine and lets a
   speculative method serve it.

17. ``beam_serving_route`` - target ``vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin
   .beam_search`` (the OpenAI ``use_beam_search`` path of ``/v1/completions`` and ``/v1/chat/completions``), and
   ``to_beam_search_params`` of ``vllm.entrypoints.openai.completion.protocol.CompletionRequest`` and
   ``vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest`` (they note the request's ``stop`` and
   ``stop_token_ids`` on the ``BeamSearchParams`` they return, as ``_dsbd_stops``, and its ``response_format`` /
   ``structured_outputs`` as ``_dsbd_structured``, attributes only the DSBD route reads: every engine gets vLLM's
   params otherwise unchanged).
   What/Why: as 16, for the server: one engine request per prompt, the beams back as the one finished
   ``RequestOutput`` vLLM's loop yields (n choices, best first, text, token ids, cumulative logprob, finish and stop
   reason, per-token logprobs: the 2W-entry dicts of vLLM's loop); temperature 0 on the engine request, as 16; the
   request's stop strings and ids and its structured outputs go to the beams (vLLM's loop ignores them). How: wrap the async generator; bad
   requests raise ``VLLMValidationError`` with ``param`` ("n", "max_tokens", "prompt") inside it, so the server
   answers 400 and keeps serving. When it can go: with 16.

18. ``spec_repr`` - target ``vllm.config.speculative.SpeculativeConfig.__repr__``.
   What: a "dsbd" config without a draft model prints ``SpeculativeConfig(method='dsbd', model=None,
   num_spec_tokens=N)``. Why: vLLM's ``__repr__`` reads ``draft_model_config.model`` for every method but ngram,
   suffix, extract_hidden_states and custom_class (config/speculative.py:1348-1362), and that config is None without a
   draft (2), so the start-up log of the engine's config (``VllmConfig.__str__``) raised ``AttributeError``. How: wrap;
   other configs go to the original. When it can go: with 1 (a method that declares it has no draft model).

19. ``cpu_ray_executor`` - targets ``vllm.platforms.cpu.CpuPlatform.ray_device_key``; on the CPU platform only,
   ``vllm.v1.executor.ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs`` and the module global
   ``ray_executor_v2.RayWorkerProc`` (applied when that module is imported). The second patch that changes a
   non-DSBD path: every engine on CPU with ``distributed_executor_backend="ray"``.
   What: vLLM's Ray executor (``RayExecutorV2``, the default for "ray") runs on the CPU platform, for TP = 1 and
   TP > 1: one placement-group bundle of one Ray CPU per rank, the worker actors inside (``num_cpus=0``).
   Why: ``CpuPlatform`` has no ``ray_device_key`` (platforms/interface.py:147, empty = no Ray), so
   ``initialize_ray_cluster`` raised "current platform cpu does not support ray" (ray_utils.py:589-593;
   vllm-project/vllm#21602, closed stale; the upstream fix #25386 was closed unmerged). With the key "CPU", the
   executor asks Ray for ``resources={"CPU": 1}`` per actor (ray_executor_v2.py:254-261), which Ray refuses ("Use the
   'num_cpus' ... keyword"), and each actor reads ``get_accelerator_ids()["CPU"]`` (ray_executor_v2.py:125-137),
   which does not exist. DSBD needs it because the design runs DSBD under vLLM's Ray executor like any other
   engine. Changing non-DSBD engines is acceptable: on CPU this path raised before, so no working configuration
   changes; GPU platforms keep vLLM's code (the executor patches are not applied there, and their key is not
   touched). How: key "CPU" (placement-group bundles ``{"CPU": 1}``, ray_utils.py:637-639); actor resources
   ``{"num_gpus": 0}`` (its bundle holds the rank's CPU); actors of ``vllm_dsbd.engine.ray_worker.CPURayWorkerProc``,
   which reports no accelerator ids (the CPU worker reads none). Not covered: vLLM's older ``RayDistributedExecutor``
   (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, ray_executor.py:207-212 asks for the same refused resource) and Ray
   data parallelism (v1/engine/utils.py:575, :774): untested here. Per-rank OpenMP core binding, which the ``mp``
   executor sets up on CPU (multiproc_executor.py:175), is not done by the Ray executor (set
   ``VLLM_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS``). When it can go: vLLM's CPU platform supports Ray (a
   ``ray_device_key`` with CPU-aware actor resources, as #25386 proposed).

20. ``grammar_forests`` - target ``vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids`` and
   ``.get_grammar_bitmask``, and ``vllm.v1.structured_output.StructuredOutputManager.should_advance``.
   What: on a DSBD engine vLLM's scheduler takes a structured request's drafts (a forest) as they are and computes no
   grammar bitmask; the DSBD worker masks every row itself, each forest node's target and draft rows by the grammar
   after output + its own path (``engine/grammar.py``, its own matcher per request from vLLM's structured-output
   backend, advanced with the output tokens). Why: vLLM cuts a structured request's drafts to their grammar-valid
   chain prefix (scheduler.py:2074-2076) and masks one row per position by walking the matcher along them as a chain
   (structured_output/__init__.py:285-350, an ``AssertionError`` on a token the chain rejects); a forest is a tree in
   depth-major order, so both are wrong for it, and the draft's rows are drawn in the worker before the scheduler
   sees the forest. How: wrap both; DSBD engines skip the grammar cut (prefill chunks still drop their drafts) and
   return no ``GrammarOutput``; vLLM's scheduler still advances its own matcher with a plain request's emitted tokens
   (``update_from_output``), never with a beam request's (``should_advance`` False: its tokens are several beams'
   trie slots, which the matcher would reject, ending the request; the worker keeps a grammar state per beam,
   ``engine/beams/grammar.py``). Under vLLM's reasoning gate (``--reasoning-parser``, ``enable_in_reasoning`` off)
   ``should_advance`` holds a plain request's matcher until its output holds the end marker and then advances it
   with the tokens after the marker, however many tokens the step emitted (vLLM's own looks at the step's last token
   only and holds back the step's other tokens). Non-DSBD engines call the originals. When it can go: vLLM takes
   tree-shaped drafts with per-node bitmasks.

21. ``beam_outputs`` - target ``vllm.v1.engine.output_processor.LogprobsProcessor.from_new_request`` and
   ``.update_from_output``, ``RequestState.make_request_output``.
   What: when a plain beam request (``extra_args["dsbd_beam"]`` with ``logprobs`` k <= 2W) finishes, its logprobs
   become the best beam's in vLLM's shape (per token the chosen token with its rank and the row's k best) and its
   ``cumulative_logprob`` the best beam's. Why: the request's output tokens are the beams' settled prefix and best
   beam (15), not the rows the runner sampled, so the logprobs vLLM slices from those rows are not its tokens'. How:
   wrap both; the processor notes the request's ``dsbd_beam`` settings, and a finished output that carries
   ``kv_transfer_params["dsbd_beam"]`` (only a DSBD engine sends it) gets the best beam's; every other request is
   untouched (``tests/engine/test_engine_beam_logprobs.py``: equal to vLLM's own ``LLM.beam_search`` to 1e-4). A
   finished beam request whose best beam stopped on a stop string gets its text cut there, as vLLM cuts a plain
   request's (kept with ``include_stop_str_in_output``; ``test_engine_beam_stops.py``). When it can go: with 15.

22. ``spec_hash_head`` - target ``vllm.config.speculative.SpeculativeConfig.compute_hash``.
   What: a "dsbd" config whose draft is an EAGLE-3 head (``engine/head.py``) hashes as vLLM's "eagle3" (auxiliary
   hidden states, the head's config and layer ids in the hash). Why: the hash keys vLLM's compiled-graph cache, and
   the head's target returns auxiliary hidden states (the DSBD runner sets ``use_aux_hidden_state_outputs``); hashed
   as "dsbd" it shared the key of a plain-draft "dsbd" engine on the same target (config/speculative.py:305-310 counts
   only vLLM's own methods). How: wrap; a head config is hashed with ``method = "eagle3"``, restored after; other
   configs go to the original. When it can go: with 1 (a method that declares it uses auxiliary hidden states).

23. ``reasoning_gate`` - target ``vllm.v1.core.sched.scheduler.Scheduler.schedule``.
   What: on a DSBD engine under vLLM's reasoning gate (a reasoning parser, ``enable_in_reasoning`` off) each new
   plain structured request's ``NewRequestData`` carries ``dsbd_reasoning`` (whether its reasoning had ended before
   its output: the front end's word or the prompt, vLLM's ``should_fill_bitmask``; the parser's per-request kwargs).
   Why: vLLM neither masks nor advances the grammar until the end marker (structured_output/__init__.py:362-437),
   and the DSBD worker, which masks every forest row itself, sees neither value (``NewRequestData`` has no field for
   them). How: wrap ``schedule``; set the attribute after the original. When it can go: with 20.

24. ``scheduler_queue`` - target ``vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule``.
   What: on a DSBD engine each ``SchedulerOutput`` carries ``dsbd_waiting``, the requests left waiting after the
   step was scheduled. Why: the cost model's floor per request (``cost.request_floors``: no request slowed by the
   others' forests) holds only while none waits (under a queue a freed slot is refilled at once, so the batch's
   tokens per second is what counts), and the worker sees only the scheduler output, which has no field for the
   queue.
   How: wrap ``_update_after_schedule`` (the last call of ``schedule``, scheduler.py:1190); set the attribute after
   the original. When it can go: vLLM's scheduler output carries its queue length.

Also for heads, 2 (``spec_post_init``) recognises one by the architecture in its ``config.json`` and builds it as vLLM
builds an "eagle3" draft; the DSBD runner sets vLLM's own ``use_aux_hidden_state_outputs`` (no patch: an attribute
vLLM's runner reads after ``__init__``).
"""

from __future__ import annotations

import importlib

from vllm_dsbd.patches._patching import PatchError, Record, applied

__all__ = ["PATCHES", "PatchError", "Record", "applied", "apply_all"]

# Application order: the config patches first (the Literal rebuild compiles the validator that __post_init__ and
# the model validator run in), then the CLI/EngineArgs ones.
PATCHES = (
    "spec_method_literal",
    "spec_post_init",
    "uses_draft_model",
    "vocab_check",
    "proposer_returns_tuple",
    "cli_alias",
    "dsbd_knobs",
    "dsbd_worker",
    "request_validation",
    "cpu_expand_kernel",
    "vllm_post_init",
    "env_names",
    "spec_stats_depths",
    "spec_stats_prometheus",
    "beam_scheduler",
    "beam_search_route",
    "beam_serving_route",
    "spec_repr",
    "cpu_ray_executor",
    "grammar_forests",
    "beam_outputs",
    "spec_hash_head",
    "reasoning_gate",
    "scheduler_queue",
)


_STARTED: set[str] = set()


def apply_all() -> None:
    """Applies every patch once (a second call raises PatchError: use ``vllm_dsbd.plugin.register()``)."""
    for name in PATCHES:
        if name in _STARTED:
            raise PatchError(f"vllm_dsbd patch {name!r} was applied already; refusing to apply it twice")
        _STARTED.add(name)
        importlib.import_module(f"{__name__}.{name}").apply()
