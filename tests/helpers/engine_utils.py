"""What every test that starts a real vLLM engine on CPU shares. Import it before vllm.

- in-process engine core (fast start), 1 GiB of KV cache, no OpenMP core binding and one torch thread: on 2 shared
  cores OpenMP spin-waits otherwise make generation about 100x slower (these settings last for the pytest session);
- ``tiny_pair`` / ``peaky_pair``: the tiny random Llama pairs of the engine tests, built once (the ``tiny_pair``
  fixture of ``tests/conftest.py`` gives the first);
- ``dsbd_llm``: a ``vllm.LLM`` with the engine tests' common keywords (``ENGINE_KW``; a DSBD engine when the
  overrides give a DSBD ``speculative_config``, with the cost model off unless it names ``cost_model``: it would
  switch a tiny random draft off, and these tests check what forests do), shut down and freed when its ``with``
  block ends;
- ``runner_of``: the model runner of an engine whose core runs in process;
- ``shutdown``: frees an engine so the next one in the same process can start;
- ``metric``: a metric from ``llm.get_metrics()`` (a counter's value, or the metric object, e.g. a histogram);
- ``LogRecords``: a logging handler that keeps the messages (start-up lines);
- ``beam_counters``: beam requests' DSBD counters and the drafted layers' widths (the beam law tests' deltas);
- ``with_eos``: a copy of a model folder whose tokenizer and configs name another token as EOS;
- ``sharpened``: a copy of a model folder with its LM head scaled (a peakier draft for the beam law tests);
- ``greedy_tokens``: greedy decoding with a Hugging Face next-token function (the oracle of several tests);
- ``eos_pair_engine``: a DSBD engine on the tiny random Llama pair whose target ends sequences at a given token;
- ``with_think_tokens``: a copy of a model folder whose tokenizer names two tokens ``<think>`` and ``</think>``.
"""
import contextlib
import functools
import gc
import logging
import os
from collections import Counter

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
torch.set_num_threads(1)


# what every engine of the engine tests is built with, unless a test says otherwise: float32 weights and eager passes
# (exact comparisons), a short context, a fixed engine seed, no prefix caching, statistics on (tests read metrics).
# On a GPU each engine takes 5% of the device: a process runs many engines one after another, and an engine's memory
# goes back to the device only once its last reference is gone (in a fixture, after ``shutdown``; ``dsbd_llm``
# empties the cache before each new engine); at vLLM's 0.92 the second DSBD engine of a pytest process found 5.6 GiB
# free (H100, 2026-11-26: results/gpu/2026-11-26).
ENGINE_KW = dict(dtype="float32", enforce_eager=True, max_model_len=256, seed=0, enable_prefix_caching=False,
                 disable_log_stats=False, **({"gpu_memory_utilization": 0.05} if torch.cuda.is_available() else {}))
# log-probabilities of the same tokens on two engines: float32 on CPU agrees to 1e-4. On a GPU vLLM's float32 Triton
# attention computes its dot products in TF32 (tl.dot's default) while the forest kernel uses IEEE float32: the same
# tokens' log-probabilities were up to 2.5e-3 apart on an H100, cumulative ones over 8 tokens 4e-3 (2026-11-26,
# results/gpu/2026-11-26), so 2e-2 there; the tokens themselves were equal
LOGPROB_TOL = 2e-2 if torch.cuda.is_available() else 1e-4


@functools.cache
def tiny_pair():
    """(target folder, draft folder): a tiny random Llama target (vocabulary 400, 3 layers, flat next-token laws:
    init_std 0.1) and its first 2 layers as the draft. Built into the model cache on first use."""
    from vllm_dsbd.testing.models import tiny_llama_pair

    return tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                           draft_layers=2)


@functools.cache
def peaky_pair():
    """(target folder, draft folder): a tiny random Llama target with peaky next-token laws (vocabulary 300, 4 layers,
    init_std 0.3) and its first 3 layers as the draft (about half of the probability mass in common)."""
    from vllm_dsbd.testing.models import tiny_llama_pair

    return tiny_llama_pair(vocab_size=300, seed=0, draft_init="truncate", init_std=0.3, target_layers=4,
                           draft_layers=3)


@contextlib.contextmanager
def dsbd_llm(model, **overrides):
    """``vllm.LLM(model=str(model), **ENGINE_KW)`` with ``overrides`` winning (e.g. ``speculative_config``,
    ``max_num_seqs``; a keyword set to vLLM's default undoes a common one); yields it and shuts it down at the end,
    so the next engine in the process can start."""
    import vllm

    spec = overrides.get("speculative_config")
    if isinstance(spec, dict) and spec.get("method") == "dsbd" and "cost_model" not in spec:
        overrides = {**overrides, "speculative_config": {**spec, "cost_model": None}}
    gc.collect()  # an earlier engine whose fixture frame held it until after its shutdown
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm = vllm.LLM(model=str(model), **{**ENGINE_KW, **overrides})
    try:
        yield llm
    finally:
        shutdown(llm)


