"""DSBD under vLLM's Ray executor (``distributed_executor_backend="ray"``, ``RayExecutorV2``) on the CPU, with tensor
parallelism 1 and 2: one worker actor per rank in a local Ray cluster of 2 CPUs (patch ``cpu_ray_executor``), one
engine and one cluster at a time.

Against the in-process TP = 1 engine of ``test_engine_tp`` (same tiny model pair, prompts and workloads, imported from
there), checked:

* temperature 0 (widths 1 and 2) and seeded temperature 1: the Ray engine emits exactly TP = 1's tokens;
* beam requests (``LLM.beam_search`` and seeded sampled beams): exactly TP = 1's beams;
* unseeded requests finish and the Ray ranks' decision digests agree;
* DSBD's counters and vLLM's spec-decode counters count the same forests, and drafts were accepted;
* the actors ran this checkout's ``vllm_dsbd`` (the same file as the test process), one per rank, in other processes;
* Ray starts and shuts down cleanly: after the engine and ``ray.shutdown()``, Ray is not initialised and none of the
  processes Ray started (GCS server, raylet, workers) is left.

Ray is started by the test (``ray.init``: 2 CPUs, no dashboard, a small object store); vLLM finds it initialised and
makes its placement group there (one ``{"CPU": 1}`` bundle per rank).
"""
from __future__ import annotations

import os
import pathlib

import psutil
import pytest

from test_engine_tp import (  # noqa: F401  (fixture: the TP = 1 run)
    MAX_TOKENS, PROMPTS, _run, assert_metrics_count_forests, tp1,
)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray  # noqa: E402  (a missing or broken Ray must fail the suite, never skip it)

import vllm_dsbd  # noqa: E402

pytestmark = pytest.mark.slow

RAY_DAEMONS = ("gcs_server", "raylet")


def _ray_processes(daemons: list[psutil.Process]) -> dict[int, tuple[psutil.Process, str]]:
    """The processes ``ray.init`` started (``daemons``: GCS server, raylet, agents) and their descendants (workers),
    pid -> (process, command line)."""
    out = {}
    for d in daemons:
        try:
            for p in [d, *d.children(recursive=True)]:
                out[p.pid] = (p, " ".join(p.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return out


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _inspect(daemons):
    def inspect(llm) -> dict:
        """While the engine runs: where the workers import ``vllm_dsbd`` from, their pids, and Ray's processes."""
        return {"worker_files": llm.collective_rpc(lambda self: __import__("vllm_dsbd").__file__),
                "worker_pids": llm.collective_rpc(lambda self: __import__("os").getpid()),
                "running": _ray_processes(daemons)}
    return inspect


SHM = pathlib.Path("/dev/shm")


def _cpu_shm_files() -> set[str]:
    return {p.name for p in SHM.glob("*-cpushm_*")} if SHM.is_dir() else set()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ray_run(request, tiny_pair, tp1):  # noqa: F811  (tp1 first: one engine at a time)
    """One Ray cluster per engine (vLLM 0.26's Ray executor leaves its placement group until ``ray.shutdown()``)."""
    tp = request.param
    assert not ray.is_initialized()
    before = {p.pid for p in psutil.Process().children()}
    # one OpenMP thread per worker, as the in-process engines of the suite run (engine_utils): Ray's worker processes
    # run at nice 15 beside the engine's busy-polling driver on 2 cores, and with vLLM's CPU settings (libgomp in
    # LD_PRELOAD, exported by the first engine of this process) a worker with more threads ran ~20x slower
    shm_before = _cpu_shm_files()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        daemons = [p for p in psutil.Process().children() if p.pid not in before]
        out = _run(*tiny_pair, tp=tp, backend="ray", inspect=_inspect(daemons))
        started = {**out.pop("running"), **_ray_processes(daemons)}
    finally:
        ray.shutdown()
        # vLLM's CPU workers at TP > 1 make shared-memory files ``/dev/shm/<port>-tp:0-[ranks]-cpushm_<rank>`` and
        # remove them when they exit; Ray kills its actors, so the files stay, and the next Ray engine on this machine
        # whose name matches fails to start ("create shm in SHMManager failed. errno: 17", seen on a second run of
        # this file). The ones this run made are removed.
        for name in _cpu_shm_files() - shm_before:
            (SHM / name).unlink(missing_ok=True)
    out["tp"] = tp
    out["started"] = {pid: cmd for pid, (_, cmd) in started.items()}
    _, alive = psutil.wait_procs([p for p, _ in started.values()], timeout=30)
    out["left"] = {p.pid: started[p.pid][1] for p in alive if _running(p)}
    out["ray_initialized"] = ray.is_initialized()
    return out


def test_ray_greedy_and_seeded_equal_tp1(tp1, ray_run):  # noqa: F811
    assert ray_run["greedy"] == tp1["greedy"]
    assert ray_run["seeded"] == tp1["seeded"]


def test_ray_beam_requests_equal_tp1(tp1, ray_run):  # noqa: F811
    assert [[t for t, _ in g] for g in ray_run["beams"]] == [[t for t, _ in g] for g in tp1["beams"]]
    for g, e in zip(ray_run["beams"], tp1["beams"]):
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g, e))
    assert ray_run["sampled_beams"] == tp1["sampled_beams"]


def test_ray_ranks_agree_and_drafts_are_counted(ray_run):
    assert [len(t) for t in ray_run["unseeded"]] == [MAX_TOKENS] * len(PROMPTS) * 2
    ranks = ray_run["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == list(range(ray_run["tp"]))
    for r in ranks[1:]:
        assert {k: v for k, v in r.items() if k != "tp_rank"} == {k: v for k, v in ranks[0].items() if k != "tp_rank"}
    assert_metrics_count_forests(ray_run)


def test_ray_workers_run_this_checkout_in_actors(ray_run):
    tp = ray_run["tp"]
    assert [os.path.realpath(f) for f in ray_run["worker_files"]] == [os.path.realpath(vllm_dsbd.__file__)] * tp
    pids = ray_run["worker_pids"]
    assert len(set(pids)) == tp and os.getpid() not in pids
    assert set(pids) <= set(ray_run["started"])  # the actors are processes of this test's Ray cluster


def test_ray_shuts_down_cleanly(ray_run):
    started = ray_run["started"].values()
    assert all(any(d in cmd for cmd in started) for d in RAY_DAEMONS), started  # Ray really ran here, and we saw it
    assert not ray_run["ray_initialized"]
    assert ray_run["left"] == {}
