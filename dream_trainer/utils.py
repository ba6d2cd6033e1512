"""Small helpers shared by the trainers and callbacks."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process (python, numpy, torch CPU and CUDA), as plain data
    (numbers, strings, tuples, tensors: what a restricted load accepts; numpy's key array
    as a tuple of ints)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": numpy_state_as_data(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def numpy_state_as_data(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """numpy's legacy RNG state ``(name, key array, pos, has_gauss, gauss)`` with the key as
    a tuple of ints: what a restricted load accepts (`set_rng_state` reads it back)."""
    name, key, pos, has_gauss, gauss = state
    return (str(name), tuple(key.tolist()), int(pos), int(has_gauss), float(gauss))


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def detach_result(result: Any, where: str) -> dict[str, Any]:
    """Check that a step returned a dict (or None) and detach its tensors (in that dict)."""
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise TypeError(f"{where} must return a dict (e.g. {{'loss': loss}}) or None, got {type(result).__name__}")
    for key, value in result.items():  # in place (the step's own dict), a loop: no copy, no extra frame
        if isinstance(value, torch.Tensor) and value.requires_grad:
            result[key] = value.detach()
    return result


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Convert metric values to floats with one host-device transfer for all tensors."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if tensors and all(t.device.type == "cpu" for t in tensors.values()):
        out.update((k, float(t.detach())) for k, t in tensors.items())  # on the CPU: reading is free
    elif tensors:
        # The one deliberate sync of a log step: all tensor metrics in one transfer.
        first = next(iter(tensors.values()))
        values = torch.stack([t.detach().float().reshape(()).to(first.device) for t in tensors.values()]).tolist()
        out.update(zip(tensors, values))
    return {k: out[k] for k in metrics}
