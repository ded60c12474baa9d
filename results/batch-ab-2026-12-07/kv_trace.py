"""Batch 128 (batch_ab.py's prompts, greedy, 48 tokens) on plain vLLM and on the ``"sources": []`` DSBD engine, one
engine after the other, each after a warm-up and the prompts' prefill: every step's free KV blocks after scheduling,
running and waiting requests, scheduled requests and tokens, and preemptions (a wrapper on the scheduler's
``schedule``). Shows whether a DSBD engine without forests fills the KV cache as plain vLLM does.

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/batch-ab-2026-12-07/kv_trace.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))
import sources_wall as sw  # noqa: E402
from draftfree import prompts as kind_prompts  # noqa: E402
from batch_ab import _mixed  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir  # noqa: E402
torch.set_num_threads(2)
B = 128
folder = smollm2_dir()
ps = [{"prompt_token_ids": p} for p in _mixed(kind_prompts(load_tokenizer(folder), -(-B // 4)))][:B]
sp = vllm.SamplingParams(temperature=0.0, max_tokens=48)
for name, spec in (("plain", None), ("none", {"method": "dsbd", "sources": []})):
    llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                   max_num_seqs=128, disable_log_stats=False, speculative_config=spec)
    core = llm.llm_engine.engine_core.engine_core
    sch = core.scheduler
    print(name, "spec", getattr(sch, "num_spec_tokens", None), "lookahead", sch.num_lookahead_tokens,
          "prefix", sch.cache_config.enable_prefix_caching, "blocks", sch.cache_config.num_gpu_blocks)
    trace = []
    orig = sch.schedule
    def schedule(*a, orig=orig, sch=sch, trace=trace):
        out = orig(*a)
        trace.append((sch.kv_cache_manager.block_pool.get_num_free_blocks(), len(sch.running), len(sch.waiting),
                      len(out.num_scheduled_tokens), out.total_num_scheduled_tokens, len(out.preempted_req_ids or ())))
        return out
    sch.schedule = schedule
    llm.generate(ps[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
    llm.generate(ps, vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    trace.clear()
    q0 = sw.metric(llm, "vllm:num_preemptions")
    t0 = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); t = time.perf_counter() - t0
    print(name, f"{t:.2f}s", sw.metric(llm, "vllm:num_preemptions") - q0, "preemptions; steps", len(trace), flush=True)
    print(name, "first 12 (free, running, waiting, scheduled reqs, tokens, preempted):", trace[:12])
    print(name, "min free", min(t[0] for t in trace), "steps with preemption",
          [i for i, t in enumerate(trace) if t[5]][:20])
    sw.shutdown(llm)
