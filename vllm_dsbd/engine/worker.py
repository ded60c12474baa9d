"""DSBD workers: vLLM's CPU and GPU workers, building the DSBD model runner.

vLLM 0.26 has no hook to choose the runner class, but the config chooses the worker class: patch ``dsbd_worker`` points
a "dsbd" engine's ``worker_cls`` here. ``init_device`` runs vLLM's, then replaces vLLM's runner with the DSBD runner of
the same kind before anything is loaded into it (docs/design/step.md §3.1).
"""
from __future__ import annotations

import logging

from vllm_dsbd.config import AUTO_BUDGET, AUTO_COST

logger = logging.getLogger("vllm.vllm_dsbd.engine")

# the worker vLLM's platform picked -> ours
WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker": "vllm_dsbd.engine.worker.DSBDCPUWorker",
    "vllm.v1.worker.gpu_worker.Worker": "vllm_dsbd.engine.worker.DSBDGPUWorker",
}


def dsbd_worker_cls(worker_cls: str) -> str:
    """The DSBD worker for the worker class vLLM's platform chose (ValueError for any other)."""
    if worker_cls in WORKERS.values():
        return worker_cls
    if worker_cls not in WORKERS:
        raise ValueError(f"speculative method 'dsbd' supports vLLM's CPU and GPU workers only, not {worker_cls!r}")
    return WORKERS[worker_cls]


def _check_config(worker) -> None:
    """Before vLLM's ``init_device``: the V1 runner, and no CUDA graph that could replay over forest attention."""
    if getattr(worker, "use_v2_model_runner", False):
        raise ValueError("speculative method 'dsbd' runs on the V1 model runner only; unset VLLM_USE_V2_MODEL_RUNNER")
    from .graphs import check

    check(worker.vllm_config)


def _vllm_init_device(worker, init_device) -> None:
    """vLLM's ``init_device``, which builds vLLM's own runner: for an engine without a draft model with the method seen
    as the DSBD runner sees it while vLLM's runner ``__init__`` runs (vLLM's runner knows no drafter for it)."""
    from vllm_dsbd.config import DSBDConfig

    from .no_drafter import vllm_runner_init

    vc = worker.vllm_config
    with vllm_runner_init(vc.speculative_config, DSBDConfig.from_vllm_config(vc).draft):
        init_device()


class _DecisionsMixin:
    def compile_or_warm_up_model(self):
        """vLLM's warm-up (and graph capture), then the start-up probe (``load_probe.py``): the cost model's table
        (``cost_model="auto"``, on every device; with a forest step's own work, ``forest_probe.py``) or, with the cost
        model off, the knee of ``verify_budget="auto"`` (on a GPU); the random state is reset after it, as vLLM resets
        it after its own warm-up."""
        out = super().compile_or_warm_up_model()
        runner = self.model_runner
        if runner.dsbd_cfg.cost_aware:
            if runner.dsbd_cfg.cost_model == AUTO_COST:
                from vllm.utils.torch_utils import set_random_seed

                from .forest_probe import with_forest_work
                from .load_probe import measure_costs

                runner.set_cost_table(with_forest_work(measure_costs(runner), runner), "measured at start-up")
                set_random_seed(self.model_config.seed)
            return out
        if runner.dsbd_cfg.load_aware and runner.dsbd_cfg.verify_budget == AUTO_BUDGET:
            if getattr(runner.device, "type", str(runner.device)) != "cuda":
                # a CPU's forward times on shared cores move between runs, and with them the forests and a seeded
                # T > 0 request's tokens: "auto" is pinned there; an integer budget makes a CPU engine load-aware
                logger.info("DSBD load-aware speculation: verify_budget 'auto' is measured on a GPU only; on %s the "
                            "draft shape is pinned (give an integer verify_budget to make it load-aware)",
                            runner.device)
                return out
            from vllm.utils.torch_utils import set_random_seed

            from .load_probe import measure_budget

            runner.dsbd_budget, runner.dsbd_load_times = measure_budget(runner)
            set_random_seed(self.model_config.seed)
        return out

    def dsbd_load(self) -> dict:
        """This rank's load-aware speculation settings (``LLM.collective_rpc("dsbd_load")``): the budget (None:
        pinned or no cap), the knee probe's table {tokens: seconds} when measured, the cost model's table (``{"target":
        {tokens: seconds}, "draft": {...}, "step": seconds, "draft_step": seconds, "node": seconds}``, None: off; with
        the online correction, ``step_clock.py``), the correction's averages (``clock``, None: off), the depths allowed
        (with the cost model: chosen) so far {depth: count}, the nodes per depth the cost model chose for beam forests
        {N: count}, the exploration budget's steps and steps with a probe (``explore``, ``cost.Exploration``), the
        steps vLLM's sampler ran (``bare_steps``, ``bare.py``) and the steps whose forests the clock vetoed because
        they lose at that batch size for that kind of request (``vetoed_steps``, ``step_clock.StepClock.forests_lose``),
        and the prompt rows the recycle source took (``prompt_rows``: only where forests of the request's kind are
        measured to pay)."""
        runner = self.model_runner
        table = runner.dsbd_cost
        return {"budget": runner.dsbd_budget, "times": getattr(runner, "dsbd_load_times", None),
                "cost": None if table is None else {"target": dict(table.target), "draft": dict(table.draft),
                                                    "step": table.step, "draft_step": table.draft_step,
                                                    "node": table.node},
                "clock": None if (c := runner._dsbd_clock) is None else c.summary(),
                "pass_rates": {f"{src}/{kind}/{n}": pt[0] / pt[1] for ((src, kind), n), pt
                               in runner.dsbd_pass_rates.counts.items() if pt[1] > 0},
                "depths": dict(runner.dsbd_stats.draft_depths), "nodes": dict(runner.dsbd_stats.beam_nodes_chosen),
                "explore": {"steps": runner.dsbd_explore.steps, "probes": runner.dsbd_explore.probes},
                "bare_steps": runner.dsbd_stats.bare_steps, "vetoed_steps": runner.dsbd_stats.vetoed_steps,
                "prompt_rows": runner.dsbd_stats.prompt_rows}

    def dsbd_decisions(self) -> dict:
        """This rank's DSBD decision digest and counts (``LLM.collective_rpc("dsbd_decisions")``): equal on every
        tensor-parallel rank iff they built the same forests and made the same decisions."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return {"tp_rank": get_tensor_model_parallel_rank(), **self.model_runner.dsbd_stats.decisions_digest()}


def __getattr__(name):  # the worker classes import vLLM's worker modules: only where a worker is built
    if name == "DSBDCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        from .runner import cpu_runner_class

        class DSBDCPUWorker(_DecisionsMixin, CPUWorker):
            def init_device(self):
                _check_config(self)
                _vllm_init_device(self, super().init_device)
                self.model_runner = cpu_runner_class()(self.vllm_config, self.device)

        globals()[name] = DSBDCPUWorker
        return DSBDCPUWorker
    if name == "DSBDGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker

        from .runner import gpu_runner_class

        class DSBDGPUWorker(_DecisionsMixin, Worker):
            def init_device(self):
                _check_config(self)
                _vllm_init_device(self, super().init_device)
                self.model_runner = gpu_runner_class()(self.vllm_config, self.device)

        globals()[name] = DSBDGPUWorker
        return DSBDGPUWorker
    raise AttributeError(name)
