"""The peak FLOP/s that MFU divides by, and where it came from: given by the user, or looked
up by device name and training dtype (bf16/fp16, float8 when models were converted with
`Fp8QuantizationCallback`, tf32 or fp32) in `PEAK_FLOPS`; unknown otherwise (no MFU).

`ThroughputMonitorCallback` and `PerformanceReportCallback` resolve it once (`resolve_peak`)
and say it once at INFO (`PeakFlops.describe`); the performance report stores it too."""

from __future__ import annotations

from dataclasses import asdict, dataclass
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

HOW_TO_SET = "pass peak_flops=<dense FLOP/s of one device> to ThroughputMonitorCallback / PerformanceReportCallback"


@dataclass(frozen=True)
class PeakFlops:
    """The peak FLOP/s of one device used for MFU, and its source.

    Attributes:
        value: FLOP/s per device, or None (unknown: MFU is not computed).
        device: the device's name (``torch.cuda.get_device_name``; ``"cpu"`` ...).
        dtype: the training dtype it is for: ``"bf16"``, ``"float8"``, ``"tf32"`` or ``"fp32"``.
        source: ``"user"`` (given as ``peak_flops``), ``"table"`` (`PEAK_FLOPS`) or ``"unknown"``.
    """

    value: float | None
    device: str
    dtype: str
    source: str

    def describe(self) -> str:
        """One line saying the peak and where it came from, or why there is no MFU."""
        if self.value is None:
            return (f"MFU is not computed: no peak FLOP/s known for {self.device} in {self.dtype} "
                    f"(dream_trainer.callbacks.peak_flops.PEAK_FLOPS); {HOW_TO_SET}")
        where = "given by the user (peak_flops)" if self.source == "user" else "from the table of dense peaks (PEAK_FLOPS)"
        return f"MFU peak: {self.value / 1e12:,.1f} TFLOP/s per device for {self.device} in {self.dtype}, {where}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def resolve_peak(trainer: Any, given: float | None = None) -> PeakFlops:
    """The peak for `trainer`'s device and training dtype: `given` (the user's) when set,
    else `lookup_peak`, else unknown."""
    name, dtype = device_name(trainer.world.device), training_dtype(trainer)
    if given is not None:
        return PeakFlops(float(given), name, dtype, "user")
    value = lookup_peak(name, dtype)
    return PeakFlops(value, name, dtype, "table" if value is not None else "unknown")
