"""The vLLM plugin (register, patches, CLI) and DSBDConfig, against the real vLLM 0.26.0 on CPU (no mocks of vLLM).

No engine is started: every check ends at ``EngineArgs.create_engine_config()`` (~0.5 s each) or in a short
subprocess (a fresh process is the only way to see what registration does before vLLM's modules are imported, or
what vLLM does without the plugin).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd import plugin  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402
from vllm_dsbd.config import DSBDConfig, uses_dsbd  # noqa: E402
from vllm_dsbd.requests import BeamParams, check_request, request_width  # noqa: E402

plugin.register()  # as vLLM's plugin loader would; everything below runs with the patches applied

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402
from vllm.config.speculative import SpeculativeConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs, get_kwargs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from vllm_dsbd import patches  # noqa: E402
from vllm_dsbd.patches import PatchError  # noqa: E402
from vllm_dsbd.patches.spec_method_literal import literal_values  # noqa: E402

ALLOWED = ["width", "depth", "min_width", "width_threshold", "dynamic_width", "mode", "draft", "verify_budget",
           "cost_model", "full_cuda_graphs", "beam_nodes", "sources", "max_beam_slots", "max_beam_width"]


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    target, draft = models.tiny_llama_pair()  # built once into the default cache, then reused
    return str(target), str(draft)


def build(target: str, speculative_config=None, **kwargs):
    args = EngineArgs(
        model=target, dtype="float32", enforce_eager=True, max_model_len=256, speculative_config=speculative_config,
        **kwargs,
    )
    return args, args.create_engine_config()


def run_python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter of this venv (cwd outside the repository, so that `import triton_kernels`
    cannot resolve to our kernels folder)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=240,
    )


# ----------------------------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------------------------
def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("dsbd") == "vllm_dsbd.plugin:register"


def test_register_is_reentrant():
    import vllm.v1.engine.input_processor  # noqa: F401  (their patches wait for these imports)
    import vllm.utils.cpu_triton_utils  # noqa: F401
    import vllm.v1.spec_decode.llm_base_proposer  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.metrics.loggers  # noqa: F401
    import vllm.entrypoints.generate.beam_search.offline  # noqa: F401
    import vllm.entrypoints.generate.beam_search.online  # noqa: F401
    import vllm.platforms.cpu  # noqa: F401
    import vllm.v1.executor.ray_executor_v2  # noqa: F401

    before = patches.applied()
    plugin.register()
    plugin.register()
    assert plugin.is_registered()
    assert patches.applied() == before
    targets = [r.target for r in before]
    assert len(targets) == len(set(targets))
    assert {r.patch_id for r in before} == set(patches.PATCHES)
    with pytest.raises(PatchError, match="refusing to apply it twice"):
        patches.apply_all()


def test_mechanism_refuses_double_patch():
    from vllm_dsbd.patches._patching import original, wrap_method

    with pytest.raises(PatchError, match="already patched by vllm_dsbd patch 'uses_draft_model'"):
        wrap_method("again", SpeculativeConfig, "uses_draft_model", lambda f: f)
    orig = original(SpeculativeConfig, "uses_draft_model")
    assert SpeculativeConfig.uses_draft_model.__wrapped__ is orig
    assert SpeculativeConfig.uses_draft_model.__dsbd_patch__ == "uses_draft_model"


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cpu", "0.26.0+cu130.x86"])
def test_version_check_accepts(version):
    plugin.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.27.0", "0.26.1", "0.26.0rc1", "0.26.0.dev3", "0.26", "10.26.0"])
def test_version_check_rejects(version):
    with pytest.raises(RuntimeError) as e:
        plugin.check_vllm_version(version)
    assert f"vLLM {version} is installed" in str(e.value) and "0.26.0" in str(e.value)
    assert plugin.DISABLE_ENV in str(e.value)


def test_installed_vllm_passes_the_check():
    from vllm.version import __version__

    plugin.check_vllm_version(__version__)


def test_disable_env(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_ENV, "yes")
    assert plugin.is_disabled()
    monkeypatch.setenv(plugin.DISABLE_ENV, "0")
    assert not plugin.is_disabled()
    monkeypatch.setenv(plugin.DISABLE_ENV, "maybe")
    with pytest.raises(ValueError, match=plugin.DISABLE_ENV):
        plugin.is_disabled()
    # disabled: register() imports nothing from vLLM and patches nothing
    out = run_python(
        """
        import sys
        from vllm_dsbd import patches, plugin
        plugin.register()
        assert not plugin.is_registered() and not patches.applied()
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vLLM was imported"
        print("ok")
        """,
        tmp_path, VLLM_DSBD_DISABLE="1",
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_register_with_other_vllm_version_logs_and_leaves_vllm_untouched(tmp_path):
    """Another vLLM version: an error in the log, no patch applied, and vLLM keeps working (raising would break every
    vLLM process of the environment)."""
    out = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        import vllm.version
        vllm.version.__version__ = "0.27.0"
        from vllm_dsbd import patches, plugin
        plugin.register()
        assert not plugin.is_registered() and not patches.applied(), patches.applied()
        from vllm.config.speculative import SpeculativeConfig
        from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
        assert not hasattr(BeamSearchOfflineMixin.beam_search, "__dsbd_patch__")
        assert "dsbd" not in str(SpeculativeConfig.__annotations__["method"])
        print("ok")
        """,
        tmp_path, VLLM_DSBD_DISABLE="0",
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert "vllm-dsbd supports vLLM 0.26.0 only, but vLLM 0.27.0 is installed" in out.stderr
    assert "ERROR" in out.stderr and "Not registering" in out.stderr


