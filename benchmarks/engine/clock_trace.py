"""The step clock's view of the README main job, window by window: each measured window's requests, whether it
drafted (d) and verified (v) forests, its forest nodes, seconds and tokens emitted, and before it each choice of the
cost model (requests, nodes chosen, the corrected table's step / draft_step / per-node extra, the candidates' pass
rates). Shows where the first calls' time goes (results/first-call-2026-12-06).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python benchmarks/engine/clock_trace.py ['{"method": "dsbd"}']

Environment: REPS (calls, default 2), MT (max tokens, default 48). The engine core runs in this process; the trace
wraps ``StepClock.finish`` and ``cost.choose_shapes`` (nothing else changes).
"""
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_vllm as demo  # noqa: E402


def main():
    import vllm

    from vllm_dsbd.engine import cost, step_clock
    from vllm_dsbd.testing import models

    log = []
    finish, choose = step_clock.StepClock.finish, cost.choose_shapes

    def traced_finish(self, table):
        if self._t0 is not None:
            log.append(f"  window: {self._reqs} requests, d{int(self._drafted)} v{int(self._verified)}, "
                       f"{self._nodes + self._verified_nodes} nodes, {1e3 * (time.perf_counter() - self._t0):.1f} ms, "
                       f"{self._emitted} tokens")
        return finish(self, table)

    def traced_choose(cands, table, floor=None, left=None):
        out = choose(cands, table, floor, left)
        log.append(f"    choice: {len(cands)} requests, {sum(w * d for w, d in out)} nodes; table step "
                   f"{1e3 * table.step:.1f} ms, draft_step {1e3 * table.draft_step:.1f} ms, node "
                   f"{1e3 * table.node:.2f} ms; rates {[round(c.rate, 2) for c in cands]}")
        return out

    step_clock.StepClock.finish, cost.choose_shapes = traced_finish, traced_choose
    target = models.smollm2_dir()
    tok = models.load_tokenizer(target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in demo.code_edits(demo.CODE_EDITS) + demo.PROMPTS]
    params = vllm.SamplingParams(max_tokens=int(os.environ.get("MT", 48)), temperature=0)
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"method": "dsbd"}
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                   speculative_config=spec)
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as the demo's
    for rep in range(int(os.environ.get("REPS", 2))):
        log.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        load = llm.collective_rpc("dsbd_load")[0]
        print(f"call {rep + 1}: {n} tokens in {secs:.2f} s, {n / secs:.1f} tok/s; vetoed steps {load['vetoed_steps']}, "
              f"prompt rows {load['prompt_rows']}", flush=True)
        print("\n".join(log), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
