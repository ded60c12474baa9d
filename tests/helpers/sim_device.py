"""A simulated accelerator for CPU tests: which tensors would live on the GPU, which operations would mix a GPU tensor
with a host one (an error on CUDA), and which would make the host wait for the GPU (a synchronisation).

On a CPU-only machine every tensor is on the CPU, so a missing ``.to(device)`` cannot fail there. This
``TorchFunctionMode`` tags tensors instead: a tensor is *on the device* when it was made with an explicit
``device=`` (a ``torch.device`` object, as the engine passes the runner's), moved with ``.to(device)``, tagged by the
test (the models' logits), or computed from a tagged tensor; ``.cpu()`` / ``.numpy()`` / ``.tolist()`` results and
``device="cpu"`` given as a string are host tensors. Then:

* **mismatch**: an operation whose tensor inputs include a device tensor and a host tensor with at least one
  dimension (CUDA accepts 0-d host tensors as scalars, and host index tensors in indexing);
* **sync**: ``tolist``, ``item``, ``bool``/``int``/``float`` of a device tensor, ``.cpu()`` / ``.numpy()`` of one,
  and ``nonzero`` on one (its output size depends on the values).
"""
from __future__ import annotations

import collections
import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_TAG = "_dsbd_on_device"
_SYNC = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"}
_TO_HOST = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
_INDEXING = {"__getitem__", "__setitem__"}  # host index tensors are fine in indexing on CUDA (not in gather & co.)


def tag(t):
    """Marks a tensor (or the tensors of a nested structure) as living on the device; returns it."""
    for x in tree_flatten(t)[0]:
        if isinstance(x, torch.Tensor):
            setattr(x, _TAG, True)
    return t


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _device_kw(func_name: str, args, kwargs) -> bool | None:
    """True: the call puts its result on the device; False: on the host; None: decided by its inputs."""
    dev = kwargs.get("device")
    if func_name == "to":
        dev = dev if dev is not None else next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    if dev is None:
        return None
    return not (isinstance(dev, str) and dev.startswith("cpu"))


class SimulatedDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.mismatches: list[str] = []
        self.syncs = collections.Counter()  # source line -> count
        self.host_copies: list[tuple[str, tuple[int, ...]]] = []  # (source line, shape) of device tensors read
        self.fetched: list[tuple[int, ...]] = []  # shapes of the tensors read through ``engine/reads.py`` (tests)
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Code run inside is not observed (e.g. a model's forward, whose weights the test does not tag)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _where(self) -> str:
        for fr in reversed(traceback.extract_stack()[:-2]):  # innermost first, without _where and the mode
            if "vllm_dsbd" in fr.filename:
                return f"{fr.filename.rsplit('vllm_dsbd', 1)[1].lstrip('/')}:{fr.lineno}"
        return "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if self._paused or name in ("device", "__get__", "__set__"):
            return out
        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        dev_in = [x for x in flat if on_device(x)]
        if dev_in and name in _SYNC:
            self.syncs[self._where()] += 1
            if name in _TO_HOST and isinstance(args[0], torch.Tensor):
                self.host_copies.append((self._where(), tuple(args[0].shape)))
        if dev_in and name not in _TO_HOST:
            if name in _INDEXING:  # the indexed tensor and (setitem) the value: host index tensors are allowed
                checked = [args[0]] + ([args[2]] if name == "__setitem__" and len(args) > 2 else [])
                checked = [x for x in checked if isinstance(x, torch.Tensor)]
            else:
                checked = flat
            host = [x for x in checked if not on_device(x) and x.dim() > 0]
            if host and any(on_device(x) for x in checked):
                self.mismatches.append(f"{name} at {self._where()}: shapes {[tuple(x.shape) for x in checked]}, "
                                       f"on device {[on_device(x) for x in checked]}")
        if name == "cpu" and out is args[0]:  # a CPU tensor's .cpu() is itself: the host copy must be a new object
            out = out.detach()
        placed = _device_kw(name, args, kwargs)
        result_on_device = placed if placed is not None else (bool(dev_in) and name not in _TO_HOST)
        if result_on_device:
            tag(out)
        return out


def draft_forward(orig, active):
    """A replacement for the drafter's ``_forward`` in an observer: while ``active()`` and the drafter has a mode
    (``drafter._sim_mode``, set by the observer around a drafting call), the draft model's own forward (vLLM's, whose
    weights the test does not tag) runs unobserved and its logits come back tagged as device tensors."""
    def forward(self, *args, **kwargs):
        mode = getattr(self, "_sim_mode", None)
        if not active() or mode is None:
            return orig(self, *args, **kwargs)
        with mode.paused():
            out = orig(self, *args, **kwargs)
        return tag(out)
    return forward