def test_fresh_process_through_vllm_plugin_loader(tmp_path):
    """vLLM's own loader finds the entry point; patches of modules not imported yet wait for their import, and the
    heavy proposer module is not imported by registration."""
    out = run_python(
        """
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm_dsbd import patches, plugin
        assert plugin.is_registered()
        # only env_names and the CPU platform's Ray key apply at once (vllm.envs and the current platform are imported
        # before plugins load); the rest waits for its module
        assert "vllm.config.speculative" not in sys.modules
        assert {r.target for r in patches.applied() if r.patch_id != "env_names"} == {
            "vllm.platforms.cpu.CpuPlatform.ray_device_key"}
        from vllm.config.speculative import SpeculativeConfig
        assert SpeculativeConfig.uses_draft_model.__dsbd_patch__ == "uses_draft_model"
        assert "vllm.v1.spec_decode.llm_base_proposer" not in sys.modules
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        assert SpecDecodeBaseProposer.model_returns_tuple.__dsbd_patch__ == "proposer_returns_tuple"
        from vllm.engine.arg_utils import EngineArgs
        assert EngineArgs.create_speculative_config.__dsbd_patch__ == "dsbd_knobs"
        from vllm.v1.engine.input_processor import InputProcessor
        assert InputProcessor._validate_params.__dsbd_patch__ == "request_validation"
        import vllm.utils.cpu_triton_utils as cpu_tl
        from vllm_dsbd.patches import cpu_expand_kernel
        assert cpu_tl.expand_kernel.func is cpu_expand_kernel.expand
        from vllm.v1.core.sched.scheduler import Scheduler
        assert Scheduler.make_spec_decoding_stats.__dsbd_patch__ == "spec_stats_depths"
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        assert PrometheusStatLogger.__init__.__dsbd_patch__ == "spec_stats_prometheus"
        assert Scheduler._free_request.__dsbd_patch__ == "beam_scheduler"
        from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
        assert BeamSearchOfflineMixin.beam_search.__dsbd_patch__ == "beam_search_route"
        from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
        assert BeamSearchOnlineMixin.beam_search.__dsbd_patch__ == "beam_serving_route"
        from vllm.platforms.cpu import CpuPlatform
        assert CpuPlatform.ray_device_key == "CPU"
        import vllm.v1.executor.ray_executor_v2 as ray_v2
        assert ray_v2.RayExecutorV2._get_actor_resource_kwargs.__dsbd_patch__ == "cpu_ray_executor"
        assert ray_v2.RayWorkerProc.__name__ == "CPURayWorkerProc"
        print(sorted({r.patch_id for r in patches.applied()}))
        """,
        tmp_path, VLLM_DSBD_DISABLE="0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(sorted(patches.PATCHES))


# ----------------------------------------------------------------------------------------------------------------
# patches seen through vLLM's own objects
# ----------------------------------------------------------------------------------------------------------------
def test_method_literal_accepts_dsbd_and_still_rejects_others():
    field = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}["method"]
    assert "dsbd" in literal_values(field.type) and "draft_model" in literal_values(field.type)
    assert "dsbd" in get_kwargs(SpeculativeConfig)["method"]["choices"]  # what --spec-method offers
    with pytest.raises(Exception, match="Input should be"):
        SpeculativeConfig(method="beam", num_speculative_tokens=3)


def test_spec_config_without_a_draft_model():
    """Patches spec_post_init, uses_draft_model and spec_repr on vLLM's own SpeculativeConfig: "dsbd" without a
    model is an engine without a draft (vLLM alone raises "without speculative model" / AttributeError in repr)."""
    sc = SpeculativeConfig(method="dsbd", num_speculative_tokens=3)
    assert (sc.method, sc.model, sc.draft_model_config, sc.draft_parallel_config) == ("dsbd", None, None, None)
    assert not sc.uses_draft_model() and sc.max_num_new_slots_for_drafting == 0
    assert repr(sc) == "SpeculativeConfig(method='dsbd', model=None, num_spec_tokens=3)"
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert repr(ngram) == "SpeculativeConfig(method='ngram', model=None, num_spec_tokens=2)"  # the original


def test_proposer_model_returns_tuple():
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SpecDecodeBaseProposer.__new__(SpecDecodeBaseProposer)  # only .method is read
    for method, expected in (("dsbd", False), ("draft_model", False), ("eagle", True)):
        proposer.method = method
        assert proposer.model_returns_tuple() is expected


def serve_parser() -> FlexibleArgumentParser:
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(FlexibleArgumentParser())  # what `vllm serve` builds (AsyncEngineArgs.add_cli_args)


def engine_args_from_cli(argv: list[str]) -> AsyncEngineArgs:
    args = serve_parser().parse_args(argv)
    args.model = args.model_tag  # as vllm.entrypoints.cli.serve does
    return AsyncEngineArgs.from_cli_args(args)


@pytest.mark.parametrize("flag", ["--speculative-method", "--spec-method"])
def test_cli_speculative_method_dsbd(pair, flag):
    target, draft = pair
    ea = engine_args_from_cli(
        [target, flag, "dsbd", "--spec-model", draft, "--spec-tokens", "3", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "256"]
    )
    assert (ea.spec_method, ea.spec_model, ea.spec_tokens) == ("dsbd", draft, 3)
    vc = ea.create_engine_config()
    spec = vc.speculative_config
    assert spec.method == "dsbd" and spec.uses_draft_model() and spec.draft_model_config.model == draft
    assert vc.additional_config["dsbd"] == DSBDConfig(depth=3).to_dict()
    # default width 2 x depth 3 forest slots + 1 beam leaf = 7, below the 63 leaves of a 64-beam request
    assert spec.num_speculative_tokens == max(2 * 3 + 1, 63)


