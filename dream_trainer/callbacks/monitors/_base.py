"""What the health monitors share: their log interval and a window of per-step values
kept on the device (read to the host only on the monitor's log steps)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from dream_trainer.protocol.base import Callback
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
    """The last `size` values of a per-step scalar on the device, and `counters` running
    totals, read together in one transfer on log steps; the global step each value belongs
    to is kept on the host.

    A push adds no sync. By default it is one device copy into a preallocated slot;
    ``keep=True`` keeps the pushed tensor itself (no device op at all), for values that are
    fresh tensors nobody writes to afterwards (the trainer's gradient norm) — not for a
    tensor the user's code returned, which it may reuse.
    """

    def __init__(self, size: int, counters: int = 0, keep: bool = False):
        self.size, self.counters, self.keep = size, counters, keep
        self.buffer: torch.Tensor | None = None  # [slots (copy mode)..., counters...]
        self._slots: tuple[torch.Tensor, ...] = ()  # views of its elements
        self._kept: deque[torch.Tensor] = deque(maxlen=size)  # keep mode, oldest first
        self._window = 0 if keep else size  # slots for values in the buffer
        self.steps: deque[int] = deque(maxlen=size)
        self.count = 0  # values ever pushed

    def _allocate(self, device: torch.device) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros(self._window + self.counters, device=device)
            self._slots = self.buffer.unbind()
        return self.buffer

    def push(self, value: torch.Tensor, step: int) -> None:
        if value.ndim or value.requires_grad:
            value = value.detach().reshape(())
        if self.keep:
            self._kept.append(value)  # no device op
        else:
            self._allocate(value.device)
            self._slots[self.count % self.size].copy_(value)  # one device copy: no sync
        self.count += 1
        self.steps.append(step)

    def add(self, counter: int, value: torch.Tensor) -> None:
        """Add `value` (a device scalar) to running total `counter`, in place: no sync."""
        self._allocate(value.device)
        self._slots[self._window + counter].add_(value)

    @property
    def values(self) -> torch.Tensor | None:
        """The window's values on the device (in slot order, not by age, when copied)."""
        if self.keep:
            return torch.stack(tuple(self._kept)).float() if self._kept else None
        return None if self.buffer is None else self.buffer[: min(self.count, self.size)]

    def device_stats(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and std of the window on the device (None while it holds fewer than 2
        values): for decisions that must be made on every step without reading anything."""
        window = self.values
        if window is None or len(window) < 2:
            return None
        return window.mean(), window.std()

    def read(self, extra: list[torch.Tensor] | None = None) -> tuple[list[tuple[int, float]], list[float], list[float]]:
        """``([(step, value)] oldest first, [counter totals], [the `extra` scalars])`` — one
        host transfer for all of them (call it on log steps)."""
        parts = [torch.stack(tuple(self._kept)).float()] if self._kept else []
        if extra:
            parts.append(torch.stack(extra).float())
        if self.buffer is not None or self.counters:
            device = parts[0].device if parts else torch.device("cpu")
            parts.insert(len(self._kept) and 1, self._allocate(device))  # after the kept values
        if not parts:
            values: list[float] = []
        else:
            values = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the read of a log step
        head = len(self._kept) if self.keep else self._window if self.buffer is not None else 0
        window, rest = values[:head], values[head:]
        if not self.keep:  # slot order -> oldest first
            n, start = min(self.count, self.size), (self.count % self.size if self.count > self.size else 0)
            window = window[start:n] + window[:start]
        return list(zip(self.steps, window)), rest[: self.counters], rest[self.counters :]

    def counter_state(self) -> list[float]:
        """The counters as floats, for a checkpoint (a read: checkpoints only)."""
        return [0.0] * self.counters if self.buffer is None else self.buffer[self._window :].tolist()

    def load_counters(self, totals: list[float], device: torch.device) -> None:
        self._allocate(device)
        for slot, total in zip(self._slots[self._window :], totals):
            slot.fill_(total)


def outliers(history: list[tuple[int, float]], new_since: int, threshold: float, min_history: int) -> list[tuple[int, float, float]]:
    """The values logged after step `new_since` that exceed mean + threshold * std of the
    finite values before them (at least `min_history` of them): ``[(step, value, limit)]``.
    One pass (Welford's running mean and variance)."""
    found = []
    n, mean, m2 = 0, 0.0, 0.0
    for step, value in history:
        if step > new_since and n >= min_history:
            limit = mean + threshold * math.sqrt(m2 / (n - 1))
            if not math.isfinite(value) or value > limit:
                found.append((step, value, limit))
        if math.isfinite(value):
            n += 1
            delta = value - mean
            mean += delta / n
            m2 += delta * (value - mean)
    return found


def more_steps(found: list[tuple[int, float, float]]) -> str:
    """The other outlier steps of one warning: "; also at step(s) 12, 13"."""
    if len(found) == 1:
        return ""
    return f"; also at step(s) {', '.join(str(s) for s, _, _ in found[1:6])}{' ...' if len(found) > 6 else ''}"
