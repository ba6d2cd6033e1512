"""`LossMonitorCallback`: a smoothed loss and loss spikes (warn, skip or stop)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dream_trainer.callbacks.monitors._base import DeviceWindow, Monitor, check_int, more_steps, outliers

logger = logging.getLogger(__name__)

_POLICIES = ("warn", "skip", "stop")


class LossMonitorCallback(Monitor):
    """The training loss over a window, and spikes (loss > mean + `spike_threshold` x std of
    the window before it, once it holds `min_history` losses).

    On its log steps: ``train/loss_avg`` (the window's mean of the steps' losses,
    ``step_stats.loss``) and ``train/loss_spikes`` (how many so far). `on_spike`:

    - ``"warn"`` (default): spikes are found on log steps (a warning names the step); no sync
      on other steps;
    - ``"stop"``: the same, then every rank stops (`StopTraining`, agreed);
    - ``"skip"``: the spiking step's update is not applied, on any rank. The decision is made
      on the device before each optimizer step (``trainer.skip_step_if``: this step's loss
      from ``step_stats.backward_loss`` against the window's mean and std) and read once per
      step by the trainer's agreement — the price of deciding before the update.
    """

    def __init__(self, log_interval: int = 100, history_size: int = 100, spike_threshold: float = 3.0,
                 min_history: int = 20, on_spike: str = "warn"):
        super().__init__(log_interval)
        check_int("LossMonitorCallback", "history_size", history_size, 2)
        check_int("LossMonitorCallback", "min_history", min_history, 2)
        if on_spike not in _POLICIES:
            raise ValueError(f"LossMonitorCallback(on_spike={on_spike!r}) is invalid: expected one of {list(_POLICIES)}")
        self.spike_threshold, self.min_history, self.on_spike = spike_threshold, min_history, on_spike
        self.vetoes_steps = on_spike == "skip"  # the ranks agree on every step only then
        self.critical = on_spike != "warn"  # a policy the user chose is enforced, not swallowed
        # The step's loss is a fresh tensor nobody writes to afterwards: kept as it is (no device op).
        self.window = DeviceWindow(history_size, keep=True)
        self.spikes: list[tuple[int, float, float]] = []  # (step, loss, limit), found on log steps
        self.skipped = 0
        self._checked_until = 0

    def post_setup(self) -> None:
        if self.on_spike == "skip":
            self.trainer.request_backward_loss()

    def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
        if self.on_spike != "skip" or self.window.count < self.min_history:
            return
        loss, stats = self.trainer.step_stats.backward_loss, self.window.device_stats()
        if loss is not None and stats is not None:
            mean, std = stats
            self.trainer.skip_step_if((loss > mean + self.spike_threshold * std) | ~torch.isfinite(loss), "loss spike")

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        if trainer.step_skipped:
            if trainer.step_stats.skipped == "loss spike":
                self.skipped += 1
                logger.warning("loss spike at step %d (batch %d): the update was skipped on every rank",
                               trainer.global_step + 1, batch_idx)
            return
        loss = trainer.step_stats.loss
        if loss is None:
            return
        self.window.push(loss, trainer.global_step)  # a reference: no device op
        if trainer.global_step % self.log_interval == 0:
            self._log()

    def _log(self) -> None:
        history, _, _ = self.window.read()  # the one read of this log step
        found = outliers(history, self._checked_until, self.spike_threshold, self.min_history)
        self._checked_until = history[-1][0]
        if found:  # one warning per log step
            self.spikes.extend(found)
            step, value, limit = found[0]
            logger.warning("loss spike at step %d: %.4g > %.4g (mean + %.1f std of the steps before)%s",
                           step, value, limit, self.spike_threshold, more_steps(found))
        values = [v for _, v in history]
        self.trainer.log_dict({"train/loss_avg": sum(values) / len(values),
                               "train/loss_spikes": float(len(self.spikes) + self.skipped)})
        if found and self.on_spike == "stop":
            self.trainer.request_stop(f"loss spike at step {found[0][0]}")

    def state_dict(self) -> dict[str, Any]:
        return {"spikes": list(self.spikes), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes = [tuple(s) for s in state["spikes"]]  # type: ignore[misc]
        self.skipped = int(state["skipped"])