def test_cli_additional_config_and_bad_method(pair, capsys):
    target, draft = pair
    ea = engine_args_from_cli(
        [target, "--speculative-method", "dsbd", "--spec-model", draft, "--spec-tokens", "2", "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "256", "--additional-config", '{"dsbd": {"width": 4, "mode": "single"}}']
    )
    vc = ea.create_engine_config()
    assert DSBDConfig.from_vllm_config(vc) == DSBDConfig(width=4, depth=2, mode="single")
    assert vc.speculative_config.num_speculative_tokens == max(4 * 2 + 3, 63)
    with pytest.raises(SystemExit):
        serve_parser().parse_args([target, "--speculative-method", "beam"])
    assert "invalid choice: 'beam'" in capsys.readouterr().err


def test_engine_args_dsbd(pair):
    target, draft = pair
    given = {"method": "dsbd", "model": draft, "num_speculative_tokens": 3, "width": 4}
    ea, vc = build(target, dict(given))
    spec = vc.speculative_config
    assert spec.method == "dsbd" and spec.uses_draft_model()
    assert spec.draft_model_config.model == draft
    assert spec.num_speculative_tokens == 63 and vc.num_speculative_tokens == 63  # max_beam_width - 1 > 15
    assert vc.additional_config["dsbd"] == {
        "width": 4, "depth": 3, "min_width": 1, "width_threshold": 0.9, "dynamic_width": True, "mode": "sample",
        "draft": True, "verify_budget": "auto", "cost_model": "auto", "full_cuda_graphs": False, "beam_nodes": None,
        "sources": ["model"], "max_beam_slots": None, "max_beam_width": 64,
    }
    cfg = DSBDConfig.from_vllm_config(vc)
    assert (cfg.width, cfg.depth, cfg.forest_slots, cfg.num_speculative_slots) == (4, 3, 15, 63) and uses_dsbd(vc)
    assert spec.max_num_new_slots_for_drafting == 1  # the draft-model path's extra slot per request
    assert vc.scheduler_config.async_scheduling is False  # DSBD's sampler is synchronous
    # the EngineArgs keep what the user gave; a second build gives the same config
    assert ea.speculative_config == given
    vc2 = ea.create_engine_config()
    assert vc2.speculative_config.num_speculative_tokens == 63
    assert vc2.additional_config == vc.additional_config


def test_knobs_from_additional_config(pair):
    target, draft = pair
    knobs = {"width": 3, "min_width": 2, "width_threshold": 0.5, "dynamic_width": False}
    _, vc = build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2},
                  additional_config={"dsbd": knobs, "other": 1})
    assert vc.additional_config["other"] == 1
    assert DSBDConfig.from_vllm_config(vc) == DSBDConfig(depth=2, **knobs)
    assert vc.speculative_config.num_speculative_tokens == max(3 * 2 + 2, 63)
    # the same key in both places must agree
    _, vc = build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2, "width": 3},
                  additional_config={"dsbd": {"width": 3}})
    assert DSBDConfig.from_vllm_config(vc).width == 3
    with pytest.raises(ValueError, match="'width' is given twice"):
        build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2, "width": 3},
              additional_config={"dsbd": {"width": 4}})
    with pytest.raises(ValueError, match="'depth'=4 disagrees with num_speculative_tokens=2"):
        build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2, "depth": 4})
    # depth alone (no num_speculative_tokens) is the draft depth
    _, vc = build(target, {"method": "dsbd", "model": draft, "depth": 4, "width": 1})
    assert vc.speculative_config.num_speculative_tokens == 63 and DSBDConfig.from_vllm_config(vc).depth == 4


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"widht": 4}, r"unknown key 'widht'; allowed keys: \['width', 'depth', 'min_width'"),
        ({"width": 0}, r"'width' must be an integer >= 1, got 0"),
        ({"width": 2.5}, r"'width' must be an integer >= 1, got 2.5"),
        ({"width_threshold": 1.5}, r"'width_threshold' must be a number in \(0, 1\], got 1.5"),
        ({"width_threshold": 0}, r"'width_threshold' must be a number in \(0, 1\], got 0"),
        ({"mode": "beam"}, r"'mode' must be one of \['sample', 'single', 'full'\], got 'beam'"),
        ({"mode": "full"}, r"full-width mode.*not available in the engine yet"),
        ({"min_width": 3, "width": 2}, r"'min_width' must be <= 'width' \(2\), got 3"),
        ({"dynamic_width": "yes"}, r"'dynamic_width' must be true or false"),
        ({"verify_budget": 0}, r"'verify_budget' must be 'auto' \(measured at start-up\), an integer >= 1"),
        ({"full_cuda_graphs": 1}, r"'full_cuda_graphs' must be true or false, got 1"),
        ({"verify_budget": "off"}, r"'verify_budget' must be 'auto'.*or null \(pinned.*got 'off'"),
        ({"verify_budget": 64, "mode": "single"}, r"'verify_budget' = 64 with mode='single'.*pinned"),
    ],
    ids=["typo", "width0", "width-float", "tau1.5", "tau0", "mode-beam", "mode-full", "min>width", "dyn-str",
         "budget0", "full-graphs-int", "budget-str", "budget-single"],
)
@pytest.mark.parametrize("where", ["speculative_config", "additional_config"])
def test_bad_knobs_fail_at_startup(pair, knobs, match, where):
    target, draft = pair
    spec = {"method": "dsbd", "model": draft, "num_speculative_tokens": 3}
    if where == "speculative_config":
        kwargs = {}
        spec.update(knobs)
    else:
        kwargs = {"additional_config": {"dsbd": knobs}}
    with pytest.raises(ValueError, match=match):
        build(target, spec, **kwargs)


def test_dsbd_plain_layout_and_mutually_exclusive_flags(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="'parallel_drafting'.*not supported with method 'dsbd'"):
        build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 3, "parallel_drafting": True})
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngineArgs(model=target, spec_method="dsbd", speculative_config={"method": "dsbd", "model": draft}
                   ).create_engine_config()
    with pytest.raises(ValueError, match="additional_config\\['dsbd'\\] must be a mapping"):
        build(target, {"method": "dsbd", "model": draft}, additional_config={"dsbd": 4})


@pytest.mark.parametrize("how", ["offline", "cli", "cli-additional-config"])
def test_engine_without_a_draft_model(pair, how):
    """No ``model`` and ``"sources": []``: an engine without forests (depth 0, max(1, W - 1) slots for a beam
    request's leaves, no draft config, not a draft-model engine), spelled offline and in `vllm serve`'s parser."""
    target, _ = pair
    if how == "offline":
        ea = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                        speculative_config={"method": "dsbd", "width": 4, "sources": []})
    else:
        extra = (["--speculative-config", '{"width": 4, "sources": []}'] if how == "cli"
                 else ["--additional-config", '{"dsbd": {"width": 4, "sources": []}}'])
        ea = engine_args_from_cli([target, "--speculative-method", "dsbd", *extra, "--dtype", "float32",
                                   "--enforce-eager", "--max-model-len", "256"])
    vc = ea.create_engine_config()
    spec = vc.speculative_config
    assert DSBDConfig.from_vllm_config(vc) == DSBDConfig(width=4, depth=0, draft=False, sources=[])
    assert vc.additional_config["dsbd"]["draft"] is False and vc.additional_config["dsbd"]["depth"] == 0
    assert spec.method == "dsbd" and spec.model is None and spec.draft_model_config is None
    assert spec.num_speculative_tokens == 63 and not spec.uses_draft_model()  # a 64-beam request's leaves
    assert spec.max_num_new_slots_for_drafting == 0  # no extra slot per request for a draft
    assert "speculative_config=SpeculativeConfig(method='dsbd', model=None, num_spec_tokens=63)" in str(vc)
    assert ea.create_engine_config().additional_config == vc.additional_config  # a second build: the same


