"""`ThroughputMonitorCallback`: step time, samples/s, tokens/s, MFU, progress and ETA."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

import torch

from dream_trainer.callbacks.monitors._base import Monitor, check_int
from dream_trainer.callbacks.peak_flops import PeakFlops, device_name, lookup_peak, resolve_peak

logger = logging.getLogger(__name__)

def device_peak_flops(device: torch.device, dtype: str = "bf16") -> float | None:
    """The dense peak FLOP/s of a known GPU in `dtype` (``dream_trainer.callbacks.peak_flops.PEAK_FLOPS``)
    by its name; None for other devices (CPU included): pass ``peak_flops`` to the callbacks."""
    if device.type != "cuda":
        return None
    return lookup_peak(device_name(device), dtype)


def model_flops(trainer: Any, samples: float, tokens: float | None, flops_per_token: float | None) -> float | None:
    """The model FLOPs of `samples` / `tokens`: tokens x `flops_per_token` when both are
    known, else samples x ``trainer.model_flops_per_sample`` when set, else None."""
    if tokens is not None and flops_per_token is not None:
        return tokens * flops_per_token
    per_sample = getattr(trainer, "model_flops_per_sample", None)
    return samples * per_sample if per_sample is not None else None


class ThroughputMonitorCallback(Monitor):
    """Speed, from ``trainer.step_stats`` (host clocks and batch shapes: no sync).

    On its log steps: ``train/step_time`` (median seconds per optimizer step over the last
    `window` steps), ``train/samples_per_sec`` and ``train/tokens_per_sec`` (across
    data-parallel ranks: exact on the trainer's log steps, from ``step_stats.world_*``;
    this rank's rate times the data-parallel size otherwise), ``train/tflops_per_device``
    (achieved model TFLOP/s per rank) when the model's FLOPs are known and ``train/mfu``
    when the peak is known too (`peak_flops` per device, or a known GPU in the training
    dtype: float8 with `Fp8QuantizationCallback`; said once at INFO in ``post_setup``, see
    `dream_trainer.callbacks.peak_flops`), and after
    `warmup_steps`: ``train/progress_pct`` and ``train/eta`` (seconds) when the run's length
    is known (``trainer.total_steps``). The FLOPs: `flops_per_token` per token (``"auto"``:
    the trainer's ``model_flops_per_token``, by default 6 x the parameters outside
    embeddings, the dense-transformer estimate), else, for batches without tokens, the
    trainer's ``model_flops_per_sample``. Counts come from ``trainer.count_batch``
    (override it for your batches). On CUDA, each log step is also timed on the device with events: ``train/step_time_device``
    (the only sync it adds, on log steps).
    """

    def __init__(self, log_interval: int = 100, window: int = 20, warmup_steps: int = 10,
                 flops_per_token: float | str | None = "auto", peak_flops: float | None = None):
        super().__init__(log_interval)
        check_int("ThroughputMonitorCallback", "window", window, 1)
        check_int("ThroughputMonitorCallback", "warmup_steps", warmup_steps, 0)
        if not (flops_per_token is None or flops_per_token == "auto" or isinstance(flops_per_token, (int, float))):
            raise ValueError(f"ThroughputMonitorCallback(flops_per_token={flops_per_token!r}): a number, 'auto' or None")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not peak_flops > 0):
            raise ValueError(f"ThroughputMonitorCallback(peak_flops={peak_flops!r}) is invalid: expected FLOP/s > 0 or None")
        self.window, self.warmup_steps, self.flops_per_token, self.peak_flops = window, warmup_steps, flops_per_token, peak_flops
        self._given_peak = peak_flops
        self.peak: PeakFlops | None = None  # resolved in post_setup: the value and its source
        self.times: deque[float] = deque(maxlen=window)
        self._last: tuple[float, int, int | None, bool] | None = None
        self._events: tuple[Any, Any] | None = None
        self._cuda = False  # timed with device events (set at setup)

    def post_setup(self) -> None:
        self.trainer.request_batch_counts()  # samples and tokens: counted for this monitor
        self._cuda = self.trainer.world.device.type == "cuda"
        self.peak = resolve_peak(self.trainer, self._given_peak)
        self.peak_flops = self.peak.value
        logger.info("%s", self.peak.describe())

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        if self._cuda and (trainer.global_step + 1) % self.log_interval == 0 and self._events is None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, None)

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.step_done():
            return
        trainer, stats = self.trainer, self.trainer.step_stats
        if stats.total_samples is None:  # attached after setup: counted from the next batch on
            trainer.request_batch_counts()
            return
        self.times.append(stats.step_time_s)
        if self._events is not None and self._events[1] is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)
        if trainer.global_step % self.log_interval == 0:  # `due()`: the step is done (checked above)
            self._log()

    def totals(self) -> tuple[int, int | None, bool]:
        """(samples, tokens, exact) since the start, across data-parallel ranks."""
        trainer, stats = self.trainer, self.trainer.step_stats
        if (trainer.global_step % trainer.logging_parameters.log_every_n_steps == 0  # world totals refreshed now
                and stats.world_samples is not None):  # (None: some rank does not count)
            return stats.world_samples, stats.world_tokens, True
        dp = trainer.world.dp_size
        return stats.total_samples * dp, (stats.total_tokens * dp if stats.total_tokens is not None else None), False

    def _log(self) -> None:
        trainer = self.trainer
        now = time.perf_counter()
        samples, tokens, exact = self.totals()
        metrics: dict[str, float] = {"train/step_time": statistics.median(self.times)}
        if self._last is not None:
            then, samples0, tokens0, _ = self._last
            elapsed = now - then
            metrics["train/samples_per_sec"] = (samples - samples0) / elapsed
            token_rate = None
            if tokens is not None and tokens0 is not None:
                metrics["train/tokens_per_sec"] = token_rate = (tokens - tokens0) / elapsed
            per_token = trainer.model_flops_per_token if self.flops_per_token == "auto" else self.flops_per_token
            achieved = model_flops(trainer, metrics["train/samples_per_sec"], token_rate, per_token)
            if achieved is not None:  # FLOP/s over all ranks
                metrics["train/tflops_per_device"] = achieved / trainer.world.world_size / 1e12
                if self.peak_flops:
                    metrics["train/mfu"] = achieved / (self.peak_flops * trainer.world.world_size)
        self._last = (now, samples, tokens, exact)
        total = trainer.total_steps
        if total and trainer.global_step > self.warmup_steps:
            metrics["train/progress_pct"] = 100.0 * trainer.global_step / total
            metrics["train/eta"] = max(0, total - trainer.global_step) * metrics["train/step_time"]
        if self._events is not None and self._events[1] is not None:
            start, end = self._events
            end.synchronize()  # deliberate, on log steps only
            metrics["train/step_time_device"] = start.elapsed_time(end) / 1e3
            self._events = None
        trainer.log_dict(metrics)
