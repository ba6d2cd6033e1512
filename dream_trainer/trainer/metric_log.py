"""`MetricLog`: the metrics of a run — the last value sent of each (`logged`), the values
waiting for the next log step (`pending`), the sums of a validation run, and the nested
round of values logged from `on_log`. A component of the trainer with no trainer in it: it
sends through the function it is given (`MetricLog.for_trainer`: every callback's `on_log`
under the trainer's current step), and it makes the metrics the trainer logs by itself on
its log steps (`step_kind`, `own_step_metrics`) from what is passed in.

Nothing logged is lost silently: a value that is not a number raises at the call
(`check_metrics`); a value logged on a step that is not a log step is kept (the latest per
name) and sent at the next log step or at the end of the epoch; a value logged from
`on_log` is sent right after the dispatch under way, under the same step (one nested
round: logging from that nested dispatch raises `LogRecursionError`); a non-number put into
the dict `on_log` receives raises there (`OnLogMetrics`).

Transient: nothing here goes into a checkpoint (a resumed run logs afresh).
"""

from __future__ import annotations

import logging
import numbers
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from dream_trainer.protocol.base import Callback
from dream_trainer.utils import to_floats

if TYPE_CHECKING:
    from typing_extensions import Self

    from dream_trainer.trainer.telemetry import StepStats

logger = logging.getLogger(__name__)


class _Reducer(Protocol):
    """What `MetricLog.validation_means` needs of the world."""

    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max", "min"] = ...) -> torch.Tensor: ...