def test_engine_without_a_draft_model_refuses_draft_settings(pair):
    target, draft = pair
    _, vc = build(target, {"method": "dsbd", "width": 1, "sources": []})
    assert vc.speculative_config.num_speculative_tokens == 63  # a 64-beam request's leaves
    _, vc = build(target, {"method": "dsbd", "depth": 0, "width": 2, "sources": []},
                  additional_config={"dsbd": {"draft": False}})
    assert DSBDConfig.from_vllm_config(vc) == DSBDConfig(width=2, draft=False, sources=[])
    for spec, match in (
        ({"method": "dsbd", "num_speculative_tokens": 3, "sources": []},
         r"= 3 needs a forest source, and this engine has none \('sources': \[\]\)"),
        ({"method": "dsbd", "depth": 2, "sources": []}, r"= 2 needs a forest source"),
        ({"method": "dsbd", "sources": ["model"]}, r"names 'model' and this engine has no draft model"),
        ({"method": "dsbd", "mode": "single"}, r"'mode'='single' keeps beams in draft layers"),
        ({"method": "dsbd", "draft": True}, r"'draft'=True disagrees with speculative_config\['model'\]=None"),
        ({"method": "dsbd", "model": draft, "draft": False}, r"'draft'=False disagrees"),
    ):
        with pytest.raises(ValueError, match=match):
            build(target, spec)
    with pytest.raises(ValueError, match=r"= 3 needs a forest source"):  # --spec-tokens, no --spec-model, no source
        engine_args_from_cli([target, "--speculative-method", "dsbd", "--spec-tokens", "3", "--speculative-config",
                              '{"sources": []}', "--dtype", "float32", "--enforce-eager", "--max-model-len",
                              "256"]).create_engine_config()


def test_dsbd_config_without_a_draft():
    cfg = DSBDConfig(width=4, draft=False, sources=[])
    assert (cfg.depth, cfg.forest_slots, cfg.num_speculative_slots, cfg.drafting) == (0, 3, 63, False)
    # W - 1 = 0 leaves, but vLLM needs >= 1
    assert DSBDConfig(width=1, draft=False, sources=(), max_beam_width=1).num_speculative_slots == 1
    assert DSBDConfig.from_dict(cfg.to_dict()) == cfg == DSBDConfig(width=4, depth=0, draft=False, sources=[])
    assert (DSBDConfig().depth, DSBDConfig(depth=None).depth) == (3, 3)  # with a draft model: depth 3 by default


# A fingerprint of what vLLM builds, run in this process (plugin registered) and in one without the plugin.
FINGERPRINT = """
import json
from vllm.engine.arg_utils import EngineArgs
def fingerprint(target, draft):
    out = {}
    for name, spec in (("plain", None), ("draft_model", {"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": 3})):
        ea = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                        speculative_config=spec)
        vc = ea.create_engine_config()
        sc = vc.speculative_config
        out[name] = {
            "hash": vc.compute_hash(), "str": str(vc), "additional_config": vc.additional_config,
            "async": vc.scheduler_config.async_scheduling,
            "max_num_scheduled_tokens": vc.scheduler_config.max_num_scheduled_tokens,
            "spec": None if sc is None else [repr(sc), sc.method, sc.num_speculative_tokens, sc.uses_draft_model(),
                                             sc.max_num_new_slots_for_drafting, sc.compute_hash()],
        }
    return out
"""


def test_non_dsbd_configs_unchanged_by_plugin(pair, tmp_path):
    target, draft = pair
    namespace: dict = {}
    exec(FINGERPRINT, namespace)
    with_plugin = namespace["fingerprint"](target, draft)
    assert with_plugin["plain"]["spec"] is None and "dsbd" not in with_plugin["plain"]["additional_config"]
    assert with_plugin["draft_model"]["spec"][1:4] == ["draft_model", 3, True]
    out = run_python(
        FINGERPRINT + f"\nprint('FP=' + json.dumps(fingerprint({target!r}, {draft!r})))",
        tmp_path, VLLM_DSBD_DISABLE="1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    without = json.loads(out.stdout.split("FP=")[-1])
    assert with_plugin == without


# ----------------------------------------------------------------------------------------------------------------
# DSBDConfig and per-request width (no vLLM config needed)
# ----------------------------------------------------------------------------------------------------------------
def test_dsbd_config_defaults_and_roundtrip():
    cfg = DSBDConfig()
    assert (cfg.width, cfg.depth, cfg.min_width, cfg.width_threshold, cfg.dynamic_width, cfg.mode) == (
        2, 3, 1, 0.9, True, "sample"
    )
    assert cfg.forest_slots == 7 and cfg.num_speculative_slots == 63
    assert list(DSBDConfig.keys()) == ALLOWED
    assert DSBDConfig.from_dict(None) == cfg == DSBDConfig.from_dict({})
    other = DSBDConfig.from_dict({"width": 5, "depth": 1, "width_threshold": 1, "min_width": 5})
    assert other.width_threshold == 1.0 and isinstance(other.width_threshold, float)
    assert DSBDConfig.from_dict(other.to_dict()) == other
    assert json.loads(json.dumps(other.to_dict())) == other.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.width = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"widht": 4, "mode2": 1}, r"unknown keys 'widht', 'mode2'; allowed keys"),
        ([("width", 2)], r"must be a mapping"),
        ({"depth": 0}, r"'depth' must be an integer >= 1"),
        ({"width": True}, r"'width' must be an integer >= 1, got True"),
        ({"min_width": 0}, r"'min_width' must be an integer >= 1"),
        ({"width_threshold": "0.5"}, r"'width_threshold' must be a number"),
        ({"width_threshold": True}, r"'width_threshold' must be a number"),
        ({"dynamic_width": 1}, r"'dynamic_width' must be true or false, got 1"),
        ({"mode": None}, r"'mode' must be one of"),
        ({"draft": "no"}, r"'draft' must be true or false, got 'no'"),
        ({"draft": False, "depth": 2, "sources": []},
         r"'depth' \(num_speculative_tokens: the draft depth\) = 2 needs a forest source"),
        ({"sources": "recycle"}, r"'sources' must be a list of distinct names"),
        ({"draft": False, "sources": ["recycle", "recycle"]}, r"'sources' must be a list of distinct names"),
        ({"draft": False, "sources": ["suffix"]}, r"'sources' must be a list of distinct names from \['model'"),
        ({"sources": ["recycle"]}, r"leaves out 'model' and the engine has a draft model"),
        ({"draft": False, "mode": "single"}, r"'mode'='single' keeps beams in draft layers and needs a draft model"),
        ({"draft": False, "width": 0}, r"'width' must be an integer >= 1, got 0"),
        ({"verify_budget": 12.5}, r"'verify_budget' must be 'auto'.*got 12.5"),
        ({"verify_budget": True}, r"'verify_budget' must be 'auto'.*got True"),
        ({"verify_budget": -3}, r"'verify_budget' must be 'auto'.*got -3"),
        ({"draft": False, "depth": 0, "verify_budget": 32, "sources": []},
         r"'verify_budget' = 32 shrinks draft forests, and this engine has no forest source"),
        ({"cost_model": "on"}, r"'cost_model' must be 'auto' \(measured at start-up\), null \(off\) or a table"),
        ({"cost_model": {"target_ms": {1: 5}}}, r"'cost_model' must be 'auto'.*got \{'target_ms'"),
        ({"cost_model": {"target_ms": {0: 5}, "draft_ms": {1: 1}}}, r"'cost_model' must be 'auto'"),
        ({"cost_model": {"target_ms": {1: -5}, "draft_ms": {1: 1}}}, r"'cost_model' must be 'auto'"),
        ({"cost_model": {"target_ms": {1: 5}, "draft_ms": {1: 1}, "step_ms": True}}, r"'cost_model' must be 'auto'"),
        ({"cost_model": {"target_ms": {1: 5}, "draft_ms": {1: 1}, "other": 1}}, r"'cost_model' must be 'auto'"),
        ({"cost_model": {"target_ms": {1: 5}, "draft_ms": {1: 1}}, "mode": "single"},
         r"a 'cost_model' table chooses draft depths, and this engine is in mode 'single'"),
        ({"draft": False, "depth": 0, "sources": [], "cost_model": {"target_ms": {1: 5}, "draft_ms": {1: 1}}},
         r"a 'cost_model' table chooses draft depths, and this engine has no forest source"),
    ],
)
def test_dsbd_config_rejects(d, match):
    with pytest.raises(ValueError, match=match):
        DSBDConfig.from_dict(d)


