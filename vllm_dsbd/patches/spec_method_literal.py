"""Patch: ``SpeculativeConfig.method`` accepts "dsbd".

vLLM 0.26 types the field as ``SpeculativeMethod | None`` where ``SpeculativeMethod`` is a ``Literal``, and the class
is a pydantic dataclass (``extra="forbid"``): its validator was compiled from that annotation when the class was
created. The Literal is extended in the three places that hold it (the module constant, the dataclass field's
``type``, the class ``__annotations__``), then the pydantic validator is rebuilt (``rebuild_dataclass(force=True)``
re-collects the fields from ``__dataclass_fields__``). vLLM's CLI derives ``--spec-method``'s choices from the same
field through the ``functools.lru_cache``d ``arg_utils._compute_kwargs``, whose cache is cleared if it exists already.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Literal, Optional, get_args

from vllm_dsbd.config import METHOD
from vllm_dsbd.patches._patching import PatchError, set_attr, set_item, when_imported

PATCH_ID = "spec_method_literal"
MODULE = "vllm.config.speculative"


def literal_values(tp: typing.Any) -> set:
    """All values of the Literals inside ``tp`` (through Optional/Union/nested Literal)."""
    if typing.get_origin(tp) is Literal:
        return set(get_args(tp))
    return set().union(*(literal_values(a) for a in get_args(tp))) if get_args(tp) else set()


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(sp: types.ModuleType) -> None:
    cls = sp.SpeculativeConfig
    old = sp.SpeculativeMethod
    field = cls.__dataclass_fields__["method"]
    if METHOD in get_args(old):
        raise PatchError(f"vLLM's SpeculativeMethod already contains {METHOD!r}: drop patch {PATCH_ID}")
    if field.type != Optional[old] or cls.__annotations__.get("method") != Optional[old]:
        raise PatchError(
            f"SpeculativeConfig.method is typed {field.type!r}, not SpeculativeMethod | None: vLLM changed; "
            f"see patch {PATCH_ID} in the ledger"
        )
    new = Literal[(*get_args(old), METHOD)]
    set_attr(PATCH_ID, sp, "SpeculativeMethod", new)
    where = f"{MODULE}.SpeculativeConfig"
    set_attr(PATCH_ID, field, "type", Optional[new], where=f"{where}.__dataclass_fields__['method']")
    set_item(PATCH_ID, cls.__annotations__, "method", Optional[new], where=f"{where}.__annotations__")

    from pydantic.dataclasses import rebuild_dataclass

    rebuild_dataclass(cls, force=True)
    if METHOD not in literal_values(cls.__pydantic_fields__["method"].annotation):
        raise PatchError(f"rebuilding SpeculativeConfig's validator did not pick up {METHOD!r}: pydantic changed")

    # CLI kwargs computed before the patch would lack "dsbd" in --spec-method's choices; arg_utils may also be only
    # partially imported (its import is what imported vllm.config.speculative), then there is no cache yet
    compute_kwargs = getattr(sys.modules.get("vllm.engine.arg_utils"), "_compute_kwargs", None)
    if compute_kwargs is not None:
        compute_kwargs.cache_clear()
