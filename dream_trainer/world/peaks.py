"""Device peaks for MFU and the pipeline's cost model: the table of dense peak FLOP/s per
device and training dtype, the device's name, and the dtype a trainer's matmuls run in.
A leaf of the world package (it imports nothing of the trainer or the callbacks), so the
trainer (`dream_trainer.pipeline.cost` through it) and the shipped callbacks
(`dream_trainer.callbacks.peak_flops`) share one table."""

from __future__ import annotations

from typing import Any

import torch

PEAK_FLOPS: dict[str, dict[str, float]] = {
    # Dense (no structured sparsity) tensor-core peaks per GPU, FLOP/s, from NVIDIA's data
    # sheets. Matched by substring of the device name, first match wins (PCIe/NVL first).
    "H100 PCIe": {"bf16": 756e12, "float8": 1513e12, "tf32": 378e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "float8": 1671e12, "tf32": 418e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "float8": 1979e12, "tf32": 495e12, "fp32": 67e12},  # SXM
    "H200": {"bf16": 989e12, "float8": 1979e12, "tf32": 495e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # no float8 tensor cores
    "L40S": {"bf16": 362e12, "float8": 733e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "V100": {"bf16": 125e12, "fp32": 15.7e12},  # "bf16": its fp16 tensor cores (no bf16)
}
"""Per device-name substring, per training dtype (``"bf16"``: bf16 or fp16, ``"float8"``,
``"tf32"``, ``"fp32"``): the dense peak FLOP/s of one device."""


def device_name(device: torch.device) -> str:
    """The device's name: the GPU's (``torch.cuda.get_device_name``), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def training_dtype(trainer: Any) -> str:
    """The dtype a trainer's matmuls run in, for the peak: ``"float8"`` when a model was
    converted to float8 (``trainer.float8``, recorded by `Fp8QuantizationCallback`), else
    ``"bf16"`` for a bf16/fp16 ``autocast_dtype`` or ``param_dtype``, else ``"tf32"`` on
    CUDA with ``torch.get_float32_matmul_precision()`` below ``"highest"``, else ``"fp32"``."""
    if getattr(trainer, "float8", None):
        return "float8"
    params = trainer.world.device_parameters
    dtype = getattr(params, "autocast_dtype", None) or getattr(params, "param_dtype", None)
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if trainer.world.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def lookup_peak(name: str, dtype: str) -> float | None:
    """`PEAK_FLOPS` of the first entry whose key is in `name`, for `dtype` (None: unknown)."""
    entry = next((peaks for key, peaks in PEAK_FLOPS.items() if key in name), None)
    return None if entry is None else entry.get(dtype)