def test_beam_nodes_setting_and_slots():
    """``beam_nodes`` (N): None by default (each beam request's width), else an integer >= width; the scheduler's
    slots per request are N * depth + width - 1; refused below the width, as a non-integer, or without a draft."""
    assert DSBDConfig(width=4).beam_nodes is None and DSBDConfig(width=4).max_beam_nodes == 4
    assert DSBDConfig(width=4, depth=3, max_beam_width=4).num_speculative_slots == 4 * 3 + 3
    cfg = DSBDConfig.from_dict({"width": 4, "depth": 3, "beam_nodes": 16})
    assert cfg.max_beam_nodes == 16 and cfg.forest_slots == 16 * 3 + 3 and cfg.num_speculative_slots == 63
    assert DSBDConfig.from_dict(cfg.to_dict()) == cfg
    for bad, match in ((3, r"'beam_nodes' must be an integer >= 'width' \(4\) or null"),
                       (True, r"'beam_nodes' must be an integer >= 'width'"),
                       (8.0, r"'beam_nodes' must be an integer")):
        with pytest.raises(ValueError, match=match):
            DSBDConfig(width=4, beam_nodes=bad)
    with pytest.raises(ValueError, match=r"'beam_nodes' = 8 sets the nodes per depth .* no forest source"):
        DSBDConfig(width=4, draft=False, beam_nodes=8, sources=[])
    assert DSBDConfig(width=4, draft=False, beam_nodes=8).forest_slots == 8 * 3 + 3  # draft-free sources


def test_max_beam_width_setting_and_slots():
    """``max_beam_width``: the most beams of a beam request, apart from ``width``; None (default) is 64 (or ``width``
    when larger, or with ``full_cuda_graphs``); the scheduler's slots per request are the larger of a full forest
    step's and the widest beam request's leaves; refused below 1 or as a non-integer."""
    for kw, beams, slots in (({}, 64, 63), ({"width": 128, "draft": False, "sources": []}, 128, 127),
                             ({"max_beam_width": 8}, 8, 7),
                             ({"max_beam_width": 1}, 1, 7), ({"full_cuda_graphs": True}, 2, 7),
                             ({"draft": False, "sources": [], "max_beam_width": 16}, 16, 15),
                             ({"width": 4, "beam_nodes": 32}, 64, 32 * 3 + 3)):
        cfg = DSBDConfig(**kw)
        assert (cfg.max_beam_width, cfg.num_speculative_slots) == (beams, slots), kw
        assert DSBDConfig.from_dict(cfg.to_dict()) == cfg
    assert "beam request of up to 64 beams" in DSBDConfig().describe()
    for bad in (0, 2.0, True, "64"):
        with pytest.raises(ValueError, match=r"'max_beam_width' must be an integer >= 1"):
            DSBDConfig(max_beam_width=bad)


def test_max_beam_slots_setting():
    """``max_beam_slots``: None by default (the slot length is max_model_len), else an integer >= 1; the engine's slot
    length is the larger of it and max_model_len; refused as a non-integer or below 1."""
    assert DSBDConfig(width=4).max_beam_slots is None and DSBDConfig(width=4).slot_len(256) == 256
    cfg = DSBDConfig.from_dict({"width": 4, "max_beam_slots": 4096})
    assert cfg.slot_len(256) == 4096 and cfg.slot_len(8192) == 8192 and DSBDConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (0, True, 8.0, "4096"):
        with pytest.raises(ValueError, match=r"'max_beam_slots' must be an integer >= 1"):
            DSBDConfig(width=4, max_beam_slots=bad)


def test_beam_nodes_reach_the_engine_config(pair):
    target, draft = pair
    _, vc = build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2, "width": 2,
                           "beam_nodes": 8})
    cfg = DSBDConfig.from_vllm_config(vc)
    assert cfg.beam_nodes == 8 and vc.speculative_config.num_speculative_tokens == max(8 * 2 + 1, 63)


def test_verify_budget_settings_and_when_speculation_is_load_aware():
    assert DSBDConfig().verify_budget == "auto" and DSBDConfig().load_aware  # on by default
    for budget in ("auto", 1, 256):
        cfg = DSBDConfig.from_dict({"verify_budget": budget})
        assert cfg.load_aware and DSBDConfig.from_dict(cfg.to_dict()) == cfg
    assert not DSBDConfig(verify_budget=None).load_aware  # pinned
    assert not DSBDConfig(mode="single").load_aware  # "auto" (the default) in mode single: pinned
    assert not DSBDConfig(width=4, draft=False, sources=[]).load_aware  # no forest source: nothing to shrink
    assert DSBDConfig(width=4, draft=False).load_aware  # draft-free sources: their forests shrink
    assert json.loads(json.dumps(DSBDConfig(verify_budget=None).to_dict()))["verify_budget"] is None


