"""The one mechanism through which vllm_dsbd changes vLLM.

Every change is recorded as a :class:`Record` (patch id, target, original value) and a target can be patched once
only: a second patch of the same attribute or mapping item raises :class:`PatchError` instead of silently wrapping a
wrapper. Patches of modules that may not be imported yet are deferred with :func:`when_imported`, which runs the patch
right after the module's code has executed (so ``register()`` never imports heavy vLLM modules that a process does
not use, e.g. the speculative-decoding proposers in the API server).

Vocabulary: *target* = ``"<module>.<qualname>.<attr>"`` or ``"<module>.<qualname>[<key>]"``; *original* = the raw
value found there before patching (for a class attribute the raw ``__dict__`` entry, so a ``staticmethod`` stays a
``staticmethod``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
import threading
import types
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PatchError",
    "Record",
    "applied",
    "original",
    "set_attr",
    "set_item",
    "temporarily",
    "when_imported",
    "wrap_method",
]

_MISSING = object()
_LOCK = threading.RLock()


class PatchError(RuntimeError):
    """A patch could not be applied (already patched, or vLLM no longer looks like the code the patch was written
    for)."""


@dataclass(frozen=True)
class Record:
    patch_id: str  # the ledger entry (module name under vllm_dsbd.patches)
    target: str  # "<module>.<qualname>.<attr>" or "<module>.<qualname>[<key>]"
    original: Any  # the raw value before patching; _MISSING if there was none
    new: Any  # what the patch put there


_RECORDS: dict[tuple[int, str, Any], Record] = {}  # (id(owner), "attr" | "item", name) -> record
_OWNERS: list[Any] = []  # keeps the patched owners alive, so their id() stays unique


def _describe(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<{type(owner).__qualname__} object>"


def _claim(patch_id: str, owner: Any, kind: str, name: Any, target: str, original: Any, new: Any) -> None:
    key = (id(owner), kind, name)
    if key in _RECORDS:
        raise PatchError(
            f"{target} is already patched by vllm_dsbd patch {_RECORDS[key].patch_id!r}; "
            f"refusing to patch it again for {patch_id!r}"
        )
    _RECORDS[key] = Record(patch_id, target, original, new)
    _OWNERS.append(owner)


def set_attr(patch_id: str, owner: Any, name: str, value: Any, *, where: str | None = None) -> Any:
    """Sets ``owner.name = value`` once; returns the original (raw ``__dict__`` entry for classes and modules).

    ``where`` names ``owner`` in the records when it is neither a class nor a module.
    """
    with _LOCK:
        if isinstance(owner, (type, types.ModuleType)):
            orig = owner.__dict__.get(name, _MISSING)
        else:
            orig = getattr(owner, name, _MISSING)
        target = f"{where or _describe(owner)}.{name}"
        _claim(patch_id, owner, "attr", name, target, orig, value)
        setattr(owner, name, value)
        return orig


def set_item(patch_id: str, mapping: MutableMapping, key: Any, value: Any, *, where: str) -> Any:
    """Sets ``mapping[key] = value`` once (``where`` names the mapping in the ledger); returns the original."""
    with _LOCK:
        orig = mapping.get(key, _MISSING)
        _claim(patch_id, mapping, "item", key, f"{where}[{key!r}]", orig, value)
        mapping[key] = value
        return orig


def wrap_method(patch_id: str, cls: type, name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Replaces the function ``cls.name`` by ``make(original_function)``.

    ``staticmethod``/``classmethod`` wrappers are kept. The replacement gets the original's name and docstring,
    ``__wrapped__`` (the original function) and ``__dsbd_patch__`` (the patch id). Returns the replacement.
    """
    with _LOCK:
        if (id(cls), "attr", name) in _RECORDS:  # refuse before building anything
            raise PatchError(
                f"{_describe(cls)}.{name} is already patched by vllm_dsbd patch "
                f"{_RECORDS[(id(cls), 'attr', name)].patch_id!r}; refusing to patch it again for {patch_id!r}"
            )
    raw = cls.__dict__.get(name, _MISSING)
    if raw is _MISSING:
        raise PatchError(f"{_describe(cls)}.{name} does not exist (or is inherited): vLLM changed; see the ledger")
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind is not None else raw
    if not callable(func):
        raise PatchError(f"{_describe(cls)}.{name} is not a function: vLLM changed; see the ledger")
    new = functools.wraps(func)(make(func))
    new.__dsbd_patch__ = patch_id
    set_attr(patch_id, cls, name, kind(new) if kind is not None else new)
    return new


def original(owner: Any, name: str) -> Any:
    """The value ``owner.name`` had before vllm_dsbd patched it (raises KeyError if it was not patched)."""
    with _LOCK:
        rec = _RECORDS[(id(owner), "attr", name)]
    if rec.original is _MISSING:
        raise KeyError(f"{_describe(owner)}.{name} did not exist before patching")
    return rec.original


def applied() -> list[Record]:
    """All changes made so far, in order."""
    with _LOCK:
        return list(_RECORDS.values())


@contextlib.contextmanager
def temporarily(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` for the duration of the block (not recorded: the value is put back on exit)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# ----------------------------------------------------------------------------------------------------------------
# deferred patches: run a callback right after a module has been imported
# ----------------------------------------------------------------------------------------------------------------
_HOOKS: dict[str, list[Callable[[types.ModuleType], None]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; for a module with pending callbacks, finds the spec with the other finders and
    makes its loader run the callbacks after ``exec_module``. For every other module it returns None at once."""

    def find_spec(self, fullname, path, target=None):  # noqa: D401 (importlib protocol)
        if fullname not in _HOOKS:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not hookable (namespace package, ...): leave it to the normal machinery
        with _LOCK:
            callbacks = _HOOKS.pop(fullname, [])
        exec_module = loader.exec_module

        def exec_module_then_patch(module):
            exec_module(module)
            if module.__name__ != fullname:  # a loader shared by several modules: not ours
                return
            with contextlib.suppress(AttributeError):
                del loader.exec_module  # back to the class's method
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module_then_patch  # an instance attribute on this module's loader
        return spec


_FINDER = _PostImportFinder()


def when_imported(module_name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Runs ``callback(module)`` now if ``module_name`` is imported, else right after it gets imported."""
    with _LOCK:
        module = sys.modules.get(module_name)
        if module is not None:
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                raise PatchError(f"{module_name} is being imported right now; cannot patch it from inside its import")
        else:
            _HOOKS.setdefault(module_name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)
