"""The benchmark harness's runs: which configurations exist and how one runs through vLLM (for ``harness.py``).

Every configuration is one vLLM engine (``plain`` also runs vLLM's ``LLM.beam_search``), started, warmed up, timed
on one ``generate`` over all prompts with per-prompt seeds, measured from vLLM's metrics (deltas around the timed
call), and shut down before the next. Target passes: one per engine step per request: DSBD's are counted by the
engine (``vllm:dsbd_target_passes``); vLLM ``draft_model``'s are the prefill plus one per verified draft (vLLM's
``vllm:spec_decode_num_drafts``); plain sampling makes one per generated token; beam search one per beam step
(counted per token of the best beam).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_dsbd.testing.engines import shutdown  # harness.py calls runs.shutdown


@dataclass
class Config:
    name: str
    kind: str  # "plain" | "beam_search" | "draft_model" | "dsbd"
    width: int = 1
    depth: int = 0
    dynamic: bool = False
    mode: str = "sample"  # DSBD: "sample" (exact target sampling, the default) or "single" (the paper's, opt-in)
    pinned: bool = False  # DSBD mode "sample": pinned shapes (cost model and verify budget off), not the cost model


@dataclass
class Run:
    config: Config
    outputs: list[list[int]]  # generated token ids per prompt
    seconds: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    dsbd_iterations: float = 0.0
    dsbd_tokens: float = 0.0
    dsbd_passes: float = 0.0
    width_hist: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> {width: count}
    energy_j: float | None = None

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def target_passes(self, num_prompts: int) -> float:
        if self.config.kind == "dsbd":
            return self.dsbd_passes
        if self.config.kind == "draft_model":
            return num_prompts + self.drafts
        return float(self.tokens)


def configurations(widths, depths, beam_widths, draft_model_depth: int = 3, pinned: bool = False) -> list[Config]:
    """The harness's configurations; ``pinned``: each DSBD mode-"sample" row also with pinned shapes (its cost model
    and budget off), side by side with the default (the cost model on)."""
    out = [Config("plain", "plain")]
    out += [Config(f"beam_search W={w}", "beam_search", width=w) for w in beam_widths]
    out.append(Config(f"draft_model g={draft_model_depth}", "draft_model", depth=draft_model_depth))
    for w in widths:
        for g in depths:
            # the default mode: a plain request is exact target sampling, W drafts per depth, one output per layer
            out.append(Config(f"dsbd W={w} g={g}", "dsbd", w, g))
            if pinned:
                out.append(Config(f"dsbd-pinned W={w} g={g}", "dsbd", w, g, pinned=True))
            if w > 1:  # the paper's single-output-beam mode (opt-in), fixed and dynamic width
                for dyn in (False, True):
                    out.append(Config(f"dsbd-single W={w} g={g} {'dyn' if dyn else 'fixed'}", "dsbd", w, g, dyn,
                                      mode="single"))
    return out


def _counter(metrics, name: str) -> float:
    return float(sum(getattr(m, "value", 0) or 0 for m in metrics if m.name == name))


def _width_buckets(metrics) -> dict[int, dict[int, int]]:
    """Per layer, the count of each width (from the cumulative ``le`` buckets of ``vllm:dsbd_layer_width``)."""
    out: dict[int, dict[int, int]] = {}
    for m in metrics:
        if m.name != "vllm:dsbd_layer_width" or "layer" not in m.labels:
            continue
        cum = sorted((float(le), c) for le, c in m.buckets.items() if le != "+Inf")
        prev, hist = 0, {}
        for le, c in cum:
            if c - prev:
                hist[int(le)] = c - prev
            prev = c
        out[int(m.labels["layer"])] = hist
    return out


def _delta_hist(after, before):
    return {layer: {w: c - before.get(layer, {}).get(w, 0) for w, c in h.items()
                    if c - before.get(layer, {}).get(w, 0)} for layer, h in after.items()}


def run_config(cfg: Config, target: str, draft: str, prompts: list[list[int]], *, max_tokens: int,
               temperature: float, engine_kw: dict, top_k: int = 0, top_p: float = 1.0, power=None):
    """Runs one configuration; returns its Run and the engine, still up (the caller may run beam search on it and
    must :func:`shutdown` it)."""
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    spec = None
    if cfg.kind == "draft_model":
        # vLLM's default draft proposes its argmax ("greedy"); at temperature > 0 the fair baseline is standard
        # speculative sampling: the draft samples, and its probabilities enter the rejection test
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": cfg.depth,
                "draft_sample_method": "probabilistic" if temperature > 0 else "greedy"}
    elif cfg.kind == "dsbd":
        spec = {"method": "dsbd", "model": draft, "num_speculative_tokens": cfg.depth, "width": cfg.width,
                "dynamic_width": cfg.dynamic, "mode": cfg.mode}
        if cfg.pinned:
            spec.update(cost_model=None, verify_budget=None)
    llm = vllm.LLM(model=target, speculative_config=spec, disable_log_stats=False, seed=0, **engine_kw)
    try:
        toks = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        params = [vllm.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=i)
                  for i in range(len(prompts))]
        llm.generate(toks[:1], vllm.SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        before = llm.get_metrics()
        if power is not None:
            power.start()
        t0 = time.perf_counter()
        outs = llm.generate(toks, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        energy = power.stop() if power is not None else None
        after = llm.get_metrics()
        run = Run(cfg, [list(o.outputs[0].token_ids) for o in outs], secs, energy_j=energy)
        for attr, name in (("drafts", "vllm:spec_decode_num_drafts"),
                           ("draft_tokens", "vllm:spec_decode_num_draft_tokens"),
                           ("accepted", "vllm:spec_decode_num_accepted_tokens"),
                           ("dsbd_iterations", "vllm:dsbd_iterations"),
                           ("dsbd_tokens", "vllm:dsbd_emitted_tokens"),
                           ("dsbd_passes", "vllm:dsbd_target_passes")):
            setattr(run, attr, _counter(after, name) - _counter(before, name))
        run.width_hist = _delta_hist(_width_buckets(after), _width_buckets(before))
        return run, llm
    except BaseException:
        shutdown(llm, cleanup_dist_env_and_memory)
        raise


def run_beam_search(llm, cfg: Config, prompts: list[list[int]], *, max_tokens: int, power=None) -> Run:
    """vLLM's ``LLM.beam_search`` (deterministic: vLLM's beam search keeps the top-W cumulative log-probabilities)
    on an engine without speculation; the best beam's generated tokens are the output."""
    from vllm.sampling_params import BeamSearchParams

    bp = BeamSearchParams(beam_width=cfg.width, max_tokens=max_tokens)
    if power is not None:
        power.start()
    t0 = time.perf_counter()
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], bp, use_tqdm=False)
    secs = time.perf_counter() - t0
    energy = power.stop() if power is not None else None
    gen = [list(o.sequences[0].tokens[len(p):]) for o, p in zip(outs, prompts)]
    return Run(cfg, gen, secs, energy_j=energy)
