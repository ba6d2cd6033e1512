"""`HostReadCounter`: count every read of a tensor's values to the host (each one a
host–device sync on an accelerator), with where it happened; `StepReads` groups them by
optimizer step of a training run."""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dream_trainer.protocol.base import Callback

# Tensor functions whose result is a host value (or needs one): name -> kind.
_ALWAYS = {
    "item": "item", "tolist": "tolist", "numpy": "numpy", "__array__": "numpy", "cpu": "cpu",
    "__bool__": "bool", "is_nonzero": "bool", "__float__": "float", "__int__": "int", "__index__": "int",
    "__complex__": "complex", "__format__": "format", "__repr__": "format", "__contains__": "contains",
    # the output's shape depends on the values: the host learns them first
    "nonzero": "nonzero", "argwhere": "nonzero", "masked_select": "masked_select", "unique": "unique",
    "unique_consecutive": "unique", "bincount": "bincount",
    # a Python bool out of tensors
    "equal": "equal", "allclose": "equal",
}
_HERE = os.path.splitext(__file__)[0]
_TORCH = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class HostRead:
    """One host read: its `kind` (``"item"``, ``"bool"``, ``"format"``, ``"to_cpu"``,
    ``"nonzero"``, ...), the tensor function (``"__bool__"``), and `where`: the first caller
    outside torch, as ``"path/to/file.py:123 in function"``."""

    kind: str
    function: str
    where: str

    @property
    def caller(self) -> str:
        """The function that made the read (the part of `where` after ``in``)."""
        return self.where.rsplit(" in ", 1)[-1]

    def __str__(self) -> str:
        return f"{self.kind} ({self.function}) at {self.where}"


class HostReadCounter(TorchFunctionMode):
    """Count every host read of a tensor while active (``with HostReadCounter() as reads:``),
    in this thread.

    Caught: ``.item()``, ``.tolist()``, ``.numpy()``/``np.asarray``, ``.cpu()``,
    ``.to("cpu")`` (any spelling of a CPU destination), ``copy_`` into a CPU tensor from
    another device, ``bool()``, ``float()``, ``int()``/``__index__``, ``complex()``,
    formatting (f-strings, ``format``, ``%``, ``str``/``repr``: the values are printed),
    ``x in t``, functions whose output shape depends on the values (``nonzero``,
    ``argwhere``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` by a tensor,
    one-argument ``torch.where``, boolean-mask indexing ``t[mask]`` / ``t[mask] = v``),
    ``torch.equal``/``allclose``, and ``torch.tensor``/``as_tensor`` of a list holding tensors.

    `device`: count reads of tensors on that device type only (``"cuda"``: reads of the CPU
    tensors a run keeps on purpose, such as the optimizers' step counters or the ranks'
    agreement flag, are not syncs and are not counted). None (the default): every tensor —
    what a CPU-only test can check, where every tensor is a host tensor. `ignore`: a
    predicate on `HostRead` for reads not to count (e.g. by `HostRead.caller`).

    ``reads`` lists them in order; ``counts()`` is a `Counter` of their kinds; ``str()``
    lists them one per line.
    """

    def __init__(self, device: str | torch.device | None = None, ignore: Callable[[HostRead], bool] | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.ignore = ignore
        self.reads: list[HostRead] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        found = _kind(getattr(func, "__name__", ""), args, kwargs)
        if found is not None and (self.device is None or _device_of(found[1]) == self.device):
            read = HostRead(found[0], func.__name__, _caller())
            if self.ignore is None or not self.ignore(read):
                self.reads.append(read)
        return func(*args, **kwargs)

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(r.kind for r in self.reads)

    def clear(self) -> None:
        self.reads.clear()

    def __len__(self) -> int:
        return len(self.reads)

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.reads) or "no host reads"


def _kind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, the tensor read) when calling `name` on `args` reads values to the host."""
    first = args[0] if args else None
    if name in _ALWAYS:
        return _ALWAYS[name], first
    if name == "to":
        return ("to_cpu", first) if _to_cpu(args[1:], kwargs) else None
    if name == "copy_":  # a device tensor copied into a CPU one
        src = args[1] if len(args) > 1 else kwargs.get("src")
        moves = isinstance(src, torch.Tensor) and first.device.type == "cpu" and src.device.type != "cpu"
        return ("to_cpu", src) if moves else None
    if name == "repeat_interleave":  # repeats given as a tensor: the output size is their sum
        repeats = first if len(args) == 1 else args[1] if len(args) > 1 else kwargs.get("repeats")
        syncs = isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return ("repeat_interleave", repeats) if syncs else None
    if name == "where":
        return ("nonzero", first) if len(args) + len(kwargs) == 1 else None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        indices = index if isinstance(index, tuple) else (index,)
        masked = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        return ("mask_index", first) if masked else None
    if name in ("tensor", "as_tensor"):
        data = first if args else kwargs.get("data")
        tensors = [d for d in data if isinstance(d, torch.Tensor)] if isinstance(data, (list, tuple)) else []
        return ("tensor", tensors[0]) if tensors else None
    return None


def _device_of(value: Any) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for target in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(target, torch.Tensor):
            return target.device.type == "cpu"
        if isinstance(target, (str, torch.device)):
            return torch.device(target).type == "cpu"
    return False


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith((_TORCH, _HERE))):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class StepReads(Callback[Any]):
    """Groups the reads of a `HostReadCounter` by optimizer step: add it to a trainer's
    callbacks and run ``fit()`` inside the counter. ``steps[n]`` holds the reads made from
    the start of optimizer step `n` (its first ``pre_train_step``, before any other
    callback's) up to the start of the next: the step, its logging, and a validation or a
    checkpoint that follows it. Reads before the first step are in ``steps[0]``."""

    order = -(10**9)  # first in pre_train_step: the step's reads start here

    def __init__(self, counter: HostReadCounter):
        self.counter = counter
        self.steps: dict[int, list[HostRead]] = {}
        self._step = 0
        self._start = 0

    def _close(self) -> None:
        reads = self.counter.reads
        self.steps.setdefault(self._step, []).extend(reads[self._start :])
        self._start = len(reads)

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step + 1
        if step != self._step:
            self._close()
            self._step = step

    def post_fit(self) -> None:
        self._close()

    def kinds(self, step: int) -> list[tuple[str, str]]:
        """``[(kind, caller)]`` of step `step`'s reads, in order."""
        return [(r.kind, r.caller) for r in self.steps.get(step, [])]