def test_cost_model_settings_and_when_it_chooses_depths():
    assert DSBDConfig().cost_model == "auto" and DSBDConfig().cost_aware  # on by default
    assert not DSBDConfig(cost_model=None).cost_aware and DSBDConfig(cost_model=None).load_aware  # off: budget only
    assert not DSBDConfig(verify_budget=None).cost_aware  # pinned shapes: the cost model is off too
    assert not DSBDConfig(mode="single").cost_aware and not DSBDConfig(width=4, draft=False, sources=[]).cost_aware
    assert DSBDConfig(width=4, draft=False).cost_aware  # draft-free sources: the cost model chooses their depths
    # a pinned table: token counts as JSON keys (strings), times as floats; it survives to_dict / JSON / from_dict
    cfg = DSBDConfig.from_dict({"cost_model": {"target_ms": {1: 5, 8: 6}, "draft_ms": {"1": 1}, "step_ms": 2}})
    assert cfg.cost_aware and cfg.cost_model == {"target_ms": {"1": 5.0, "8": 6.0}, "draft_ms": {"1": 1.0},
                                                 "step_ms": 2.0}
    assert DSBDConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("where", ["speculative_config", "additional_config", "cli"])
def test_verify_budget_reaches_the_engine_config(pair, where):
    target, draft = pair
    spec = {"method": "dsbd", "model": draft, "num_speculative_tokens": 3}
    if where == "cli":
        ea = engine_args_from_cli([target, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                                   "--speculative-config", json.dumps({**spec, "verify_budget": None})])
        vc = ea.create_engine_config()
        assert DSBDConfig.from_vllm_config(vc).verify_budget is None
        return
    kwargs = {"additional_config": {"dsbd": {"verify_budget": 48}}} if where == "additional_config" else {}
    _, vc = build(target, {**spec, "verify_budget": 48} if where == "speculative_config" else spec, **kwargs)
    cfg = DSBDConfig.from_vllm_config(vc)
    assert cfg.verify_budget == 48 and cfg.load_aware
    assert vc.speculative_config.num_speculative_tokens == 63  # the slots do not depend on the budget


def test_from_vllm_config_checks():
    class Spec:
        method = "dsbd"
        model = "d"
        num_speculative_tokens = 63  # max(width 2 * depth 3 + width 2 - 1, max_beam_width 64 - 1)

    class VC:
        speculative_config = Spec()
        additional_config = {"dsbd": {"width": 2, "depth": 3}}

    assert DSBDConfig.from_vllm_config(VC()) == DSBDConfig(width=2, depth=3)
    VC.additional_config = {"dsbd": {"width": 2, "depth": 2, "max_beam_width": 2}}
    with pytest.raises(ValueError, match=r"num_speculative_tokens=63 but DSBD needs 5 slots: the larger of N\*depth "
                                         r"\+ width-1 = 5 \(N = beam_nodes or width = 2, width 2, depth 2\) and "
                                         r"max_beam_width-1 = 1"):
        DSBDConfig.from_vllm_config(VC())
    VC.additional_config = {}
    with pytest.raises(ValueError, match="additional_config\\['dsbd'\\] is missing"):
        DSBDConfig.from_vllm_config(VC())
    VC.additional_config = {"dsbd": {"width": 2, "draft": False}}
    with pytest.raises(ValueError, match=r"\['draft'\] is False but the engine's speculative_config.model is 'd'"):
        DSBDConfig.from_vllm_config(VC())
    Spec.model = None
    VC.additional_config = {"dsbd": {"width": 2, "draft": False, "sources": [], "max_beam_width": 2}}
    with pytest.raises(ValueError, match=r"num_speculative_tokens=63 but DSBD needs 1 slots: the larger of "
                                         r"max\(1, width-1\) = 1 \(width 2, no forest source\)"):
        DSBDConfig.from_vllm_config(VC())
    Spec.num_speculative_tokens = 1
    assert DSBDConfig.from_vllm_config(VC()) == DSBDConfig(width=2, draft=False, sources=[], max_beam_width=2)
    Spec.method = "draft_model"
    assert not uses_dsbd(VC())
    with pytest.raises(ValueError, match="not a DSBD engine"):
        DSBDConfig.from_vllm_config(VC())


def test_request_width():
    cfg = DSBDConfig(width=4)
    assert request_width(SamplingParams(), cfg) == 4
    assert request_width(SamplingParams(extra_args={"other": 1}), cfg) == 4
    assert request_width(SamplingParams(extra_args={"dsbd_width": None}), cfg) == 4
    for k in (1, 3, 4):
        assert request_width(SamplingParams(extra_args={"dsbd_width": k}), cfg) == k
    for bad in (0, 5, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match=r"extra_args\['dsbd_width'\] must be an integer in \[1, 4\]"):
            request_width(SamplingParams(extra_args={"dsbd_width": bad}), cfg)


REFUSED_SETTINGS = {"thinking_token_budget": 8}
# applied to plain requests per forest node (engine/processors.py), refused on beam requests (vLLM's beam search has
# none)
RULE_SETTINGS = {"min_p": 0.1, "min_tokens": 3, "logit_bias": {5: 1.0}, "allowed_token_ids": [1, 2, 3],
                 "bad_words": ["x"]}


