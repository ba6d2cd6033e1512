"""`StepWindowCallback`: the mean step time and throughput over a window of optimizer steps,
timed as one span (the device synchronized at its two ends only): what a benchmark of a
training run should report."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dream_trainer.protocol.base import Callback

SPREAD_LIMIT = 0.10
"""Repeated measurements of a ratio that spread more than this ((max - min) / median) do not
support a conclusion about it."""


def spread(values: list[float]) -> float:
    """(max - min) / median of repeated measurements (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def verdict(ratios: list[float], limit: float = SPREAD_LIMIT) -> str:
    """``"ok"``, or why the rounds' ratios do not support a conclusion (one round; a spread
    over `limit`)."""
    if len(ratios) < 2:
        return "one measurement: no spread"
    s = spread(ratios)
    return "ok" if s <= limit else f"spread {100 * s:.0f} % > {100 * limit:.0f} %: too wide to conclude"


class StepWindowCallback(Callback[Any]):
    """Time the optimizer steps after the first `warmup` ones, up to step `last` (default:
    ``max_steps``), as one window, cut into `parts` equal sub-windows (the last takes any
    remainder). On CUDA the
    device is synchronized at the sub-windows' edges and around the first step only, so the
    steps in between run as they do in training (no per-step sync); a step's mean time,
    tokens/s and samples/s come from the same span and agree with each other. The parts'
    step times (`part_step_s`) show how steady the run was (`spread`). Counts are every
    data-parallel rank's (``trainer.count_batch`` of each batch).

    Attributes:
        first_step_s: the first optimizer step's time, synchronized before and after
            (compilation, allocation).
        step_s: the window's mean time per optimizer step (None until the window closed).
        part_step_s: each sub-window's mean time per optimizer step.
        steps: optimizer steps in the window.
        tokens_per_s: tokens per second over the window (None: batches without tokens).
        samples_per_s: samples per second over the window.
    """

    def __init__(self, warmup: int = 2, parts: int = 1, last: int | None = None):
        for name, value in (("warmup", warmup), ("parts", parts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepWindowCallback({name}={value!r}) is invalid: expected an int >= 1")
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < warmup + parts):
            raise ValueError(f"StepWindowCallback(last={last!r}) is invalid: expected None or an int >= warmup + parts "
                             f"({warmup + parts})")
        self.warmup, self.parts, self.last = warmup, parts, last
        self.first_step_s: float | None = None
        self.step_s: float | None = None
        self.part_step_s: list[float] = []
        self.steps = 0
        self.tokens_per_s: float | None = None
        self.samples_per_s: float | None = None
        self._start: tuple[float, int, int | None] | None = None
        self._edges: list[int] = []
        self._times: list[float] = []

    def pre_fit(self) -> None:
        self.trainer.request_batch_counts()  # samples and tokens: counted for the window
        last = self.last if self.last is not None else self.trainer.training_parameters.max_steps
        if last is None or last - self.warmup < self.parts:
            raise ValueError(f"StepWindowCallback(warmup={self.warmup}, parts={self.parts}) needs "
                             f"TrainingParameters.max_steps >= {self.warmup + self.parts} (got {last}): the window "
                             "ends at the last step")
        size = (last - self.warmup) // self.parts
        self._edges = [self.warmup + size * k for k in range(1, self.parts)] + [last]

    def _now(self) -> float:
        if self.trainer.world.device.type == "cuda":
            torch.cuda.synchronize()  # deliberate, at the windows' edges only: host clocks see device time
        return time.perf_counter()

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 0 and self._start is None:
            self._start = (self._now(), 0, None)

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.step_skipped:
            return
        step, stats = trainer.global_step, trainer.step_stats
        if step == 1 and self.first_step_s is None and self._start is not None:
            self.first_step_s = self._now() - self._start[0]
        if step == self.warmup:
            self._start = (self._now(), stats.total_samples, stats.total_tokens)
            self._times = [self._start[0]]
        elif step in self._edges and self._start is not None:
            self._times.append(self._now())
            previous = ([self.warmup] + self._edges)[len(self._times) - 2]
            self.part_step_s.append((self._times[-1] - self._times[-2]) / (step - previous))
            if step == self._edges[-1]:
                self._close(step, stats)

    def _close(self, step: int, stats: Any) -> None:
        t0, samples0, tokens0 = self._start  # type: ignore[misc]
        elapsed, ranks = self._times[-1] - t0, self.trainer.world.dp_size
        self.steps = step - self.warmup
        self.step_s = elapsed / self.steps
        self.samples_per_s = (stats.total_samples - samples0) * ranks / elapsed
        if stats.total_tokens is not None:
            self.tokens_per_s = (stats.total_tokens - (tokens0 or 0)) * ranks / elapsed

    def result(self) -> dict[str, Any]:
        """The measurements as a dict."""
        return {"first_step_s": self.first_step_s, "step_s": self.step_s, "part_step_s": self.part_step_s,
                "steps": self.steps, "tokens_per_s": self.tokens_per_s, "samples_per_s": self.samples_per_s}
