"""`MetricsMixin`: the trainer's logging API (`log_dict`, `log_scalar`) and the metrics it
logs by itself. A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there).

Nothing logged is lost silently: a value that is not a number raises at the call; a value
logged on a step that is not a log step is kept (the latest per name) and sent at the next
log step or at the end of the epoch; a value logged from `on_log` is sent right after the
dispatch under way, under the same step (one nested round: logging from that nested
dispatch raises `LogRecursionError`); a non-number put into the dict `on_log` receives
raises there (`OnLogMetrics`).
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

import torch

from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.telemetry import StepStats
from dream_trainer.utils import to_floats


class MetricsMixin(AbstractTrainer):
    """Logging: values are read from the device only on log steps."""

    _log_gate: bool | None
    _val_sums: dict[str, list[Any]]
    _pending_logs: dict[str, Any]
    _log_queue: list[dict[str, Any]] | None
    _log_nested = False  # True while the values logged from an on_log are dispatched
    step_stats: StepStats
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
        """Whether `log_dict` values are sent to `on_log` now. False inside a step that is
        not a log step (the values are then kept for the next one): skip expensive metrics."""
        return self._log_gate is not False

    def _log_step_kind(self, step: int) -> int:
        """2: a log step of the trainer (its own metrics are logged); 1: a log step of a
        callback's own interval (only what was logged is sent); 0: not a log step."""
        if step % self.logging_parameters.log_every_n_steps == 0:  # type: ignore[attr-defined]
            return 2
        return 1 if any(step % interval == 0 for interval in self.callbacks.log_intervals) else 0

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
        _check_metrics(metrics)
        if self.sanity_checking:  # the sanity run is not a measurement
            return
        if self._log_queue is not None:  # from an on_log: right after this dispatch, same step
            self._queue_nested_log(metrics)
            return
        if self.validating:
            self._accumulate(metrics)
            return
        if self._log_gate is None:  # outside a training step: log now (with what was kept)
            pending, self._pending_logs = self._pending_logs, {}
            self._dispatch_log({**pending, **metrics})
        else:  # sent after post_train_step on a log step, one sync for all
            self._pending_logs.update(metrics)

    def log_scalar(self, name: str, value: Any) -> None:
        """`log_dict` for one value."""
        self.log_dict({name: value})

    def _dispatch_log(self, metrics: dict[str, Any]) -> None:
        """Send `metrics` to `on_log` under the current step, then (one nested round) what
        the `on_log` hooks logged, under the same step."""
        if not metrics:
            return
        if self._log_queue is not None:  # logged from an on_log: sent after this dispatch
            self._queue_nested_log(metrics)
            return
        self._log_queue = []
        try:
            self._send_log(metrics)
            nested, self._log_queue, self._log_nested = self._log_queue, [], True
            for logged in nested:  # one on_log per call made, in order: none overwrites another
                self._send_log(logged)
        finally:
            self._log_queue, self._log_nested = None, False

    def _send_log(self, metrics: dict[str, Any]) -> None:
        floats = OnLogMetrics(to_floats(metrics))
        self.logged_metrics.update(floats)
        self.callbacks.on_log(floats, self.global_step)
        self.logged_metrics.update(floats)  # with what the callbacks added or edited there

    def _queue_nested_log(self, metrics: dict[str, Any]) -> None:
        """A `log_dict` from an `on_log`: queued for the nested round, or (from the nested
        round itself, which would never end) `LogRecursionError`."""
        if self._log_nested:
            raise LogRecursionError(
                f"callback {_on_log_caller()} logged {sorted(metrics)} from on_log while the values logged from "
                f"an on_log were dispatched (step {self.global_step}). Values logged from on_log are dispatched "
                "once more, right after, under the same step; logging from that nested dispatch too would never "
                "end. Log only in response to the metrics that call for it (e.g. `if 'train/loss' in metrics:`)"
            )
        pending, self._pending_logs = self._pending_logs, {}  # kept values go with the next dispatch
        self._log_queue.append({**pending, **metrics})  # type: ignore[union-attr]

    def _flush_pending_logs(self) -> None:
        pending, self._pending_logs = self._pending_logs, {}
        self._dispatch_log(pending)

    def _log_train_step(self, own: dict[str, Any]) -> None:
        """Send a log step's metrics: the trainer's own (`_own_step_metrics`, on its log
        steps) with what was logged since the last log step, in one dispatch."""
        metrics = {**own, **self._pending_logs}
        self._pending_logs = {}
        self._dispatch_log(metrics)

    def _own_step_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """What the trainer logs by itself on its log steps (made before `post_train_step`,
        so ``step_stats.world_*`` are current there): the step's scalar results averaged
        over ranks, the learning rate the step used and the gradient norms."""
        if self._log_step_kind(self.global_step) != 2:
            return {}
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
        if self.logging_parameters.log_lr:  # type: ignore[attr-defined]
            for name, lr in stats.lr.items():
                metrics["train/lr" if len(stats.lr) == 1 else f"train/lr/{name}"] = lr
        params = self.logging_parameters, self.training_parameters  # type: ignore[attr-defined]
        if params[0].log_grad_norm or params[1].gradient_clip_val is not None:
            for name, norm in stats.grad_norm.items():
                metrics["train/grad_norm" if len(stats.grad_norm) == 1 else f"train/grad_norm/{name}"] = norm
        return metrics