def runner_of(llm):
    """The DSBD model runner of ``llm`` (engine core in process, one worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def slow_target(llm, seconds: float) -> None:
    """Makes ``llm``'s target ``seconds`` dearer per pass (as a large target's; the draft is another module) and
    measures its cost table again, forest work included (``cost_model: "auto"``): on the tiny test models, whose
    passes cost about what a step's forest work does, a forest then pays by the table, so a test of the user's engine
    sees forests drafted."""
    import time

    from vllm_dsbd.engine.forest_probe import with_forest_work
    from vllm_dsbd.engine.load_probe import measure_costs

    runner = runner_of(llm)
    forward = runner.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    runner.model.forward = slow_forward
    runner.set_cost_table(with_forest_work(measure_costs(runner), runner), "measured again, slow target")


def shutdown(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    if torch.cuda.is_available():
        # vLLM keeps one CUDA graph memory pool per process (Platform._global_graph_pool); once an engine's graphs are
        # gone the pool is released, and the next engine capturing into its handle trips the caching allocator's
        # INTERNAL ASSERT (use_count > 0, seen on an H100 2026-11-26): the next engine gets a new pool
        from vllm.platforms import current_platform

        type(current_platform)._global_graph_pool = None


def metric(llm, name: str):
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", m)
    return None


class LogRecords(logging.Handler):
    """Collects the messages of the log records it receives (attach it to a logger to read an engine's log lines)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def beam_sets(outs) -> Counter:
    """How often each set of final beams (each beam's token ids, sorted) came out of beam requests' outputs: the
    outcome of the beam-sampling law tests."""
    return Counter(tuple(sorted(tuple(b["token_ids"]) for b in o.kv_transfer_params["dsbd_beam"])) for o in outs)


def beam_counters(llm) -> dict:
    """Beam requests' DSBD counters as ints: ``vllm:dsbd_beam_{target_passes, steps, draft_nodes, layers_passed}``,
    and the drafted layers' count and width sum (``vllm:dsbd_layer_width``), for deltas around a law test's requests."""
    names = ("beam_target_passes", "beam_steps", "beam_draft_nodes", "beam_layers_passed")
    out = {n: int(metric(llm, f"vllm:dsbd_{n}") or 0) for n in names}
    widths = [m for m in llm.get_metrics() if m.name == "vllm:dsbd_layer_width"]
    out["drafted_layers"] = int(sum(m.count for m in widths))
    out["width_sum"] = int(sum(m.sum for m in widths))
    return out


def beam_law_run(llm, prompt, n: int, *, width: int, steps: int, depth: int, top_k: int) -> tuple[Counter, dict]:
    """``n`` seeded beam-sampling requests (T = 1, seeds 0 .. n - 1, ``dsbd_beam`` with ``depth``) on ``prompt``: the
    beam-set outcome (:func:`beam_sets`) and the beam counters' growth (:func:`beam_counters`) over them."""
    import vllm

    beam = {"width": width, "max_tokens": steps, "ignore_eos": True, "depth": depth}
    params = [vllm.SamplingParams(temperature=1.0, top_k=top_k, seed=s, max_tokens=steps * (width + 1) + 2,
                                  ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam}) for s in range(n)]
    before = beam_counters(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    after = beam_counters(llm)
    return beam_sets(outs), {k: after[k] - before[k] for k in after}


def with_eos(source, folder, eos: int):
    """Copies the model folder ``source`` to ``folder`` with token ``eos`` as its EOS (tokenizer, config.json and
    generation_config.json), so that a random test model really ends sequences. Returns ``folder``."""
    import json
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(source, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    return folder


def with_think_tokens(source, folder, start: int, end: int):
    """Copies the model folder ``source`` to ``folder`` with tokens ``start`` and ``end`` renamed ``<think>`` and
    ``</think>`` (added tokens, not special: a reasoning parser finds them in the vocabulary, and the text shows them),
    the weights unchanged: a tiny random model "thinks" until it emits token ``end``. Both must be BPE merges that no
    other merge uses (their merges are dropped). Returns ``folder``."""
    import json
    import shutil

    shutil.copytree(source, folder)
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    names = {i: s for s, i in vocab.items()}
    old = {names[start], names[end]}
    assert not any(old & {a, b} for a, b in tok["model"]["merges"] if a + b not in old), "not leaf merges"
    tok["model"]["merges"] = [[a, b] for a, b in tok["model"]["merges"] if a + b not in old]
    for i, name in ((start, "<think>"), (end, "</think>")):
        del vocab[names[i]]
        vocab[name] = i
        tok["added_tokens"].append({"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False, "special": False})
    path.write_text(json.dumps(tok))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for i, name in ((start, "<think>"), (end, "</think>")):
        cfg.setdefault("added_tokens_decoder", {})[str(i)] = {
            "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": False}
    cfg_path.write_text(json.dumps(cfg))
    return folder


def sharpened(source, folder, factor: float):
    """A copy of the model folder ``source`` in ``folder`` with its LM head scaled by ``factor`` (logits x factor: a
    peakier draft that still ranks tokens as ``source`` does). The with-replacement acceptance rule is biased only
    where Q differs from P and the first draft carries much of Q, so the beam law tests' planted variant needs a
    peaky draft to be rejected. Returns ``folder``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def greedy_tokens(fn, prompt, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from ``fn(ids [1, L]) -> logits [1, V]`` (``models.next_token_logits_fn``)."""
    out = list(prompt)
    for _ in range(n):
        out.append(int(fn(torch.tensor([out])).argmax(-1)[0]))
    return out[len(prompt):]


def eos_pair_engine(folder, eos: int, width: int, depth: int, max_num_seqs: int):
    """A DSBD engine (pinned speculation, statistics on) on the tiny random Llama pair (3-layer target, its first 2
    layers as the draft) with token ``eos`` as the target's EOS (a copy in ``folder``)."""
    import vllm

    target, draft = tiny_pair()
    return vllm.LLM(model=str(with_eos(target, folder, eos)), **ENGINE_KW, max_num_seqs=max_num_seqs,
                    speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": depth,
                                        "width": width, "verify_budget": None})
