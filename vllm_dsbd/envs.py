"""DSBD's environment variables, all in one place: each one's name, default, accepted values and meaning
(:data:`VARIABLES`), and :func:`read`, which parses them into a frozen :class:`Env`.

Who reads what, and when:

* the plugin (``plugin.register``, in every process vLLM starts): ``VLLM_DSBD_DISABLE``;
* the DSBD runner, once, when it is built (``engine/runner.py``): ``VLLM_DSBD_FOREST_ATTENTION``,
  ``VLLM_DSBD_STATIC_VERIFY``, ``VLLM_DSBD_FUSED_VERIFY``, ``VLLM_DSBD_KV_COMMIT`` and, with a draft model,
  ``VLLM_DSBD_STATIC_DRAFT``; a bad value stops the engine there, naming the variable. It passes the values down: the
  attention layers' implementation (``attention.install``), the verification paths (``sampler.verify``'s
  ``chain_static`` / ``forest_static`` / ``fused``), the beam step's layers (``beams.step.step_beams``'
  ``static_layers`` / ``fused``), the drafter's ``static_drafting`` and the KV planes' commit (``kv.PlaneSet``);
* ``VLLM_DSBD_BEAM_RELAYOUT`` is read as the runner registers each beam request (``state.Requests.register``), so
  tests and ``benchmarks/engine/beams.py`` switch it between the requests of one engine;
* ``testing/models.py``: ``VLLM_DSBD_CACHE``, at each call of ``default_cache_dir``;
* ``engine/prometheus.py``: ``VLLM_DSBD_PROMETHEUS_DIR`` / ``_PID``, set by the plugin in the front end and read by
  the engine processes it starts (plumbing between processes, not settings: read and written there directly).

Functions called without the runner (unit tests, benchmarks: ``sampler.verify``, ``beams.sampling.verify``,
``attention.recompute_forest_outputs`` without their switches) read the variable they need at that call, with the
same parser (``sampler.static_default``, ``fused.fused_default``).

Every variable starts with ``VLLM_``, so vLLM would warn about each as unknown: patch ``env_names`` registers
:data:`NAMES` with vLLM. Importing this module imports neither torch nor vLLM.
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DISABLE = "VLLM_DSBD_DISABLE"
CACHE = "VLLM_DSBD_CACHE"
FOREST_ATTENTION = "VLLM_DSBD_FOREST_ATTENTION"
BEAM_RELAYOUT = "VLLM_DSBD_BEAM_RELAYOUT"
STATIC_VERIFY = "VLLM_DSBD_STATIC_VERIFY"
FUSED_VERIFY = "VLLM_DSBD_FUSED_VERIFY"
STATIC_DRAFT = "VLLM_DSBD_STATIC_DRAFT"
KV_COMMIT = "VLLM_DSBD_KV_COMMIT"
PROFILE_STEP = "VLLM_DSBD_PROFILE_STEP"
PROMETHEUS_DIR = "VLLM_DSBD_PROMETHEUS_DIR"
PROMETHEUS_PID = "VLLM_DSBD_PROMETHEUS_PID"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    """One row of the table."""

    name: str
    default: str  # the value an unset variable has ("" for none)
    accepted: str  # the values it takes (anything else: ValueError naming it, unless said otherwise)
    meaning: str
    attr: str | None  # the :class:`Env` field it fills (None: not parsed here)
    internal: bool = False  # set by the plugin itself between its processes: not a user setting


VARIABLES: tuple[Variable, ...] = (
    Variable(DISABLE, "", "1 / true / yes / on, or 0 / false / no / off / empty (any case, spaces ignored)",
             "skip the plugin's registration: vLLM without DSBD (plugin.py)", "disable"),
    Variable(CACHE, "~/.cache/vllm-dsbd", "a folder ('~' expanded; empty: the default)",
             "where testing/models.py builds its models and drafts", "cache"),
    Variable(FOREST_ATTENTION, "kernel", "torch, ref; any other value means kernel (never refused)",
             "forest attention in the attention layers: the Triton kernel on CUDA, batched torch elsewhere (kernel), "
             "batched torch everywhere (torch: the CPU-tested path, a fallback on CUDA), or the per-request torch "
             "reference everywhere (ref) (engine/attention.py)", "forest_attention"),
    Variable(BEAM_RELAYOUT, "1", "0; any other value means on (never refused)",
             "0: beam requests keep their dead trie slots and their common prefix in the trie (no re-layout); for "
             "comparisons in benchmarks/engine/beams.py and tests, not a user setting (engine/state.py)", "beam_relayout"),
    Variable(STATIC_VERIFY, "auto", "auto / empty, 1 / true / yes / on, 0 / false / no / off (any case)",
             "which verification paths a step takes: auto the static ones (no host reads) on a device and the row "
             "subsets on the CPU; 1 the static ones everywhere, 0 the row subsets everywhere (a fallback on a "
             "device). The beam step's layers follow it: all in one read when static (engine/sampler.py, "
             "engine/beams/step.py)", "static_verify"),
    Variable(FUSED_VERIFY, "auto", "auto / empty, 0 / false / no / off (any case)",
             "the fused verification kernel: auto on CUDA (the static paths, beam sampling's layers), 0 never "
             "(the torch layer) (engine/fused.py)", "fused_verify"),
    Variable(STATIC_DRAFT, "1", "1 / true / yes / on / empty, 0 / false / no / off (any case)",
             "the draft loops with one host read per call (1: the width-1 chain loop and the static loops), or the "
             "general loops, one read per draft depth, at every width (0: a fallback) (engine/drafter.py, "
             "engine/beams/drafter.py)", "static_draft"),
    Variable(KV_COMMIT, "auto", "auto / empty, torch (any case)",
             "the KV commit (moving kept nodes' K/V after verification): auto the Triton kernel on CUDA and the torch "
             "reference elsewhere, torch the reference everywhere (a fallback on a device) (engine/kv.py)",
             "kv_commit"),
    Variable(PROFILE_STEP, "1", "1 / true / yes / on / empty, 0 / false / no / off (any case)",
             "1: on a device vLLM's profiling run holds a dummy DSBD step at max_num_seqs, so the KV cache is sized "
             "with DSBD's working memory reserved; 0: vLLM's profiling run alone, as on the CPU (a fallback: lower "
             "--gpu-memory-utilization then) (engine/memory.py)", "profile_step"),
    Variable(PROMETHEUS_DIR, "", "a folder", "the front end's multiprocess metrics folder (engine/prometheus.py)",
             None, internal=True),
    Variable(PROMETHEUS_PID, "", "a process id", "the front end's pid (engine/prometheus.py)", None, internal=True),
)

NAMES: tuple[str, ...] = tuple(v.name for v in VARIABLES)
# what the runner reads when it is built (in this order: the first bad one is reported)
ENGINE: tuple[str, ...] = (FOREST_ATTENTION, STATIC_VERIFY, FUSED_VERIFY, STATIC_DRAFT, KV_COMMIT, PROFILE_STEP)


def _default_cache() -> pathlib.Path:
    return pathlib.Path.home() / ".cache" / "vllm-dsbd"


@dataclass(frozen=True)
class Env:
    """The parsed settings (the defaults: every variable unset)."""

    disable: bool = False  # VLLM_DSBD_DISABLE
    cache: pathlib.Path | None = None  # VLLM_DSBD_CACHE ('~' expanded); None: unset (see cache_dir)
    forest_attention: str = "kernel"  # VLLM_DSBD_FOREST_ATTENTION: "kernel", "torch" or "ref"
    beam_relayout: bool = True  # VLLM_DSBD_BEAM_RELAYOUT
    static_verify: bool | None = None  # VLLM_DSBD_STATIC_VERIFY: None = auto (on a device, not on the CPU)
    fused_verify: bool | None = None  # VLLM_DSBD_FUSED_VERIFY: None = auto (on CUDA); False = never
    static_draft: bool = True  # VLLM_DSBD_STATIC_DRAFT
    kv_commit: str = "auto"  # VLLM_DSBD_KV_COMMIT: "auto" (the kernel on CUDA) or "torch"
    profile_step: bool = True  # VLLM_DSBD_PROFILE_STEP

    def cache_dir(self) -> pathlib.Path:
        """The models' folder: ``cache``, else ~/.cache/vllm-dsbd (the home folder looked up only then)."""
        return self.cache if self.cache is not None else _default_cache()

    def static_verify_on(self, device) -> bool:
        """Whether the static verification paths are the default on ``device`` (a ``torch.device`` or a string)."""
        return _device_type(device) != "cpu" if self.static_verify is None else self.static_verify

    def fused_verify_on(self, device) -> bool:
        """Whether the static paths verify with the fused kernel on ``device`` (not combined with
        :meth:`static_verify_on`: beam sampling's layers use the kernel either way)."""
        return _device_type(device) == "cuda" if self.fused_verify is None else self.fused_verify