def _check_metrics(metrics: Any) -> None:
    """`TypeError` at the call for what cannot be logged (it would break every sink later)."""
    if not isinstance(metrics, dict):
        raise TypeError(f"log_dict takes a dict of name -> number, got {type(metrics).__name__}")
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names are strings, got {name!r} ({type(name).__name__})")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype.is_complex:
                raise TypeError(
                    f"metric {name!r}: a tensor of shape {tuple(value.shape)} and dtype {value.dtype} cannot be "
                    "logged; log a one-element real tensor (e.g. its mean)"
                )
        elif not isinstance(value, numbers.Real):
            raise TypeError(f"metric {name!r}={value!r} ({type(value).__name__}) is not a number or a one-element tensor")


class LogRecursionError(RuntimeError):
    """A callback logged from `on_log` during the nested dispatch of values logged from an
    `on_log` (which would re-dispatch without end)."""


class OnLogMetrics(dict):  # type: ignore[type-arg]
    """The ``metrics`` dict every `on_log` receives: one dict for all the callbacks of a
    dispatch, so an entry a callback adds or edits is seen by the callbacks after it (and
    lands in ``trainer.logged_metrics``). What is put there is checked like `log_dict`
    checks it (a number or a one-element real tensor, stored as a float); anything else
    raises `TypeError` at the assignment, naming the callback and the key, before it can
    reach a sink. Copy it (``dict(metrics)``) to keep it past the hook."""

    __slots__ = ()

    def __setitem__(self, key: str, value: Any) -> None:
        try:
            _check_metrics({key: value})
        except TypeError as exc:
            raise TypeError(f"callback {_on_log_caller()} put a value into on_log's metrics that cannot be logged: "
                            f"{exc}") from None
        # float() reads a tensor to the host: on_log runs on log steps only.
        super().__setitem__(key, float(value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> OnLogMetrics:  # type: ignore[override,misc]
        self.update(other)
        return self


def _on_log_caller() -> str:
    """The callback whose hook is running (the innermost frame whose ``self`` is a
    `Callback`), by its name in the trainer's collection. Only on the error paths."""
    frame = sys._getframe(1)
    while frame is not None:
        callback = frame.f_locals.get("self")
        if isinstance(callback, Callback):
            collection = getattr(getattr(callback, "trainer", None), "callbacks", None)
            names = [name for name, cb in collection.items() if cb is callback] if collection is not None else []
            return f"{names[0]!r} ({type(callback).__name__})" if names else repr(type(callback).__name__)
        frame = frame.f_back  # type: ignore[assignment]
    return "(an on_log hook)"
