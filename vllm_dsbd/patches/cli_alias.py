"""Patch: ``--speculative-method`` is an alias of vLLM's ``--spec-method``.

vLLM 0.26 has ``--speculative-config`` (JSON) and the shorthands ``--spec-method``/``--spec-model``/``--spec-tokens``
(``EngineArgs.add_cli_args``), but no ``--speculative-method``. The wrapper adds the alias to the existing
``--spec-method`` action (same ``dest``, same choices, which include "dsbd" through ``spec_method_literal``), so
``vllm serve TARGET --speculative-method dsbd --spec-model DRAFT`` parses. ``AsyncEngineArgs.add_cli_args`` (what
``vllm serve`` uses) calls ``EngineArgs.add_cli_args`` by name and so gets the alias too.
"""

from __future__ import annotations

import argparse
import types

from vllm_dsbd.patches._patching import PatchError, when_imported, wrap_method

PATCH_ID = "cli_alias"
MODULE = "vllm.engine.arg_utils"
FLAG = "--spec-method"
ALIAS = "--speculative-method"


def add_alias(parser: argparse.ArgumentParser, flag: str = FLAG, alias: str = ALIAS) -> None:
    """Makes ``alias`` a second option string of the action behind ``flag``."""
    actions = parser._option_string_actions  # shared by the parser and all its argument groups
    action = actions.get(flag)
    if action is None:
        raise PatchError(f"vLLM's parser has no {flag} option: vLLM changed; see patch {PATCH_ID} in the ledger")
    if actions.get(alias) is action:
        return
    if alias in actions:
        raise PatchError(f"{alias} is already an option of vLLM's parser: drop patch {PATCH_ID}")
    action.option_strings.append(alias)
    actions[alias] = action


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def add_cli_args(parser):
            parser = orig(parser)
            add_alias(parser)
            return parser

        return add_cli_args

    wrap_method(PATCH_ID, mod.EngineArgs, "add_cli_args", make)
