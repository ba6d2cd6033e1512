"""What the health monitors share: their log interval and a window of per-step values
kept on the device (read to the host only on the monitor's log steps)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.trainer.base import BaseTrainer


def check_int(owner: str, name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{owner}({name}={value!r}) is invalid: expected an int >= {lowest}")


class Monitor(Callback[BaseTrainer]):
    """A non-critical callback with its own log interval: its log steps are log steps of
    the trainer too (``trainer.is_log_step`` is True there, its values are sent at once)."""

    critical = False

    def __init__(self, log_interval: int):
        check_int(type(self).__name__, "log_interval", log_interval, 1)
        self.log_interval = log_interval
        self.log_every_n_steps = log_interval

    def step_done(self) -> bool:
        """In `post_train_step`: an optimizer step was taken (not a micro-step, not skipped)."""
        trainer = self.trainer
        return not trainer.is_accumulating_gradients and not trainer.step_skipped

    def due(self) -> bool:
        """In `post_train_step`: this optimizer step is one of the monitor's log steps."""
        return self.step_done() and self.trainer.global_step % self.log_interval == 0


class DeviceWindow:
    """The last `size` values of a per-step scalar, on the device (no sync to add one),
    with the global step each belongs to (host-side)."""

    def __init__(self, size: int):
        self.size = size
        self.values: torch.Tensor | None = None
        self.steps: deque[int] = deque(maxlen=size)
        self.count = 0  # values ever pushed

    def push(self, value: torch.Tensor, step: int) -> None:
        if value.ndim or value.dtype != torch.float32 or value.requires_grad:
            value = value.detach().reshape(()).float()
        if self.values is None:
            self.values = torch.zeros(self.size, device=value.device)
        self.values[self.count % self.size] = value  # a device copy: no sync
        self.count += 1
        self.steps.append(step)

    def device_stats(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and std of the window on the device (None while empty): for decisions that
        must be made on every step without reading anything."""
        n = min(self.count, self.size)
        if n < 2 or self.values is None:
            return None
        window = self.values[:n]
        return window.mean(), window.std()

    def read(self) -> list[tuple[int, float]]:
        """``[(step, value)]``, oldest first — one host transfer (call it on log steps)."""
        n = min(self.count, self.size)
        if not n or self.values is None:
            return []
        values = self.values[:n].tolist()  # the deliberate read of a log step
        start = self.count % self.size if self.count > self.size else 0
        ordered = values[start:] + values[:start]
        return list(zip(self.steps, ordered))


def outliers(history: list[tuple[int, float]], new_since: int, threshold: float, min_history: int) -> list[tuple[int, float, float]]:
    """The values logged after step `new_since` that exceed mean + threshold * std of the
    values before them (at least `min_history` of them): ``[(step, value, limit)]``."""
    found = []
    for i, (step, value) in enumerate(history):
        if step <= new_since:
            continue
        before = [v for _, v in history[:i] if math.isfinite(v)]
        if len(before) < min_history:
            continue
        mean = sum(before) / len(before)
        std = math.sqrt(sum((v - mean) ** 2 for v in before) / (len(before) - 1))
        limit = mean + threshold * std
        if not math.isfinite(value) or value > limit:
            found.append((step, value, limit))
    return found


def more_steps(found: list[tuple[int, float, float]]) -> str:
    """The other outlier steps of one warning: "; also at step(s) 12, 13"."""
    if len(found) == 1:
        return ""
    return f"; also at step(s) {', '.join(str(s) for s, _, _ in found[1:6])}{' ...' if len(found) > 6 else ''}"
