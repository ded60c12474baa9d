"""A step's host reads of the device, one copy for all its kinds of work (one read per round).

Code that reads the device is a *reader*: a generator that yields the device tensors it needs and is sent their host
copies (``host, = yield [t]``). :func:`gather` runs readers side by side, one copy per round (:func:`fetch`);
:func:`run` drives one to its result. Readers hand across a yield only device tensors they made themselves, so merging
changes nothing but the number of copies; ``MERGE = False`` runs them one after the other (the tests' reference).
Imports no vLLM. The protocol: docs/design/step.md §3.2.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

import torch

T = TypeVar("T")
# a reader: yields the device tensors it needs on the host, is sent their host copies, returns its result
Reader = Generator[list[torch.Tensor], list[torch.Tensor], T]

MERGE = True  # gather's readers share each round's copy (False: one after the other, a copy per read)


def fetch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (any dtypes and shapes), with one device-to-host copy per device: their bytes side
    by side, copied once, then split and viewed back (exact for every dtype)."""
    out: list[Any] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(k)
    for ks in by_dev.values():
        flat = [tensors[k].detach().contiguous().reshape(-1).view(torch.uint8) for k in ks]
        host = torch.cat(flat).cpu()
        at = 0
        for k, f in zip(ks, flat):
            n = f.numel()
            out[k] = host[at : at + n].clone().view(tensors[k].dtype).reshape(tensors[k].shape)
            at += n
    return out


def run(reader: Reader[T]) -> T:
    """Drives a reader to its result, one :func:`fetch` per read."""
    try:
        ask = next(reader)
        while True:
            ask = reader.send(fetch(ask))
    except StopIteration as stop:
        return stop.value


def gather(*readers: Reader | None) -> Reader[list]:
    """A reader running ``readers`` side by side (None: an absent one, result None): each round, every reader still
    running goes on to its next read, and all of their asks are one yield. Returns their results in order."""
    results: list[Any] = [None] * len(readers)
    asks: dict[int, list[torch.Tensor]] = {}

    def advance(k: int, sent) -> None:
        try:
            asks[k] = next(readers[k]) if sent is None else readers[k].send(sent)
        except StopIteration as stop:
            asks.pop(k, None)
            results[k] = stop.value

    if not MERGE:  # one after the other
        for k, r in enumerate(readers):
            if r is not None:
                results[k] = yield from r
        return results
    for k, r in enumerate(readers):
        if r is not None:
            advance(k, None)
    while asks:
        keys = list(asks)
        host = yield [t for k in keys for t in asks[k]]
        at = 0
        for k in keys:
            n = len(asks[k])
            advance(k, host[at : at + n])
            at += n
    return results