def test_check_request_refuses_what_dsbd_does_not_apply():
    cfg = DSBDConfig(width=4)
    # what the DSBD sampler applies passes
    ok = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, stop=["x"], stop_token_ids=[2], logprobs=5,
                        max_tokens=7, ignore_eos=True, extra_args={"dsbd_width": 2})
    assert check_request(ok, cfg) == 2
    assert check_request(SamplingParams(), cfg) == 4
    for name, value in REFUSED_SETTINGS.items():
        with pytest.raises(ValueError, match=rf"^{name}: not supported with speculative method 'dsbd'"):
            check_request(SamplingParams(**{name: value}), cfg)
    with pytest.raises(ValueError, match=r"^thinking_token_budget: not supported"):
        check_request(SamplingParams(presence_penalty=1.0, min_p=0.2, prompt_logprobs=1, thinking_token_budget=4), cfg)
    # served on plain requests (engine/runner.py), refused on beam requests (vLLM's beam search returns neither)
    assert check_request(SamplingParams(prompt_logprobs=2, logprob_token_ids=[1, 5]), cfg) == 4
    with pytest.raises(ValueError, match=r"^prompt_logprobs, logprob_token_ids: not supported on a beam request"):
        check_request(_beam_sp({"width": 2, "max_tokens": 8}, prompt_logprobs=1, logprob_token_ids=[3]), cfg)
    assert check_request(SamplingParams(temperature=0.5, **RULE_SETTINGS), cfg) == 4
    for name, value in RULE_SETTINGS.items():
        with pytest.raises(ValueError, match=rf"^{name}: not applied to a beam request .*vLLM's beam search has no"):
            check_request(_beam_sp({"width": 2, "max_tokens": 8}, **{name: value}), cfg)
    # penalties are applied to plain requests (engine/penalties.py), refused on beam requests (vLLM's beam search has
    # none), with the way out named
    pens = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    assert check_request(SamplingParams(**pens), cfg) == 4
    for name, value in pens.items():
        with pytest.raises(ValueError, match=rf"^{name}: not applied to a beam request .*--generation-config vllm"):
            check_request(_beam_sp({"width": 2, "max_tokens": 8}, **{name: value}), cfg)
    neutral = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    assert check_request(_beam_sp({"width": 2, "max_tokens": 8}, **neutral), cfg) == 4
    with pytest.raises(ValueError, match=r"dsbd_width"):
        check_request(SamplingParams(extra_args={"dsbd_width": 9}), cfg)
    # structured outputs: served on a plain request and on beam search (T = 0, no forest); refused on beam sampling
    # (T > 0) and with a pinned draft depth, with the reason
    so = StructuredOutputsParams(regex="[ab]+")
    assert check_request(SamplingParams(structured_outputs=so), cfg) == 4
    assert check_request(_beam_sp({"width": 2, "max_tokens": 8}, structured_outputs=so, temperature=0.0), cfg) == 4
    with pytest.raises(ValueError, match=r"^structured_outputs: not supported on a beam request .*temperature > 0"):
        check_request(_beam_sp({"width": 2, "max_tokens": 8}, structured_outputs=so, temperature=0.5), cfg)
    with pytest.raises(ValueError, match=r"\['depth'\] = 2: a beam request with structured_outputs drafts no forest"):
        check_request(_beam_sp({"width": 2, "max_tokens": 8, "depth": 2}, structured_outputs=so, temperature=0.0),
                      cfg)
    with pytest.raises(ValueError, match=r"^structured_outputs: not supported with .*'num_beam_groups'\] = 2"):
        check_request(_beam_sp({"width": 2, "max_tokens": 8, "num_beam_groups": 2}, structured_outputs=so,
                               temperature=0.0), cfg)


def _beam_sp(beam, **kw):
    """SamplingParams of a well-formed explicit beam request (room for the trie, vLLM never stops it on EOS)."""
    return SamplingParams(**{"max_tokens": 100, "ignore_eos": True, **kw}, extra_args={"dsbd_beam": beam})


def test_beam_depth_on_an_engine_without_a_draft_is_refused():
    cfg = DSBDConfig(width=4, draft=False, sources=[])
    beam = {"width": 4, "max_tokens": 8}
    assert check_request(_beam_sp(beam), cfg) == 4
    assert check_request(_beam_sp({**beam, "depth": 0}), cfg) == 4
    with pytest.raises(ValueError, match=r"^extra_args\['dsbd_beam'\]\['depth'\] = 2: this DSBD engine has no forest"):
        check_request(_beam_sp({**beam, "depth": 2}), cfg)
    assert check_request(_beam_sp({**beam, "depth": 2}), DSBDConfig(width=4, draft=False)) == 4  # sources
    assert check_request(_beam_sp({**beam, "depth": 2}), DSBDConfig(width=4)) == 4


def test_beam_request_nodes_are_checked_against_the_engine():
    """``dsbd_beam.nodes`` (N): from the request's width up to the engine's ``beam_nodes`` (its width when unset)."""
    beam = {"width": 2, "max_tokens": 8}
    assert check_request(_beam_sp({**beam, "nodes": 16}), DSBDConfig(width=4, beam_nodes=16)) == 4  # engine width
    assert check_request(_beam_sp({**beam, "nodes": 4}), DSBDConfig(width=4)) == 4  # unset beam_nodes: N <= 4
    with pytest.raises(ValueError, match=r"\['nodes'\] = 32 is above the engine's 16 draft nodes per depth"):
        check_request(_beam_sp({**beam, "nodes": 32}), DSBDConfig(width=4, beam_nodes=16))
    with pytest.raises(ValueError, match=r"\['nodes'\] = 8 is above the engine's 4 draft nodes"):
        check_request(_beam_sp({**beam, "nodes": 8}), DSBDConfig(width=4))
    with pytest.raises(ValueError, match=r"\['nodes'\] must be an integer in \[2, 16\], got 1"):
        check_request(_beam_sp({**beam, "nodes": 1}), DSBDConfig(width=4, beam_nodes=16))


def test_beam_request_that_vllm_would_stop_early_is_refused():
    """vLLM ends a request at its own max_tokens and on EOS; a beam request's trie takes up to width + 1 slots a step,
    and with EOS an ordinary beam token it may land among them: either would end the request with no beams."""
    cfg = DSBDConfig(width=4)
    beam = {"width": 4, "max_tokens": 8}  # trie: up to 8 * 5 + 2 = 42 slots
    assert check_request(_beam_sp(beam, max_tokens=42), cfg) == 4
    with pytest.raises(ValueError, match=r"^max_tokens: a beam request of width 4 and 8 tokens needs max_tokens >= 42"):
        check_request(_beam_sp(beam, max_tokens=41), cfg)
    # EOS: vLLM ignores it, or the beams finish on it (it never enters the trie)
    assert check_request(_beam_sp({**beam, "eos_token_id": 2}, ignore_eos=False), cfg) == 4
    for b in (beam, {**beam, "eos_token_id": 2, "ignore_eos": True}):
        with pytest.raises(ValueError, match=r"^ignore_eos: a beam request needs ignore_eos=True"):
            check_request(_beam_sp(b, ignore_eos=False), cfg)


