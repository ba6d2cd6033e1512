"""The peak FLOP/s that MFU divides by, and where it came from: given by the user, or looked
up by device name and training dtype (bf16/fp16, float8 when models were converted with
`Fp8QuantizationCallback`, tf32 or fp32) in `PEAK_FLOPS`; unknown otherwise (no MFU).

`ThroughputMonitorCallback` and `PerformanceReportCallback` resolve it once (`resolve_peak`)
and say it once at INFO (`PeakFlops.describe`); the performance report stores it too."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dream_trainer.world.peaks import PEAK_FLOPS, device_name, lookup_peak, training_dtype  # one table: world/peaks.py

__all__ = ["HOW_TO_SET", "PEAK_FLOPS", "PeakFlops", "device_name", "lookup_peak", "resolve_peak", "training_dtype"]

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


def resolve_peak(trainer: Any, given: float | None = None) -> PeakFlops:
    """The peak for `trainer`'s device and training dtype: `given` (the user's) when set,
    else `lookup_peak`, else unknown."""
    name, dtype = device_name(trainer.world.device), training_dtype(trainer)
    if given is not None:
        return PeakFlops(float(given), name, dtype, "user")
    value = lookup_peak(name, dtype)
    return PeakFlops(value, name, dtype, "table" if value is not None else "unknown")
