"""`StepMixin`: the optimizer step and step control — ``backward``, ``step`` (clip, hooks,
update, zero, schedulers), vetoed steps and skipped batches agreed by every rank, and the
per-step telemetry they record (`StepStats`). A mixin of `BaseTrainer` (no ``__init__``;
its attributes are set there).

Step control is armed only when something may use it (``vetoes_steps``/``skips_batches`` on
a callback or on the trainer class): then each optimizer step (each batch) costs one MAX
all-reduce of one int on the CPU, a host wait but no device sync. A device-side decision
(`skip_step_if`) is read to the host once, on that step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.metric_log import MetricLog
from dream_trainer.trainer.step_path import OptimizerRoute, StepPath
from dream_trainer.trainer.telemetry import StepStats, count_batch
from dream_trainer.utils import rng_state, set_rng_state

logger = logging.getLogger(__name__)

_MAX_RETRIES = 4
"""How often one (micro-)batch is retried after failures the callbacks recover."""


class _PeerStepFailed(Exception):
    """Raised in `backward` on a rank whose step went through when another rank's failed."""


class _Retry(Exception):
    """Every rank retries the (micro-)batch."""


class StepMixin(AbstractTrainer):
    """The optimizer step, step control and step telemetry."""

    vetoes_steps: ClassVar[bool] = False
    """Set True on a trainer class whose own code (``training_step``) calls `skip_step`."""

    step_path: StepPath
    metric_log: MetricLog
    is_accumulating_gradients: bool

    @property
    def step_stats(self) -> StepStats:
        """What the step that just ended (or is running) measured: see `StepStats`."""
        return self.step_path.stats

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the run started (vetoes, skipped batches)."""
        return self.step_path.skipped_steps

    @property
    def skipped_batches(self) -> int:
        """Batches skipped since the run started (`SkipBatch`, `request_skip_batch`)."""
        return self.step_path.skipped_batches

    # ------------------------------------------------------------------ user API
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by 1/`gradient_accumulation_steps` when accumulating.
        With a callback that ``recovers_errors``, the ranks first agree that no rank's
        ``training_step`` failed before its backward (see `on_train_step_error`)."""
        self._before_backward()
        self._after_loss(loss)
        accumulation = self.gradient_accumulation_steps
        if accumulation > 1:
            loss = loss / accumulation
        loss.backward(**kwargs)

    def _before_backward(self) -> None:
        """With a callback that ``recovers_errors``: the ranks agree that none failed
        before its backward."""
        path = self.step_path
        if self.callbacks.recovers_errors and not path.agreed:
            path.agreed = True
            if self._any_rank(False):  # another rank's step failed: this one's work is dropped
                raise _PeerStepFailed()

    def _after_loss(self, loss: torch.Tensor) -> None:
        if self.step_path.backward_loss_wanted:  # a monitor decides on this step's loss before its update
            self.step_path.stats.add_backward(loss)

    def step(self, optimizer: Optimizer, model: nn.Module | None = None) -> torch.Tensor | None:
        """Clip, step and zero `optimizer`, then step its schedulers; a no-op while
        accumulating. A step vetoed on any rank (`skip_step`, `pre_optimizer_step`
        returning False) is skipped on every rank: no update, no scheduler step, gradients
        dropped. Returns the gradient norm when one was computed (a device tensor)."""
        if self.is_accumulating_gradients:
            return None
        started = time.perf_counter()
        path, world, cb = self.step_path, self.world, self.callbacks
        stats = path.stats
        try:
            route = path.route(optimizer, self._route)
            name, model = route.name, model if model is not None else route.model
            world.sync_gradients(route.params)  # a no-op but across replica groups (torchft)
            norm = None
            clip = self.config.training_parameters.gradient_clip_val
            if clip is not None:
                norm = stats.grad_norm[name] = world.clip_grad_norm_(route.params, clip)
                stats.clip_limit[name] = clip  # `stats.clipped` compares when read
            elif path.grad_norm_wanted or (self.metric_log.gate and self.config.logging_parameters.log_grad_norm):
                norm = stats.grad_norm[name] = world.total_gradient_norm(route.params)
            vetoes = cb.pre_optimizer_step(model, optimizer)  # type: ignore[arg-type]
            # What optimizer.step() sees: read after pre_optimizer_step (a warm-up may set
            # it there); schedulers step after.
            stats.lr[name] = optimizer.param_groups[0]["lr"]
            reason = world.agree_on_step(self._agreed_skip(vetoes))  # a fault-tolerant world: the quorum's commit
            if reason is None:
                optimizer.step()
                path.stepped = True
                cb.post_optimizer_step(model, optimizer)  # type: ignore[arg-type]
            else:
                stats.skipped = reason
            self._drop_gradients(model, optimizer)
            if reason is None:
                for scheduler in route.schedulers:
                    scheduler.step()
            return norm
        finally:
            stats.optimizer_s += time.perf_counter() - started

    def _route(self, optimizer: Optimizer) -> OptimizerRoute:
        """`optimizer`'s route (its parameters, model, name and schedulers), made once."""
        schedulers = [s for s in self.named_schedulers().values() if s.optimizer is optimizer and not _needs_metric(s)]
        return OptimizerRoute(name=self._optimizer_name(optimizer), model=self.model_for(optimizer), schedulers=schedulers,
                              params=[p for g in optimizer.param_groups for p in g["params"]])

    def skip_step(self, reason: str = "skipped") -> None:
        """Skip the coming optimizer step, on every rank (call it in ``training_step`` or
        `pre_optimizer_step`, before ``self.step(optimizer)``). Needs ``vetoes_steps = True``
        on the trainer class or on a callback."""
        self._check_armed("skip_step")
        self.step_path.veto(reason)

    def skip_step_if(self, flag: torch.Tensor, reason: str = "skipped") -> None:
        """`skip_step` decided on the device: skip when `flag` (a one-element bool/number
        tensor) is true — nonzero, NaN included, as ``bool(flag)``. Several calls are OR-ed;
        the flag is read to the host once, at the step."""
        self._check_armed("skip_step_if")
        self.step_path.veto_if(flag, reason)

    def request_skip_batch(self, reason: str = "batch skipped") -> None:
        """Skip the current batch on every rank (what `SkipBatch` raised from
        `pre_train_step` does)."""
        self.step_path.request_batch_skip(reason)

    def request_backward_loss(self, enabled: bool = True) -> None:
        """Record the losses passed to `backward` (``step_stats.backward_loss``) from now
        on: a device op per backward, only for those who ask (False: stop)."""
        self.step_path.backward_loss_wanted = enabled

    def request_grad_norm(self, enabled: bool = True) -> None:
        """Compute the pre-clip gradient norm on every step from now on
        (``step_stats.grad_norm``), once per step for every reader (False: stop)."""
        self.step_path.grad_norm_wanted = enabled

    def count_batch(self, batch: Any) -> tuple[int, int | None]:
        """``(samples, tokens)`` in a (micro-)batch, for ``step_stats`` and throughput.
        Default: see `dream_trainer.trainer.telemetry.count_batch`. Override for other
        layouts (e.g. padded sequences: count the non-padding tokens)."""
        return count_batch(batch)

    @contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Skip gradient communication for the backward passes inside (accumulation
        micro-steps). Applies to FSDP2/``replicate`` modules; a no-op otherwise."""
        modules = [m for m in self.named_models().values() if hasattr(m, "set_requires_gradient_sync")]
        for module in modules:
            module.set_requires_gradient_sync(False)
            if hasattr(module, "set_is_last_backward"):
                module.set_is_last_backward(False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True)
                if hasattr(module, "set_is_last_backward"):
                    module.set_is_last_backward(True)

    @property
    def step_skipped(self) -> bool:
        """Whether the optimizer step that just ended was skipped (a veto or a skipped
        batch): ``global_step`` did not advance."""
        return self.step_path.skipped

    # ------------------------------------------------------------------ the loop's side
    def _batch_arrived(self, batch: Any, step: int) -> None:
        """Telemetry of a new micro-batch of optimizer step `step` (before it moves to the
        device): the data wait since the previous batch was done, its samples/tokens; the
        step's `on_step_begin` when the batch opens it."""
        if self.step_path.arrive(time.perf_counter(), *self.count_batch(batch)):
            self.callbacks.on_step_begin(step)

    def _train_batch(self, batch: Any, batch_idx: int, accumulating: bool) -> tuple[bool, dict[str, Any], torch.Tensor | None]:
        """`pre_train_step` (which may replace the batch), the agreed batch skip and
        ``training_step``: ``(skipped, result, its scalar loss or None)``. A step whose
        failure the callbacks recover (`on_train_step_error`) is retried from
        `pre_train_step`, on the original batch and with the RNG it first drew from."""
        if not self.callbacks.recovers_errors:
            return self._attempt(batch, batch_idx, accumulating, None)
        rng = rng_state()
        for attempt in range(_MAX_RETRIES + 1):
            if attempt:
                set_rng_state(rng)
            try:
                return self._attempt(batch, batch_idx, accumulating, attempt)
            except _Retry:
                continue
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def _attempt(self, batch: Any, batch_idx: int, accumulating: bool, attempt: int | None) -> tuple[bool, dict[str, Any], torch.Tensor | None]:
        """One attempt at the batch (`attempt` None: not recoverable), its compute time and
        its loss in the step's telemetry."""
        cb, stats = self.callbacks, self.step_path.stats
        given = cb.pre_train_step(batch, batch_idx)
        if cb.skips_batches and self._skip_batch(ends_step=not accumulating):
            return True, {}, None
        started = time.perf_counter()
        try:
            if attempt is None:
                result = self._run_step(self.training_step, given, batch_idx, "train_context", accumulating)  # type: ignore[attr-defined]
            else:
                result = self._recoverable_step(given, batch_idx, accumulating, attempt)
        finally:
            stats.compute_s += time.perf_counter() - started
        return False, result, stats.add_loss(result.get("loss"))

    def _recoverable_step(self, batch: Any, batch_idx: int, accumulating: bool, attempt: int) -> dict[str, Any]:
        """``training_step`` in its contexts; with ``recovers_errors``, a failure before the
        step's agreement (in `backward`) is agreed on and offered to the callbacks."""
        self.step_path.agreed = False
        error: Exception | None = None
        try:
            result = self._run_step(self.training_step, batch, batch_idx, "train_context", accumulating)  # type: ignore[attr-defined]
        except Exception as exc:
            if not self.callbacks.recovers_errors or (self.step_path.agreed and not isinstance(exc, _PeerStepFailed)):
                raise  # not armed, or it failed after agreeing (its peers went on)
            error = None if isinstance(exc, _PeerStepFailed) else exc
            if error is not None:
                self.step_path.agreed = True
                self._any_rank(True)  # the peers' agreement in backward
        else:
            if not self.callbacks.recovers_errors or self.step_path.agreed or not self._any_rank(False):
                return result
        self.step_path.agreed = True
        retry = self.callbacks.on_train_step_error(error, batch, batch_idx)  # type: ignore[arg-type]
        if self._any_rank(not retry) or attempt == _MAX_RETRIES:
            if error is not None:
                raise error
            raise RuntimeError(f"training_step failed on another rank (batch {batch_idx} of epoch "
                               f"{self.current_epoch}) and was not recovered there")
        where = f"this rank ({type(error).__name__}: {error})" if error is not None else "another rank"
        logger.warning("training_step of batch %d failed on %s: retrying it on every rank (retry %d of %d)",
                       batch_idx, where, attempt + 1, _MAX_RETRIES)
        raise _Retry()

    def _check_recovery(self) -> None:
        """A callback that ``recovers_errors`` needs every rank's collectives of a step to
        start in its backward (one process, DDP/replicate): under FSDP2, tensor or context
        parallel the forward communicates, and a rank that failed in it could not be
        matched by the others (they would wait in its collectives)."""
        plan, cb = self.world.plan, self.callbacks
        if cb.recovers_errors and (plan.dp_shard > 1 or plan.tp > 1 or plan.cp > 1):
            names = [n for n in cb.names() if cb[n].recovers_errors]
            raise ValueError(
                f"callback(s) {names} recover failed training steps (recovers_errors = True), which needs a layout "
                f"whose collectives start in backward (one process, DDP/replicate); this one (dp_shard={plan.dp_shard}, "
                f"tp={plan.tp}, cp={plan.cp}) communicates in the forward: remove the callback or use "
                "DeviceParameters(dp_replicate=...)"
            )

    def _skip_batch(self, ends_step: bool) -> bool:
        """After `pre_train_step`: whether every rank skips this batch. A skipped batch that
        ends an accumulation group drops the group's gradients (no optimizer step)."""
        reason = self._agreed_batch_skip()
        if reason is None:
            return False
        self.step_path.skipped_batches += 1
        logger.info("batch %d of epoch %d skipped: %s", self.local_batches - 1, self.current_epoch, reason)
        if ends_step:
            self.step_path.stats.skipped = reason
            for optimizer in self.named_optimizers().values():
                self._drop_gradients(self.model_for(optimizer), optimizer)
        return True

    def _end_step(self) -> bool:
        """The end of an optimizer step (the last micro-batch of a group): advance
        ``global_step`` unless the step was skipped, record its time. Whether it was skipped."""
        path = self.step_path
        if path.veto_pending:
            path.clear_vetoes()
            raise RuntimeError(
                "skip_step() was called but no trainer.step(optimizer) followed in this step: call it in "
                "training_step or pre_optimizer_step, before self.step(optimizer)"
            )
        skipped = path.end(self.global_step + 1, time.perf_counter())
        if skipped:
            logger.info("optimizer step %d skipped: %s", self.global_step + 1, path.stats.skipped)
        else:
            self.global_step += 1
            if not path.timeout_relaxed:  # the first step of this fit(), also after a resume
                path.timeout_relaxed = True
                self.world.relax_timeout()
        return skipped

    # ------------------------------------------------------------------ plumbing
    def _check_armed(self, what: str) -> None:
        if not (self.vetoes_steps or self.callbacks.vetoes_steps):
            raise RuntimeError(
                f"trainer.{what}() needs vetoes_steps = True on the trainer class or on the callback that "
                "calls it: the ranks then agree on every optimizer step"
            )

    def _agreed_skip(self, vetoes: list[str]) -> str | None:
        """The skip decision of every rank for this optimizer step (None: step), with the
        callbacks that vetoed it in `pre_optimizer_step` (`vetoes`)."""
        cb = self.callbacks
        if vetoes:
            undeclared = [v for v in vetoes if not cb[v].vetoes_steps]
            if undeclared:
                raise RuntimeError(
                    f"callback(s) {undeclared} returned False from pre_optimizer_step (a veto) but do not declare "
                    "vetoes_steps = True (the ranks agree on vetoed steps only then)"
                )
            self.skip_step(f"vetoed by {', '.join(vetoes)}")
        if not (self.vetoes_steps or cb.vetoes_steps):
            self.step_path.clear_vetoes()
            return None
        return self._agree(self.step_path.take_veto())  # a device decision is read there, once

    def _agreed_batch_skip(self) -> str | None:
        return self._agree(self.step_path.take_batch_skip())

    def _any_rank(self, value: bool) -> bool:
        """Whether `value` is True on any rank: one MAX all-reduce of an int on the CPU."""
        world = self.world
        if world.world_size == 1:
            return value
        flag = torch.tensor([int(value)], dtype=torch.int32)
        world.all_reduce(flag, "max")
        return bool(flag.item())  # a CPU tensor: no device sync

    def _agree(self, reason: str | None) -> str | None:
        """One MAX all-reduce of "does any rank skip" on the CPU; the reasons are gathered
        only when one does."""
        world = self.world
        if not self._any_rank(reason is not None):
            return None
        if world.world_size == 1:
            return reason
        reasons = [r for r in world.all_gather_object(reason) if r is not None]
        return reasons[0] if reasons else "skipped on another rank"

    def _drop_gradients(self, model: nn.Module | None, optimizer: Optimizer) -> None:
        cb = self.callbacks
        cb.pre_optimizer_zero_grad(model, optimizer)  # type: ignore[arg-type]
        optimizer.zero_grad(set_to_none=True)
        cb.post_optimizer_zero_grad(model, optimizer)  # type: ignore[arg-type]

    def _metric_schedulers(self) -> dict[str, Any]:
        return {name: s for name, s in self.named_schedulers().items() if _needs_metric(s)}

    def _check_metric_schedulers(self) -> None:
        """Schedulers stepped with a metric (``ReduceLROnPlateau``) need
        `TrainingParameters.scheduler_monitor`: checked at setup, not at the first step."""
        schedulers = self._metric_schedulers()
        if schedulers and getattr(self.config.training_parameters, "scheduler_monitor", None) is None:
            raise ValueError(
                f"scheduler(s) {sorted(schedulers)} ({type(next(iter(schedulers.values()))).__name__}) step on a "
                "metric: set TrainingParameters(scheduler_monitor=...) to a logged metric, e.g. 'val/loss'"
            )

    def _step_metric_schedulers(self) -> None:
        """Step metric schedulers with the monitored metric (after each validation run, or
        at each epoch's end without validation data). Every rank reads the same value:
        logged metrics are reduced over ranks."""
        schedulers = self._metric_schedulers()
        if not schedulers:
            return
        monitor = self.config.training_parameters.scheduler_monitor
        if monitor not in self.logged_metrics:
            raise KeyError(
                f"TrainingParameters.scheduler_monitor={monitor!r} has not been logged by step {self.global_step}; "
                f"logged metrics: {sorted(self.logged_metrics)}"
            )
        others = [s for s in self.named_schedulers().values() if hasattr(s, "base_lrs")]
        for scheduler in schedulers.values():
            before = [group["lr"] for group in scheduler.optimizer.param_groups]
            scheduler.step(self.logged_metrics[monitor])
            _carry_reduction(scheduler.optimizer, before, others)

    def _optimizer_name(self, optimizer: Optimizer) -> str:
        for name, opt in self.named_optimizers().items():
            if opt is optimizer:
                return name
        return f"optimizer_{id(optimizer):x}"


def _carry_reduction(optimizer: Any, before: list[float], schedulers: list[Any]) -> None:
    """A plateau scheduler just scaled some learning rates of `optimizer`: scale the
    ``base_lrs`` (and ``initial_lr``) of the step schedulers on it alike, so that their next
    step (which sets ``lr = base_lr * factor``) keeps the reduction instead of undoing it."""
    for i, (group, old) in enumerate(zip(optimizer.param_groups, before)):
        if old and group["lr"] != old:
            scale = group["lr"] / old
            if "initial_lr" in group:
                group["initial_lr"] *= scale
            for scheduler in schedulers:
                if scheduler.optimizer is optimizer:
                    scheduler.base_lrs[i] *= scale


def _needs_metric(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