def test_logprobs_on_a_beam_request():
    """A beam request's logprobs are its best beam's, filled in when it finishes (patches/beam_outputs.py): served
    up to 2W at T = 0 (the 2W best tokens of each row), the chosen tokens' only (logprobs 0) at T > 0; refused
    above 2W, above 0 at T > 0 and on a streamed (DELTA) request, whose chunks before the last would carry none."""
    cfg = DSBDConfig(width=4)
    beam = {"width": 2, "max_tokens": 4}
    assert check_request(SamplingParams(logprobs=2), cfg) == 4
    assert check_request(_beam_sp(beam), cfg) == 4
    for n in (0, 2, 4):
        assert check_request(_beam_sp(beam, logprobs=n, temperature=0.0), cfg) == 4
    assert check_request(_beam_sp(beam, logprobs=0, temperature=1.0), cfg) == 4
    with pytest.raises(ValueError, match=r"^logprobs: a beam request of width 2 returns at most 4 alternatives"):
        check_request(_beam_sp(beam, logprobs=5, temperature=0.0), cfg)
    with pytest.raises(ValueError, match=r"^logprobs: alternatives \(logprobs = 2 > 0\) on a beam request at "
                                         r"temperature > 0"):
        check_request(_beam_sp(beam, logprobs=2, temperature=1.0), cfg)
    with pytest.raises(ValueError, match=r"^logprobs: not supported on a streamed beam request"):
        check_request(_beam_sp(beam, logprobs=1, temperature=0.0, output_kind=RequestOutputKind.DELTA), cfg)


def test_stop_conditions_on_a_beam_request_are_refused():
    """vLLM checks stop strings on a request's output text (for a beam request: its settled prefix) and stop token ids
    on the tokens it appends (trie slots): either could end a beam request with no beams; plain requests keep them."""
    cfg = DSBDConfig(width=4)
    beam = {"width": 2, "max_tokens": 4}
    assert check_request(SamplingParams(stop=["\n"], stop_token_ids=[7]), cfg) == 4
    assert check_request(_beam_sp(beam, stop=[], stop_token_ids=[]), cfg) == 4
    for name, value in (("stop", ["\n"]), ("stop", "end"), ("stop_token_ids", [7])):
        with pytest.raises(ValueError, match=rf"^{name}: not supported on a beam request"):
            check_request(_beam_sp(beam, **{name: value}), cfg)


def test_unknown_dsbd_request_key_is_refused():
    cfg = DSBDConfig(width=4)
    with pytest.raises(ValueError, match=r"^extra_args: unknown DSBD key 'dsbd_widht'; the DSBD request keys are"):
        check_request(SamplingParams(extra_args={"dsbd_widht": 2}), cfg)
    assert check_request(SamplingParams(extra_args={"other_plugin_key": 1, "dsbd_width": 3}), cfg) == 3


def test_dsbd_environment_variables_are_known_to_vllm(monkeypatch):
    """Patch env_names: with every VLLM_DSBD_* variable set, vLLM's strict environment check passes (it raised
    "Unknown vLLM environment variable detected" for them, and warned in every process of a DSBD server)."""
    import vllm.envs as envs
    from vllm_dsbd.patches.env_names import NAMES

    plugin.register()
    for name in list(os.environ):  # other tests leave vLLM's own undeclared names (VLLM_DIST_IDENT): not ours
        if name.startswith("VLLM_"):
            monkeypatch.delenv(name)
    for name in NAMES:
        monkeypatch.setenv(name, "0")
    envs.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_DSBD_NOT_A_SETTING", "1")  # the check is live: a name nobody declared still fails
    with pytest.raises(ValueError, match="VLLM_DSBD_NOT_A_SETTING"):
        envs.validate_environ(hard_fail=True)


def test_beam_stops_are_parsed_at_every_temperature():
    """``extra_args['dsbd_beam']`` ``stop_token_ids`` / ``stop`` / ``include_stop_str_in_output``: parsed (a string is
    one stop string), bad values named, served on beam search (temperature 0) and beam sampling (temperature > 0)."""
    cfg = DSBDConfig(width=4)
    beam = {"width": 2, "max_tokens": 4, "stop_token_ids": [7, 9], "stop": "end", "include_stop_str_in_output": True}
    bp = BeamParams.parse(beam, 4)
    assert (bp.stop_token_ids, bp.stop, bp.include_stop_str_in_output) == ((7, 9), ("end",), True)
    assert BeamParams.parse(bp.to_dict(), 4) == bp
    assert check_request(_beam_sp(beam, temperature=0.0), cfg) == 4
    assert check_request(_beam_sp(beam, temperature=0.7), cfg) == 4
    for key, value in (("stop_token_ids", [-1]), ("stop_token_ids", 7), ("stop", [""]), ("stop", [3]),
                       ("include_stop_str_in_output", 1)):
        with pytest.raises(ValueError, match=rf"\['{key}'\]"):
            BeamParams.parse({"width": 2, "max_tokens": 4, key: value}, 4)


def test_eagle3_head_is_recognised_by_its_architecture(pair, tmp_path):
    """Patches spec_post_init and spec_hash_head on vLLM's own configs: a head in the public EAGLE-3 format is built as
    vLLM builds an "eagle3" draft (``EAGLEConfig``, ``LlamaForCausalLMEagle3``) whatever its path (here one vLLM's
    detection by path would take for an EAGLE-1 head, "eagle-"), the method stays "dsbd", and the config hashes as
    vLLM's "eagle3" (not as a plain-draft "dsbd" engine: the compiled target differs)."""
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm_dsbd.testing.heads import head_folder

    target, draft = pair
    head = head_folder(target, tmp_path / "eagle-head", draft_vocab=500, seed=0)
    _, cfg = build(target, {"method": "dsbd", "model": str(head), "num_speculative_tokens": 2, "width": 2})
    sc = cfg.speculative_config
    assert sc.method == "dsbd" and sc.uses_draft_model()
    assert isinstance(sc.draft_model_config.hf_config, EAGLEConfig)
    assert sc.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]
    assert sc.draft_model_config.hf_config.draft_vocab_size == 500
    _, plain = build(target, {"method": "dsbd", "model": draft, "num_speculative_tokens": 2, "width": 2})
    assert plain.speculative_config.compute_hash() != sc.compute_hash()
    sc.method = "eagle3"
    try:
        eagle3_hash = type(sc).compute_hash.__wrapped__(sc)  # vLLM's own hash of the same config as "eagle3"
    finally:
        sc.method = "dsbd"
    assert eagle3_hash == sc.compute_hash()
