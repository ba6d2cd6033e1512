"""Helpers of `Fp8QuantizationCallback` (`dream_trainer.callbacks.fp8`): which hardware multiplies in
float8, torchao's config for a recipe there, and the per-model summary.

torchao is imported only inside `torchao_config`, when a model is converted.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import nn

# AMD GPUs with float8 matmuls: MI300 (gfx940-942) and MI350 (gfx950), as torchao.utils'
# is_MI300() / is_MI350() check them.
_ROCM_FLOAT8_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")
_NOT_MATMULS = (nn.Linear, nn.Embedding, nn.EmbeddingBag)  # Linear: converted or skipped; embeddings: lookups


class Float8Hardware(NamedTuple):
    """What a device can do with float8: `native` float8 matmuls (``torch._scaled_mm``), or
    not (torchao then emulates them); `name` is the device as messages call it."""

    native: bool
    name: str


def float8_hardware(device: torch.device | str) -> Float8Hardware:
    """Whether `device` has float8 matmuls: NVIDIA GPUs of compute capability 8.9 and later
    (Ada, Hopper, Blackwell: what torchao's ``is_sm_at_least_89`` checks, per device here) and
    AMD MI300/MI350 do; CPUs and older GPUs do not (torchao emulates them). Any other device
    type is refused: a `ValueError` naming it and what is supported."""
    device = torch.device(device)
    if device.type == "cpu":
        return Float8Hardware(False, "this CPU")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.version.hip:
            arch = torch.cuda.get_device_properties(device).gcnArchName
            return Float8Hardware(any(a in arch for a in _ROCM_FLOAT8_ARCHS), f"{name} ({arch})")
        major, minor = torch.cuda.get_device_capability(device)
        return Float8Hardware((major, minor) >= (8, 9), f"{name} (compute capability {major}.{minor})")
    raise ValueError(
        f"Fp8QuantizationCallback: float8 training on device {str(device)!r} is not supported: torchao's float8 runs on "
        "NVIDIA GPUs (native from compute capability 8.9, emulated before), AMD GPUs (native on MI300/MI350, "
        "emulated before) and CPUs (emulated). Train on one of those, or without Fp8QuantizationCallback"
    )


def torchao_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool, fast_accum: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for `recipe`, with its matmuls emulated (`emulate`:
    float8 casts and scales, then a float32 matmul) where the hardware has none, FSDP2's
    float8 all-gather (tensorwise only) when asked, and with `fast_accum` the fast
    accumulation in the backward's two matmuls as well (torchao's recipes use it in the
    forward's only)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    if fast_accum:
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    return config


def other_matmul_modules(model: nn.Module) -> dict[str, str]:
    """``{fqn: type name}`` of the modules with a 2-D weight that are not ``nn.Linear``
    (GPT-2's ``Conv1D``, a hand-written linear): torchao converts only ``nn.Linear``."""
    found = {}
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, _NOT_MATMULS) and isinstance(weight, torch.Tensor) and weight.ndim == 2:
            found[fqn] = type(module).__name__
    return found


def summary(name: str, recipe: str, converted: list[str], skipped: dict[str, str], n_linear: int, how: str) -> str:
    """One model's conversion in a line or two: how many layers, how, and why others were not.
    With no layer converted, it says "0 layers converted" and why."""
    reasons: dict[str, list[str]] = defaultdict(list)
    for fqn, reason in skipped.items():
        reasons[reason].append(fqn)
    why = "; ".join(f"{_names(fqns)} ({reason})" for reason, fqns in reasons.items())
    if converted:
        return (f"Fp8QuantizationCallback: {name}: {len(converted)} of {n_linear} nn.Linear layer(s) converted to float8 "
                f"({recipe}, {how}): {_names(converted)}; skipped: {why or 'none'}")
    cause = "it has no nn.Linear layers" if n_linear == 0 else f"its {n_linear} nn.Linear layer(s) were all skipped"
    cause += f"; not converted: {why}" if why else ""
    return (f"Fp8QuantizationCallback: {name}: 0 layers converted to float8: {cause}. It trains in high precision, as "
            "without Fp8QuantizationCallback")


def _names(fqns: list[str], shown: int = 4) -> str:
    if len(fqns) <= shown:
        return ", ".join(fqns)
    return f"{', '.join(fqns[:shown])} and {len(fqns) - shown} more"
