"""`MetricsMixin`: the trainer's logging API (`log_dict`, `log_scalar`) and the metrics it
logs by itself. A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there)."""

from __future__ import annotations

from typing import Any

import torch

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.utils import to_floats


class MetricsMixin(AbstractTrainer):
    """Logging: values are read from the device only on log steps."""

    _log_gate: bool | None
    _val_sums: dict[str, list[Any]]
    _pending_logs: dict[str, Any]
    _grad_norms: dict[str, torch.Tensor]
    validating: bool
    sanity_checking: bool

    def _accumulate(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                entry = self._val_sums.setdefault(key, [0.0, 0])
                entry[0] = entry[0] + value
                entry[1] += 1

    def _reduced_means(self) -> dict[str, Any]:
        """Means of the accumulated validation metrics over batches and data-parallel ranks
        (one collective for all of them)."""
        if not self._val_sums:
            return {}
        keys = sorted(self._val_sums)
        means = torch.stack(
            [torch.as_tensor(self._val_sums[k][0], dtype=torch.float32, device=self.world.device).reshape(()) / self._val_sums[k][1] for k in keys]
        )
        self.world.all_reduce(means, "mean")
        return dict(zip(keys, means.unbind()))

    @property
    def is_log_step(self) -> bool:
        """Whether `log_dict` values are logged now (False on non-log steps)."""
        return self._log_gate is not False

    def log_dict(self, metrics: dict[str, Any]) -> None:
        """Record metrics and send them to every callback's `on_log`.

        Inside a training step (and its callbacks), values are read from the device only on
        log steps (every ``log_every_n_steps``), together with the step's own metrics and
        under its step number; on other steps the call returns at once without a sync.
        During validation they are averaged over the run and logged once at its end.
        """
        if self.validating:
            if not self.sanity_checking:
                self._accumulate(metrics)
            return
        if self._log_gate is None:  # outside a training step: log now
            self._dispatch_log(metrics)
        elif self._log_gate:  # a log step: sent with the step's own metrics, one sync
            self._pending_logs.update(metrics)

    def log_scalar(self, name: str, value: Any) -> None:
        """`log_dict` for one value."""
        self.log_dict({name: value})

    def _dispatch_log(self, metrics: dict[str, Any]) -> None:
        if not metrics:
            return
        floats = to_floats(metrics)
        self.logged_metrics.update(floats)
        self.callbacks.on_log(floats, self.global_step)

    def _log_train_step(self, result: dict[str, Any]) -> None:
        """What the trainer logs by itself on a log step: the step's scalar results
        (averaged over data-parallel ranks), learning rates and gradient norms."""
        scalars = {f"train/{k}": v for k, v in result.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        if scalars and self.world.dp_size > 1:
            stacked = self.world.all_reduce(torch.stack([v.float().reshape(()) for v in scalars.values()]), "mean")
            scalars = dict(zip(scalars, stacked.unbind()))
        metrics: dict[str, Any] = {**scalars, "train/epoch": float(self.current_epoch), **self._pending_logs}
        self._pending_logs = {}
        if self.logging_parameters.log_lr:
            optimizers = self.named_optimizers()
            for name, opt in optimizers.items():
                metrics["train/lr" if len(optimizers) == 1 else f"train/lr/{name}"] = opt.param_groups[0]["lr"]
        for name, norm in self._grad_norms.items():
            metrics["train/grad_norm" if len(self._grad_norms) == 1 else f"train/grad_norm/{name}"] = norm
        self._grad_norms = {}
        self._dispatch_log(metrics)