def _device_type(device) -> str:
    return device.type if hasattr(device, "type") else str(device).partition(":")[0]


# ---------------------------------------------------------------------------------------------------------------
# parsers: (environment) -> field value; the messages are the ones the tests and users know
def _disable(env: Mapping[str, str]) -> bool:
    raw = env.get(DISABLE, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in ("",) + _FALSE:
        return False
    raise ValueError(f"{DISABLE}={raw!r}: expected one of {_TRUE + _FALSE}")


def _cache(env: Mapping[str, str]) -> pathlib.Path | None:
    raw = env.get(CACHE)
    return pathlib.Path(raw).expanduser() if raw else None


def _forest_attention(env: Mapping[str, str]) -> str:
    v = env.get(FOREST_ATTENTION, "kernel")
    return v if v in ("ref", "torch") else "kernel"


def _beam_relayout(env: Mapping[str, str]) -> bool:
    return env.get(BEAM_RELAYOUT, "1") != "0"


def _static_verify(env: Mapping[str, str]) -> bool | None:
    v = env.get(STATIC_VERIFY, "auto").strip().lower()
    if v in ("", "auto"):
        return None
    if v in _TRUE + _FALSE:
        return v in _TRUE
    raise ValueError(f"{STATIC_VERIFY} must be auto, 1 or 0, got {v!r}")


def _fused_verify(env: Mapping[str, str]) -> bool | None:
    v = env.get(FUSED_VERIFY, "auto").strip().lower()
    if v in ("", "auto"):
        return None
    if v in _FALSE:
        return False
    raise ValueError(f"{FUSED_VERIFY} must be auto or 0, got {v!r}")


def _static_draft(env: Mapping[str, str]) -> bool:
    v = env.get(STATIC_DRAFT, "1").strip().lower()
    if v in ("",) + _TRUE + _FALSE:
        return v not in _FALSE
    raise ValueError(f"{STATIC_DRAFT} must be 1 or 0, got {v!r}")


def _kv_commit(env: Mapping[str, str]) -> str:
    v = env.get(KV_COMMIT, "auto").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v == "torch":
        return v
    raise ValueError(f"{KV_COMMIT} must be auto or torch, got {v!r}")


def _profile_step(env: Mapping[str, str]) -> bool:
    v = env.get(PROFILE_STEP, "1").strip().lower()
    if v in ("",) + _TRUE + _FALSE:
        return v not in _FALSE
    raise ValueError(f"{PROFILE_STEP} must be 1 or 0, got {v!r}")


_PARSERS = {DISABLE: _disable, CACHE: _cache, FOREST_ATTENTION: _forest_attention, BEAM_RELAYOUT: _beam_relayout,
            STATIC_VERIFY: _static_verify, FUSED_VERIFY: _fused_verify, STATIC_DRAFT: _static_draft,
            KV_COMMIT: _kv_commit, PROFILE_STEP: _profile_step}


def read(environ: Mapping[str, str] | None = None, only: Iterable[str] | None = None) -> Env:
    """The settings of ``environ`` (default ``os.environ``), parsed in the table's order; ValueError naming the first
    variable with a bad value. ``only``: parse just these variables (the others keep their defaults and are not
    looked at, so a bad value there is not reported)."""
    env = os.environ if environ is None else environ
    names = set(_PARSERS) if only is None else set(only)
    unknown = names - set(_PARSERS)
    if unknown:
        raise KeyError(f"not a DSBD setting: {sorted(unknown)}")
    by_name = {v.name: v for v in VARIABLES}
    values = {by_name[n].attr: _PARSERS[n](env) for n in _PARSERS if n in names}
    return Env(**values)


def describe() -> str:
    """The table as text (one variable per paragraph)."""
    return "\n\n".join(f"{v.name}{' (internal)' if v.internal else ''}: default {v.default or '(unset)'}; "
                       f"{v.accepted}.\n  {v.meaning}" for v in VARIABLES)
