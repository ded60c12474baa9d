"""Host time per engine step by phase, plain vLLM against the user's engine, on batch_ab.py's prompts (greedy, 48
tokens, one call after a warm call of the same batch; steps: ``execute_model`` calls): each phase's wall time per
call of it, read by wrapping the engine's bound methods on the instance (outermost calls only; `job_steps._timed`).
A DSBD engine's ``sample_tokens`` holds its drafting (``propose_draft_token_ids``, of which the cost model's
``_choose_depths``).

    VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python results/batch-ab-2026-12-07/host_phases.py [--batches 8,32]
"""
import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))

import sources_wall as sw  # noqa: E402  (sets the CPU engine's environment before vLLM)
from batch_ab import _mixed  # noqa: E402
from draftfree import prompts as kind_prompts  # noqa: E402
from job_steps import _timed  # noqa: E402

RUNNER = ("execute_model", "_model_forward", "_prepare_inputs", "sample_tokens", "propose_draft_token_ids",
          "_choose_depths")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32")
    a = ap.parse_args()
    import torch
    import vllm

    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    torch.set_num_threads(2)
    folder = smollm2_dir()
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [{"prompt_token_ids": p} for p in _mixed(kind_prompts(load_tokenizer(folder), -(-max(batches) // 4)))]
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=48)
    print("| batch | engine | call (s) | steps | " + " | ".join(f"{m} (ms)" for m in RUNNER)
          + " | schedule + update (ms) |\n|" + "---|" * (len(RUNNER) + 5))
    for b in batches:
        ps = prompts[:b]
        for name, spec in (("plain vLLM", None), ("DSBD", {"method": "dsbd"})):
            llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                           max_num_seqs=128, disable_log_stats=False, speculative_config=spec)
            core = llm.llm_engine.engine_core.engine_core
            runner = core.model_executor.driver_worker.worker.model_runner
            acc, cnt = collections.defaultdict(float), collections.Counter()
            for m in RUNNER:
                if hasattr(runner, m):
                    _timed(runner, m, m, acc, cnt)
            for m in ("schedule", "update_from_output"):
                _timed(core.scheduler, m, m, acc, cnt)
            llm.generate(ps, sp, use_tqdm=False)
            acc.clear()
            cnt.clear()
            t0 = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            secs = time.perf_counter() - t0
            per = {m: acc[m] / cnt[m] * 1e3 if cnt[m] else float("nan") for m in acc}
            print(f"| {b} | {name} | {secs:.2f} | {cnt['execute_model']} | " + " | ".join(
                f"{per.get(m, float('nan')):.2f}" for m in RUNNER)
                + f" | {per['schedule'] + per['update_from_output']:.2f} |", flush=True)
            sw.shutdown(llm)


if __name__ == "__main__":
    main()