class _StepWorld(_Reducer, Protocol):
    """What `MetricLog.own_step_metrics` needs of the world."""

    @property
    def dp_size(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class _OnLog(Protocol):
    def on_log(self, metrics: dict[str, float], step: int) -> None: ...

    def listens(self, hook: str) -> bool: ...


class _LogOwner(Protocol):
    """Where `MetricLog.for_trainer` sends: the callbacks, under the current step."""

    @property
    def callbacks(self) -> _OnLog: ...

    @property
    def global_step(self) -> int: ...


class MetricLog:
    """What was logged, and what waits to be sent.

    Attributes:
        logged: the last value of every metric sent (``trainer.logged_metrics``). Values
            sent while nothing listens (`listening` False: no `on_log` hook, no tracker) are
            kept as they were logged (a tensor: a copy on its device) and read to the host
            when `logged` is read: a log step nobody reads costs no host read (on a GPU, no
            sync).
        pending: values logged inside a training step that is not a log step, the latest
            per name, sent with the next log step's metrics (or at the epoch's end).
        gate: None outside a training step (a log call is sent at once); inside one, True
            on a log step (sent with the step's metrics) and False otherwise (kept).
    """

    def __init__(self, send: Callable[[OnLogMetrics], None], listening: Callable[[], bool] | None = None):
        self._send_fn = send
        self._listening = listening
        self._logged: dict[str, float] = {}
        self._unread: dict[str, Any] = {}  # sent while nothing listened: read when `logged` is
        self.pending: dict[str, Any] = {}
        self.gate: bool | None = None
        self._queue: list[dict[str, Any]] | None = None  # set while on_log runs: logs made there
        self._nested = False  # True while the values logged from an on_log are dispatched
        self._val_sums: dict[str, list[Any]] = {}
        self._step_sums: tuple[int, dict[str, torch.Tensor], int] | None = None  # (step, sums, micro-batches)
        self.display_fields: dict[str, str] = {}  # short status strings monitors publish for displays
        self._partial_counts_warned = False  # some ranks count batches, not all: said once

    @classmethod
    def for_trainer(cls, trainer: _LogOwner) -> MetricLog:
        """The trainer's log: it sends to every callback's `on_log` under the trainer's
        current ``global_step`` (read at the send)."""

        def send(metrics: OnLogMetrics) -> None:
            trainer.callbacks.on_log(metrics, trainer.global_step)

        return cls(send, lambda: trainer.callbacks.listens("on_log"))

    @property
    def logged(self) -> dict[str, float]:
        """The last value sent of every metric (values nobody listened to are read now, once)."""
        if self._unread:
            unread, self._unread = self._unread, {}
            self._logged.update(to_floats(unread))
        return self._logged

    @staticmethod
    def step_kind(step: int, every: int, intervals: Sequence[int]) -> int:
        """Optimizer step `step`: 2, a log step of the trainer (every `every` steps: its own
        metrics are logged); 1, a log step of a callback's own interval (one of
        `intervals`: only what was logged is sent); 0, not a log step."""
        if step % every == 0:
            return 2
        for interval in intervals:  # a loop, not any(<generator>): no frame per step
            if step % interval == 0:
                return 1
        return 0

    def own_step_metrics(self, result: dict[str, Any], stats: StepStats, world: _StepWorld, epoch: int,
                         log_lr: bool, log_grad_norm: bool) -> dict[str, Any]:
        """What the trainer logs by itself on its log steps (`step_kind` 2), made before
        `post_train_step`: the step's scalar results (`result`, averaged over its
        micro-batches by `step_means`) averaged over ranks, ``train/epoch``, the learning
        rates the step used (`log_lr`) and the gradient norms (`log_grad_norm`). Sets
        ``stats.world_samples``/``world_tokens`` (one all-reduce with the means)."""
        scalars = {f"train/{k}": v for k, v in result.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        if world.dp_size > 1:
            scalars, counting = _world_means(scalars, stats, world)
            if 0 < counting < world.world_size and not self._partial_counts_warned:
                self._partial_counts_warned = True
                logger.warning("batch counts were asked for on %d of %d ranks: step_stats.world_samples/world_tokens "
                               "stay None (a sum over some ranks would be wrong); call trainer.request_batch_counts() "
                               "on every rank", counting, world.world_size)
        else:
            stats.world_samples, stats.world_tokens = stats.total_samples, stats.total_tokens
        metrics: dict[str, Any] = {**scalars, "train/epoch": float(epoch)}
        if log_lr:
            _named_values(metrics, "train/lr", stats.lr)
        if log_grad_norm:
            _named_values(metrics, "train/grad_norm", stats.grad_norm)
        return metrics

    def step_means(self, step: int, result: dict[str, Any], accumulating: bool) -> dict[str, Any] | None:
        """The scalar results of optimizer step `step` averaged over its micro-batches
        (device adds, no sync): None while the step accumulates, then `result` with its
        scalars replaced by their means. With one micro-batch, `result` itself."""
        held = self._step_sums
        if held is None or held[0] != step:  # the step's first micro-batch
            if not accumulating:
                return result
            held = (step, {}, 0)
        sums = held[1]
        for key, value in result.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.detach().float().reshape(())
                sums[key] = sums[key] + value if key in sums else value
        count = held[2] + 1
        self._step_sums = (step, sums, count) if accumulating else None
        return None if accumulating else {**result, **{key: total / count for key, total in sums.items()}}

    def log(self, metrics: dict[str, Any], validating: bool = False) -> None:
        """A checked `log_dict` call: queued for the nested round (from an `on_log`),
        summed (during validation), sent now (outside a step, with what was kept) or kept
        for the step's log (inside a step)."""
        if self._queue is not None:  # from an on_log: right after this dispatch, same step
            self._queue_nested(self._queue, metrics)
        elif validating:
            self.accumulate(metrics)
        elif self.gate is None:
            pending, self.pending = self.pending, {}
            self.dispatch({**pending, **metrics})
        else:
            self.pending.update(metrics)

    def dispatch(self, metrics: dict[str, Any]) -> None:
        """Send `metrics`, then (one nested round) what the `on_log` hooks logged."""
        if not metrics:
            return
        if self._queue is not None:  # logged from an on_log: sent after this dispatch
            self._queue_nested(self._queue, metrics)
            return
        if self._listening is not None and not self._listening():  # nobody reads it now: no on_log to run
            self._keep(metrics)
            return
        self._queue = []
        try:
            self._deliver(metrics)
            nested, self._queue, self._nested = self._queue, [], True
            for logged in nested:  # one on_log per call made, in order: none overwrites another
                self._send(logged)
        finally:
            self._queue, self._nested = None, False

    def send_step(self, own: dict[str, Any]) -> None:
        """A log step: the trainer's own metrics with what was kept since the last one, in
        one dispatch."""
        if self.pending:  # `own` is the step's own new dict
            own.update(self.pending)
            self.pending = {}
        self.dispatch(own)

    def flush(self) -> None:
        """Send what was kept (the end of an epoch): nothing logged is dropped."""
        pending, self.pending = self.pending, {}
        self.dispatch(pending)

    def _send(self, metrics: dict[str, Any]) -> None:
        if self._listening is not None and not self._listening():
            self._keep(metrics)
        else:
            self._deliver(metrics)

    def _keep(self, metrics: dict[str, Any]) -> None:
        """Sent while nobody listens: kept for `logged` as logged (a tensor: a copy on its
        device, no host read)."""
        self._unread.update({k: (v.detach() if v.requires_grad else v).clone() if isinstance(v, torch.Tensor) else v
                             for k, v in metrics.items()})

    def _deliver(self, metrics: dict[str, Any]) -> None:
        floats = OnLogMetrics(to_floats(metrics))
        logged = self.logged
        logged.update(floats)
        self._send_fn(floats)
        logged.update(floats)  # with what the callbacks added or edited there

    def _queue_nested(self, queue: list[dict[str, Any]], metrics: dict[str, Any]) -> None:
        """A log call from an `on_log`: queued for the nested round, or (from the nested
        round itself, which would never end) `LogRecursionError`."""
        if self._nested:
            raise LogRecursionError(
                f"callback {_on_log_caller()} logged {sorted(metrics)} from on_log while the values logged from "
                "an on_log were dispatched. Values logged from on_log are dispatched once more, right after, under "
                "the same step; logging from that nested dispatch too would never end. Log only in response to the "
                "metrics that call for it (e.g. `if 'train/loss' in metrics:`)"
            )
        pending, self.pending = self.pending, {}  # kept values go with the next dispatch
        queue.append({**pending, **metrics})

    # ------------------------------------------------------------------ validation
    def start_validation(self) -> None:
        """Forget the sums of the previous validation run."""
        self._val_sums = {}

    def accumulate(self, metrics: dict[str, Any]) -> None:
        """Add a validation step's scalars to the run's sums."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                entry = self._val_sums.setdefault(key, [0.0, 0])
                entry[0] = entry[0] + value
                entry[1] += 1

    def validation_means(self, world: _Reducer) -> dict[str, Any]:
        """Means of the accumulated validation metrics over batches and data-parallel ranks
        (one collective for all of them)."""
        if not self._val_sums:
            return {}
        keys = sorted(self._val_sums)
        means = torch.stack([
            torch.as_tensor(self._val_sums[k][0], dtype=torch.float32, device=world.device).reshape(())
            / self._val_sums[k][1] for k in keys
        ])
        world.all_reduce(means, "mean")
        return dict(zip(keys, means.unbind()))


def check_metrics(metrics: Any) -> None:
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


class OnLogMetrics(dict[str, float]):
    """The ``metrics`` dict every `on_log` receives: one dict for all the callbacks of a
    dispatch, so an entry a callback adds or edits is seen by the callbacks after it (and
    lands in ``trainer.logged_metrics``). What is put there is checked like `log_dict`
    checks it (a number or a one-element real tensor, stored as a float); anything else
    raises `TypeError` at the assignment, naming the callback and the key, before it can
    reach a sink. Copy it (``dict(metrics)``) to keep it past the hook."""

    __slots__ = ()

    def __setitem__(self, key: str, value: Any) -> None:
        try:
            check_metrics({key: value})
        except TypeError as exc:
            raise TypeError(f"callback {_on_log_caller()} put a value into on_log's metrics that cannot be logged: "
                            f"{exc}") from None
        # float() reads a tensor to the host: on_log runs on log steps only.
        super().__setitem__(key, float(value))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def _checked_ior(self, other: Any) -> Self:
        self.update(other)
        return self

    # ``metrics |= other``, checked like `update` (dict's own skips `__setitem__`). Typed Any:
    # dict's overloads of ``|`` and ``|=`` return a plain dict.
    __ior__: Any = _checked_ior


def _on_log_caller() -> str:
    """The callback whose hook is running (the innermost frame whose ``self`` is a
    `Callback`), by its name in the trainer's collection. Only on the error paths."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        callback = frame.f_locals.get("self")
        if isinstance(callback, Callback):
            collection = getattr(getattr(callback, "trainer", None), "callbacks", None)
            names = [name for name, cb in collection.items() if cb is callback] if collection is not None else []
            return f"{names[0]!r} ({type(callback).__name__})" if names else repr(type(callback).__name__)
        frame = frame.f_back
    return "(an on_log hook)"


def _world_means(scalars: dict[str, torch.Tensor], stats: StepStats,
                 world: _StepWorld) -> tuple[dict[str, torch.Tensor], int]:
    """`scalars` averaged over ranks and the samples/tokens totals of the data-parallel
    ranks (``stats.world_*``), in one all-reduce. The totals are the world's only where
    every rank counts (`request_batch_counts` on each): else None on every rank, not a
    partial sum. Also how many ranks count. In float64: token totals pass 2**24 (float32's
    last exact integer) within minutes of pre-training and stay exact to 2**53."""
    values = [v.detach().reshape(()).double() for v in scalars.values()]
    device = values[0].device if values else world.device
    counted = stats.total_samples is not None
    counts = torch.tensor([stats.total_samples or 0, stats.total_tokens or 0, counted], dtype=torch.float64)
    stacked = torch.cat([torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device),
                         counts.to(device=device)])
    world.all_reduce(stacked, "sum")
    n = len(values)
    means = dict(zip(scalars, (stacked[:n] / world.world_size).float().unbind()))
    per_dp = world.world_size // world.dp_size  # ranks that share one data shard (TP, CP)
    totals = stacked[n:].tolist()  # read with the metrics anyway: this is a log step
    ranks_counting = int(round(totals[2]))
    everywhere = ranks_counting == world.world_size
    stats.world_samples = int(round(totals[0])) // per_dp if everywhere else None
    stats.world_tokens = int(round(totals[1])) // per_dp if everywhere and stats.total_tokens is not None else None
    return means, ranks_counting


def _named_values(metrics: dict[str, Any], prefix: str, values: dict[str, Any]) -> None:
    """``metrics[prefix]`` for one value, else ``metrics[prefix/<name>]`` for each."""
    for name, value in values.items():
        metrics[prefix if len(values) == 1 else f"{prefix}/{name}"] = value
