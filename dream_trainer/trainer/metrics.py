"""`MetricsMixin`: the trainer's logging API (`log_dict`, `log_scalar`, `is_log_step`) and
the metrics it logs by itself. The state lives in `MetricLog` (``trainer.metric_log``); see
`dream_trainer.trainer.metric_log` for what happens to a logged value.
"""

from __future__ import annotations

from typing import Any

import torch

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.metric_log import LogRecursionError, MetricLog, OnLogMetrics, check_metrics
from dream_trainer.trainer.telemetry import StepStats

__all__ = ["LogRecursionError", "MetricsMixin", "OnLogMetrics"]


class MetricsMixin(AbstractTrainer):
    """Logging: values are read from the device only on log steps."""

    metric_log: MetricLog
    step_stats: StepStats
    validating: bool
    sanity_checking: bool

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The last value of every metric sent to `on_log`."""
        return self.metric_log.logged

    @property
    def display_fields(self) -> dict[str, str]:
        """Short status strings monitors publish for displays (progress bar, dashboard),
        by name: ``trainer.display_fields["mem"] = "rss: 1.2GB"``."""
        return self.metric_log.display_fields

    @property
    def is_log_step(self) -> bool:
        """Whether `log_dict` values are sent to `on_log` now. False inside a step that is
        not a log step (the values are then kept for the next one): skip expensive metrics."""
        return self.metric_log.gate is not False

    def _log_step_kind(self, step: int) -> int:
        """2: a log step of the trainer (its own metrics are logged); 1: a log step of a
        callback's own interval (only what was logged is sent); 0: not a log step."""
        if step % self.config.logging_parameters.log_every_n_steps == 0:
            return 2
        intervals = self.callbacks.log_intervals
        return 1 if intervals and any(step % interval == 0 for interval in intervals) else 0

    def log_dict(self, metrics: dict[str, Any]) -> None:
        """Record metrics and send them to every callback's `on_log`, from any hook.

        Values are numbers or one-element tensors; anything else raises `TypeError` here.
        Inside a training step (and its callbacks) tensors are read from the device only on
        log steps, together with the step's own metrics and under its step number; on other
        steps the call keeps the value (the latest per name) for the next log step — or the
        end of the epoch — without a sync. During validation the values are averaged over
        the run and logged at its end. From an `on_log`, the values are sent right after the
        dispatch under way, under the same step; logging again from that nested dispatch
        raises `LogRecursionError` (it would never end).
        """
        check_metrics(metrics)
        if self.sanity_checking:  # the sanity run is not a measurement
            return
        self.metric_log.log(metrics, validating=self.validating)

    def log_scalar(self, name: str, value: Any) -> None:
        """`log_dict` for one value."""
        self.log_dict({name: value})

    def _send_to_callbacks(self, metrics: OnLogMetrics) -> None:
        """How `MetricLog` sends: every callback's `on_log`, under the current step."""
        self.callbacks.on_log(metrics, self.global_step)

    def _own_step_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """What the trainer logs by itself on its log steps (made before `post_train_step`,
        so ``step_stats.world_*`` are current there): the step's scalar results averaged
        over its micro-batches (`MetricLog.step_means`) and over ranks, the learning rate the step
        used and the gradient norms. Called on the trainer's own log steps (`_log_step_kind` 2)."""
        stats, world = self.step_stats, self.world
        scalars = {f"train/{k}": v for k, v in result.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        if world.dp_size > 1:  # one all-reduce: the metrics' means and the samples/tokens totals
            values = [v.float().reshape(()) for v in scalars.values()]
            device = values[0].device if values else world.device
            counts = torch.tensor([stats.total_samples, stats.total_tokens or 0], dtype=torch.float64)
            stacked = torch.cat([torch.stack(values) if values else torch.zeros(0, device=device),
                                 counts.to(device=device, dtype=torch.float32)])
            world.all_reduce(stacked, "sum")
            n = len(values)
            scalars = dict(zip(scalars, (stacked[:n] / world.world_size).unbind()))
            per_dp = world.world_size // world.dp_size  # ranks that share one data shard (TP, CP)
            totals = stacked[n:].tolist()  # read with the metrics anyway: this is a log step
            stats.world_samples = int(round(totals[0])) // per_dp
            stats.world_tokens = int(round(totals[1])) // per_dp if stats.total_tokens is not None else None
        else:
            stats.world_samples, stats.world_tokens = stats.total_samples, stats.total_tokens
        metrics: dict[str, Any] = {**scalars, "train/epoch": float(self.current_epoch)}
        if self.config.logging_parameters.log_lr:
            for name, lr in stats.lr.items():
                metrics["train/lr" if len(stats.lr) == 1 else f"train/lr/{name}"] = lr
        params = self.config.logging_parameters, self.config.training_parameters
        if params[0].log_grad_norm or params[1].gradient_clip_val is not None:
            for name, norm in stats.grad_norm.items():
                metrics["train/grad_norm" if len(stats.grad_norm) == 1 else f"train/grad_norm/{name}"] = norm
        return metrics


