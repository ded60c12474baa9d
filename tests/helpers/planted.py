"""Planted wrong variants of the core's verification layer, for the power checks of the statistical tests.

Each variant is a test-local copy of ``vllm_dsbd.core.verify.verify_layer`` (or, ``static=True``, of
``vllm_dsbd.core.verify_static.verify_layer_static``, the layer beam requests run) built from its current source with a
textual change (the copy is compiled in a copy of the module's namespace; the core is not modified). A test installs
it with ``monkeypatch.setattr(verify_mod, "verify_layer", planted_verify_layer(variant))``: ``verify_forest`` looks the
name up in its module, so every decoder above it then runs the wrong rule. ``planted_chain`` does the same for the
width-1 chain cores. If the core's source no longer holds a line a variant changes, building the variant fails (a
power check never silently turns into a no-op).
"""
from __future__ import annotations

import contextlib
import inspect
import textwrap

import vllm_dsbd.core.chain as chain_mod
import vllm_dsbd.core.chain_static as chain_static_mod
import vllm_dsbd.core.verify as verify_mod
import vllm_dsbd.core.verify_static as static_mod

_BIAS = "(1.0 + 0.1 * (torch.arange(t.shape[-1], device=t.device) % 2 == 0))"
VARIANTS = {
    # The with-replacement acceptance rule: draft j's law is taken to be Q itself instead of Q_j (Q with the earlier
    # draws removed, renormalised), both in the acceptance ratio min(1, T(z_j) / Q(z_j)) and in the residual
    # norm(max(T - Q, 0)). Exact for drafts drawn WITH replacement; the forest's drafts are drawn without.
    "with_replacement": [
        ("denom = (1.0 - q_cum).clamp(min=_TINY).float()", "denom = torch.ones_like(q_cum).float()"),
        ("qj = torch.where(drawn[ri], 0.0, q[ri]) / denom[ri, None]", "qj = q[ri]"),
    ],
    # A dropped residual: after a rejection the target T is left as it was instead of norm(max(T - Q_j, 0)).
    "dropped_residual": [
        ("t[ri] = torch.where(tot > _TINY, res / tot.clamp(min=_TINY), t[ri])", "t[ri] = t[ri]"),
    ],
    # A subtle one: the residual max(T - Q_j, 0) 10% too heavy on even token ids before it is renormalised.
    "residual_bias": [
        ("res = (t[ri] - qj).clamp(min=0.0)", "res = (t[ri] - qj).clamp(min=0.0) * " + _BIAS),
    ],
    # A subtle one: each draft accepted with probability min(1, 0.9 T(z) / Q_j(z)), 10% too strict.
    "accept_bias": [("acc = live & (u * (qz / denom) < tz)", "acc = live & (u * (qz / denom) < 0.9 * tz)")],
    # A verifier that does not verify: every live draft the target gives mass accepted (the output law becomes the
    # drafts' Q where there are drafts; its distance from the target's is the rejection rate's order)
    "accept_all": [("acc = live & (u * (qz / denom) < tz)", "acc = live & (tz > 0)")],
}
# the same variants of the static layer (its lines compute on every row under masks)
STATIC_VARIANTS = {
    "with_replacement": [
        ("denom = (1.0 - q_cum).clamp(min=_TINY).float()", "denom = torch.ones_like(q_cum).float()"),
        ("qj = torch.where(drawn, 0.0, q) / denom[:, None]", "qj = q"),
    ],
    "dropped_residual": [
        ("t = torch.where(rej[:, None], torch.where(tot > _TINY, res / tot.clamp(min=_TINY), t), t)", "t = t"),
    ],
    "residual_bias": [("res = (t - qj).clamp(min=0.0)", "res = (t - qj).clamp(min=0.0) * " + _BIAS)],
    "accept_bias": [("acc = live & (u * (qz / denom) < tz)", "acc = live & (u * (qz / denom) < 0.9 * tz)")],
    "accept_all": [("acc = live & (u * (qz / denom) < tz)", "acc = live & (tz > 0)")],
}


# the dropped residual (and every draft accepted) in the width-1 chain cores (plain requests' forests of width 1 take them, not verify_layer):
# ``chain._layer`` (``verify_chains`` looks it up in its module) and ``chain_static.verify_chains_static`` (the runner's
# sampler calls it by the name it imported: install it as ``vllm_dsbd.engine.sampler.verify_chains_static``)
CHAIN_VARIANTS = {"dropped_residual": [("tr = torch.where(good, res / tot, pr)", "tr = pr")],
                  "accept_all": [("acc = dval & hit", "acc = dval & (p.gather(1, zi).squeeze(1) > 0)")]}
CHAIN_STATIC_VARIANTS = {"dropped_residual": [("tr = torch.where(tot > _TINY, res / tot, p)", "tr = p")],
                         "accept_all": [("acc = dval & hit", "acc = dval & (p.gather(1, zi).squeeze(1) > 0)")]}


def planted_chain(variant: str, static: bool = False):
    """A copy of the chain core's ``_layer`` (``static``: ``verify_chains_static`` over a copy of its ``_draw_layer``)
    with the variant's lines changed."""
    if static:  # the rule's line is in ``_draw_layer``: a copy of ``verify_chains_static`` calling a planted one
        layer = _planted(chain_static_mod, "_draw_layer", CHAIN_STATIC_VARIANTS, variant)
        return _planted(chain_static_mod, "verify_chains_static", {variant: []}, variant, {"_draw_layer": layer})
    return _planted(chain_mod, "_layer", CHAIN_VARIANTS, variant)


def planted_verify_layer(variant: str, static: bool = False):
    """A copy of the core's ``verify_layer`` (``static``: ``verify_layer_static``) with the variant's lines
    changed."""
    mod, name = (static_mod, "verify_layer_static") if static else (verify_mod, "verify_layer")
    return _planted(mod, name, STATIC_VARIANTS if static else VARIANTS, variant)


@contextlib.contextmanager
def planted_core_layer(variant: str | None):
    """Inside the block, the core's layer (``core.verify.verify_layer``, plain requests' general verification) is the
    planted ``variant`` (None: the real one, so one loop runs both); restored after."""
    real = verify_mod.verify_layer
    if variant is not None:
        verify_mod.verify_layer = planted_verify_layer(variant)
    try:
        yield
    finally:
        verify_mod.verify_layer = real


@contextlib.contextmanager
def planted_beam_layer(variant: str):
    """Inside the block, the layer beam requests verify with (``engine.beams.sampling.verify_layer_static``) is the
    planted ``variant`` of the static core's layer; restored after."""
    from vllm_dsbd.engine.beams import sampling as beam_sampling_mod

    real = beam_sampling_mod.verify_layer_static
    beam_sampling_mod.verify_layer_static = planted_verify_layer(variant, static=True)
    try:
        yield
    finally:
        beam_sampling_mod.verify_layer_static = real


def _planted(mod, name: str, variants: dict, variant: str, extra: dict | None = None):
    src = textwrap.dedent(inspect.getsource(getattr(mod, name)))
    for old, new in variants[variant]:
        assert src.count(old) == 1, f"planted variant {variant!r}: the core's {name} no longer has {old!r}"
        src = src.replace(old, new)
    namespace = dict(vars(mod), **(extra or {}))  # ``extra``: names it calls replaced (planted helpers)
    exec(compile(src, f"<planted {name}: {variant}>", "exec"), namespace)
    return namespace[name]
