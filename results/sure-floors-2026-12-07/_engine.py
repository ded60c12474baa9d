"""The README job's engine for this page's ad-hoc scripts (the engine core in this process): ``ENGINES`` by name, and
``readme_engine(name)`` -> (llm, runner, prompts, params) with vLLM's warm-up call of one token pair done."""
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "engine"))

import demo_vllm as demo  # noqa: E402
import vllm  # noqa: E402

ENGINES = {"plain": None, "dsbd": {"method": "dsbd"}, "none": {"method": "dsbd", "sources": []}}


def readme_engine(name: str = "dsbd"):
    target, prompts, params = demo.readme_job()
    llm = vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                   speculative_config=ENGINES[name])
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return llm, runner, prompts, params
