"""`MemoryMonitorCallback`: memory use, per epoch, leaks, and optional cleanup."""

from __future__ import annotations

import gc
import logging
from collections import deque
from typing import Any

import torch

from dream_trainer.callbacks.monitors._base import Monitor, check_int
from dream_trainer.world.memory import MB, MemoryStatus

logger = logging.getLogger(__name__)


class MemoryMonitorCallback(Monitor):
    """Memory, from ``trainer.world.memory_status()`` (the allocator's counters and the
    OS: host reads, never a device sync).

    On its log steps: ``train/memory_current_mb`` and ``train/memory_peak_mb`` (the device's
    allocated memory on CUDA, the process's resident set on CPU), ``train/memory_rss_mb``
    (every device), and on CUDA ``train/memory_reserved_mb``, ``train/memory_fragmentation``
    ((reserved - allocated) / reserved) and ``train/memory_total_mb``. It also publishes
    ``trainer.display_fields["mem"]`` (``"gpu_mem: 24.5GB/48GB (51%)"`` or
    ``"rss: 1.2GB"``) for the progress bar and the dashboard.

    Per epoch: ``epoch/memory_start_mb``, ``_end_mb``, ``_peak_mb`` and ``_delta_mb``.

    Leaks: the memory after each step is sampled every `sample_every` steps; when it rose
    at every one of the last `leak_window` samples, by more than `leak_min_mb` in all, it
    warns once with the growth rate (MB per step). With ``cleanup_above_mb``, crossing that
    much current memory runs ``gc.collect()`` (and ``torch.cuda.empty_cache()``), off by
    default.
    """

    def __init__(self, log_interval: int = 100, leak_window: int = 10, leak_min_mb: float = 1.0, sample_every: int = 10,
                 cleanup_above_mb: float | None = None):
        super().__init__(log_interval)
        check_int("MemoryMonitorCallback", "leak_window", leak_window, 3)
        check_int("MemoryMonitorCallback", "sample_every", sample_every, 1)
        self.leak_window, self.leak_min_mb, self.sample_every = leak_window, leak_min_mb, sample_every
        self.cleanup_above_mb = cleanup_above_mb
        self.samples: deque[tuple[int, float]] = deque(maxlen=leak_window)
        self.leak: tuple[int, float] | None = None  # (step warned at, MB per step)
        self.cleanups = 0
        self._epoch: dict[str, float] = {}

    # ------------------------------------------------------------------ readings
    def _cuda(self) -> bool:
        return self.trainer.world.device.type == "cuda"

    def status(self) -> MemoryStatus:
        """``trainer.world.memory_status()``: host counters, no device sync."""
        return self.trainer.world.memory_status()

    def current_mb(self) -> float:
        """Allocated device memory on CUDA, the process's resident set elsewhere
        (``world.memory_allocated()``: the sample taken every `sample_every` steps)."""
        return self.trainer.world.memory_allocated() / MB

    def peak_mb(self) -> float:
        return self.status().peak_allocated / MB

    def readings(self) -> dict[str, float]:
        status = self.status()
        out = {"train/memory_current_mb": status.allocated / MB, "train/memory_peak_mb": status.peak_allocated / MB,
               "train/memory_rss_mb": status.rss / MB}
        if self._cuda():
            out["train/memory_reserved_mb"] = status.reserved / MB
            out["train/memory_fragmentation"] = status.fragmentation
            out["train/memory_total_mb"] = (status.total or 0) / MB
        return out

    def display(self, readings: dict[str, float]) -> str:
        if "train/memory_total_mb" in readings:
            used, total = readings["train/memory_reserved_mb"] / 1024, readings["train/memory_total_mb"] / 1024
            return f"gpu_mem: {used:.1f}GB/{total:.0f}GB ({100 * used / total:.0f}%)"
        return f"rss: {readings['train/memory_rss_mb'] / 1024:.2f}GB"

    # ------------------------------------------------------------------ hooks
    def pre_train_epoch(self) -> None:
        now = self.current_mb()
        self._epoch = {"start": now, "peak": now}

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        step = self.trainer.global_step
        due = step % self.log_interval == 0
        if (step % self.sample_every and not due) or not self.step_done():
            return  # the common case, first: nothing to do on this step
        readings = self.readings() if due else None  # a log step's reading serves as its sample too
        now = readings["train/memory_current_mb"] if readings is not None else self.current_mb()
        self._epoch["peak"] = max(self._epoch.get("peak", now), now)
        self._watch_leak(step, now)
        if self.cleanup_above_mb is not None and now > self.cleanup_above_mb:
            gc.collect()
            if self._cuda():
                torch.cuda.empty_cache()
            self.cleanups += 1
            logger.info("memory %.0f MB > %.0f MB at step %d: ran gc.collect()", now, self.cleanup_above_mb, step)
        if readings is not None:
            self.trainer.display_fields["mem"] = self.display(readings)
            self.trainer.log_dict(readings)

    def _watch_leak(self, step: int, now: float) -> None:
        self.samples.append((step, now))
        if self.leak is not None or len(self.samples) < self.leak_window:
            return
        values = [v for _, v in self.samples]
        rising = all(b > a for a, b in zip(values, values[1:]))
        growth = values[-1] - values[0]
        if rising and growth > self.leak_min_mb:
            rate = growth / (self.samples[-1][0] - self.samples[0][0])
            self.leak = (step, rate)
            logger.warning(
                "memory keeps rising: +%.1f MB over the last %d samples (steps %d-%d), %.3f MB per step; a leak? "
                "(tensors kept across steps: a list of losses, a growing cache, autograd graphs held alive)",
                growth, len(values), self.samples[0][0], step, rate,
            )

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        if "start" not in self._epoch:  # attached in the middle of the epoch
            return
        end = self.current_mb()
        peak = max(self._epoch["peak"], end)
        self.trainer.log_dict({"epoch/memory_start_mb": self._epoch["start"], "epoch/memory_end_mb": end,
                               "epoch/memory_peak_mb": peak, "epoch/memory_delta_mb": end - self._epoch["start"]})
