"""`Stepper`: the optimizer step and step control, the component the trainer holds as
``trainer.stepper`` — clipping, the optimizer hooks, the update, ``zero_grad`` and the
schedulers; vetoed steps and skipped batches agreed by every rank; failed steps the
callbacks recover, retried on every rank; and the per-step telemetry they record
(`StepStats`, in its `StepPath`). The trainer's step API (``backward``, ``step``,
``skip_step``..., on `AbstractTrainer`) calls into it; ``trainer.step`` itself reads as the
step does: route, clip, ``pre_optimizer_step``, the agreed skip, the update, ``zero_grad``,
the schedulers.

Step control is armed only when something may use it (``vetoes_steps``/``skips_batches`` on
a callback or on the trainer class): then each optimizer step (each batch) costs one MAX
all-reduce of one int on the CPU, a host wait but no device sync. A device-side decision
(`skip_step_if`) is read to the host once, on that step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from dream_trainer.trainer.step_path import OptimizerRoute, StepPath
from dream_trainer.utils import rng_state, set_rng_state
from dream_trainer.world.stragglers import StragglerMeter

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from dream_trainer.configs import TrainerConfig
    from dream_trainer.protocol.collection import CallbackCollection
    from dream_trainer.trainer.goodput import GoodputLedger
    from dream_trainer.trainer.metric_log import MetricLog
    from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)

_MAX_RETRIES = 4
"""How often one (micro-)batch is retried after failures the callbacks recover."""

_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
"""Whether autocast is on for any device (torch's own fast check; without it, assume it may be)."""

StepResult = tuple[bool, dict[str, Any], torch.Tensor | None]
"""What a (micro-)batch's step gives the loop: ``(skipped, result, its scalar loss or None)``."""


class _PeerStepFailed(Exception):
    """Raised in `backward` on a rank whose step went through when another rank's failed."""


class _Retry(Exception):
    """Every rank retries the (micro-)batch."""


class StepOwner(Protocol):
    """What the stepper reads of the trainer that holds it (`BaseTrainer` is one): plain
    attributes and the named accessors, nothing of the loop."""

    world: DistributedWorld
    callbacks: CallbackCollection
    config: TrainerConfig
    metric_log: MetricLog
    goodput: GoodputLedger
    global_step: int
    current_epoch: int
    local_batches: int
    is_accumulating_gradients: bool

    @property
    def vetoes_steps(self) -> bool: ...

    def named_models(self) -> dict[str, nn.Module]: ...

    def named_optimizers(self) -> dict[str, Optimizer]: ...

    def named_schedulers(self) -> dict[str, LRScheduler]: ...

    def model_for(self, optimizer: Optimizer) -> nn.Module | None: ...

    def count_batch(self, batch: Any) -> tuple[int, int | None]: ...


class Stepper:
    """The optimizer step and step control of one trainer (see the module docstring). Its
    state (telemetry, vetoes, routes, counters) is `path` (`StepPath`, also
    ``trainer.step_path``)."""

    def __init__(self, trainer: StepOwner) -> None:
        self.trainer = trainer
        self.path = StepPath()
        self.loss_weight: float | None = None  # the current micro-batch's (its batch's ``loss_weight``)
        self.accumulation = 1  # micro-batches per optimizer step (the loop sets it as each epoch opens)
        self.stragglers = StragglerMeter()  # this rank's work per step, compared across ranks at log steps

    # ------------------------------------------------------------------ the step API's work
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by 1/`accumulation` when accumulating and by the
        micro-batch's `loss_weight` when it carries one other than 1, after the agreement
        of `before_backward`. Inside a collective region only where there are peers."""
        path, trainer = self.path, self.trainer
        if trainer.callbacks.recovers_errors:
            self.before_backward()
        if path.backward_loss_wanted:  # a monitor decides on this step's loss before its update
            path.stats.add_backward(loss)
        weight, accumulation = self.loss_weight, self.accumulation
        if weight is not None and weight != 1:  # an uneven share of the global batch: one multiply
            loss = loss * (weight / accumulation)
        elif accumulation > 1:
            loss = loss / accumulation
        collectives = trainer.world.collectives
        autocast = _any_autocast() and torch.is_autocast_enabled(loss.device.type)  # the first check: one C call
        if not collectives.tracking and not autocast:  # one rank: nothing to wait for
            loss.backward(**kwargs)
            return
        name = "backward" if trainer.is_accumulating_gradients else "backward: gradient reduction"
        with collectives.region(name) if collectives.tracking else contextlib.nullcontext():
            if autocast:  # the forward's autocast stays out of the backward (torch's advice):
                with torch.autocast(loss.device.type, enabled=False):  # else eager backward ops re-dispatch through it
                    loss.backward(**kwargs)
            else:  # DDP/FSDP reduce gradients in the region (a hang is named there)
                loss.backward(**kwargs)

    def before_backward(self) -> None:
        """With a callback that ``recovers_errors``: the ranks agree that none failed
        before its backward."""
        path = self.path
        if self.trainer.callbacks.recovers_errors and not path.agreed:
            path.agreed = True
            if self.any_rank(False):  # another rank's step failed: this one's work is dropped
                raise _PeerStepFailed()

    def after_loss(self, loss: torch.Tensor) -> None:
        """The loss of a backward made elsewhere (a pipeline schedule), for the monitors
        that asked for it."""
        if self.path.backward_loss_wanted:
            self.path.stats.add_backward(loss)

    def make_route(self, optimizer: Optimizer) -> OptimizerRoute:
        """`optimizer`'s route (its parameters, model, name and schedulers), made on its
        first step (`StepPath.route` keeps it)."""
        trainer = self.trainer
        schedulers = [s for s in trainer.named_schedulers().values() if s.optimizer is optimizer and not _needs_metric(s)]
        return OptimizerRoute(name=self._optimizer_name(optimizer), model=trainer.model_for(optimizer),
                              schedulers=schedulers, params=[p for g in optimizer.param_groups for p in g["params"]])

    def clip(self, route: OptimizerRoute) -> torch.Tensor | None:
        """Before an update: the gradient sync seam (a no-op but across replica groups),
        then clipping to ``gradient_clip_val`` or, where something reads it, the norm; in
        the step's telemetry. The pre-clip norm (a device tensor) or None."""
        collectives = self.trainer.world.collectives
        if collectives.tracking:  # a region only where there are peers (a hang is named there)
            collectives.phase = "optimizer step"
            with collectives.region("gradient sync and norm (the optimizer step)"):
                return self._sync_and_clip(route)
        return self._sync_and_clip(route)  # one rank: no region (and no context manager to enter)

    def _sync_and_clip(self, route: OptimizerRoute) -> torch.Tensor | None:
        trainer, path = self.trainer, self.path
        world = trainer.world
        if world.step_seams:
            world.sync_gradients(route.params)
        clip = trainer.config.training_parameters.gradient_clip_val
        if clip is not None:
            norm = path.stats.grad_norm[route.name] = world.clip_grad_norm_(route.params, clip)
            path.stats.clip_limit[route.name] = clip  # `stats.clipped` compares when read
            return norm
        if path.grad_norm_wanted or (trainer.metric_log.gate and trainer.config.logging_parameters.log_grad_norm):
            norm = path.stats.grad_norm[route.name] = world.total_gradient_norm(route.params)
            return norm
        return None

    def skip_step(self, reason: str) -> None:
        """``trainer.skip_step``: see `AbstractTrainer.skip_step`."""
        self._check_armed("skip_step")
        self.path.veto(reason)

    def skip_step_if(self, flag: torch.Tensor, reason: str) -> None:
        """``trainer.skip_step_if``: see `AbstractTrainer.skip_step_if`."""
        self._check_armed("skip_step_if")
        self.path.veto_if(flag, reason)

    # ------------------------------------------------------------------ the loop's side
    def batch_arrived(self, batch: Any, step: int, now: float) -> None:
        """Telemetry of a new micro-batch of optimizer step `step`, arrived at `now` (before
        it moves to the device): the data wait since its fetch began, its samples/tokens when
        something asked for them; the step's `on_step_begin` when the batch opens it."""
        trainer, path = self.trainer, self.path
        collectives = trainer.world.collectives
        if collectives.tracking:
            collectives.batch_arrived(step, now)
        opened = path.arrive(now)
        if path.counts_wanted:  # `request_batch_counts`: nobody asked, no batch is looked at
            path.count(*trainer.count_batch(batch))
        if opened and "on_step_begin" in trainer.callbacks.overridden:
            trainer.callbacks.on_step_begin(step)

    def compute_starts(self) -> float:
        """``training_step`` is called (phase ``training_step``; on FSDP, TP, CP or PP the
        forward's collectives are entered); returns ``time.perf_counter()``."""
        collectives = self.trainer.world.collectives
        return collectives.compute_starts() if collectives.tracking else time.perf_counter()

    def recoverable(self, batch: Any, batch_idx: int, accumulating: bool,
                    run: Callable[[Any, int, bool], dict[str, Any]]) -> StepResult:
        """The (micro-)batch's step when a callback ``recovers_errors``: `pre_train_step`,
        the agreed batch skip and ``run`` (the training step in its contexts). A failure
        the callbacks recover (`on_train_step_error`) is retried from `pre_train_step` on
        every rank, on the original batch and with the RNG it first drew from."""
        rng = rng_state()
        for attempt in range(_MAX_RETRIES + 1):
            if attempt:
                set_rng_state(rng)
            try:
                return self._attempt(batch, batch_idx, accumulating, attempt, run)
            except _Retry:
                continue
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def _attempt(self, batch: Any, batch_idx: int, accumulating: bool, attempt: int,
                 run: Callable[[Any, int, bool], dict[str, Any]]) -> StepResult:
        """One attempt at the batch, its compute time and its loss in the step's telemetry."""
        cb, stats = self.trainer.callbacks, self.path.stats
        given = cb.pre_train_step(batch, batch_idx)
        if cb.skips_batches and self.skip_batch(ends_step=not accumulating):
            return True, {}, None
        started = self.compute_starts()
        try:
            result = self._recoverable_step(given, batch_idx, accumulating, attempt, run)
        finally:
            if self.path.times_wanted:
                stats.compute_s += time.perf_counter() - started
        return False, result, stats.add_loss(result.get("loss"))

    def _recoverable_step(self, batch: Any, batch_idx: int, accumulating: bool, attempt: int,
                          run: Callable[[Any, int, bool], dict[str, Any]]) -> dict[str, Any]:
        """``run``; a failure before the step's agreement (in `backward`) is agreed on and
        offered to the callbacks."""
        path, cb = self.path, self.trainer.callbacks
        path.agreed = False
        error: Exception | None = None
        try:
            result = run(batch, batch_idx, accumulating)
        except Exception as exc:
            if path.agreed and not isinstance(exc, _PeerStepFailed):
                raise  # it failed after agreeing (its peers went on)
            error = None if isinstance(exc, _PeerStepFailed) else exc
            if error is not None:
                path.agreed = True
                self.any_rank(True)  # the peers' agreement in backward
        else:
            if path.agreed or not self.any_rank(False):
                return result
        path.agreed = True
        retry = cb.on_train_step_error(error, batch, batch_idx)
        if self.any_rank(not retry) or attempt == _MAX_RETRIES:
            if error is not None:
                raise error
            raise RuntimeError(f"training_step failed on another rank (batch {batch_idx} of epoch "
                               f"{self.trainer.current_epoch}) and was not recovered there")
        where = f"this rank ({type(error).__name__}: {error})" if error is not None else "another rank"
        logger.warning("training_step of batch %d failed on %s: retrying it on every rank (retry %d of %d)",
                       batch_idx, where, attempt + 1, _MAX_RETRIES)
        raise _Retry()

    def check_recovery(self) -> None:
        """A callback that ``recovers_errors`` needs every rank's collectives of a step to
        start in its backward (one process, DDP/replicate): under FSDP2, tensor or context
        parallel the forward communicates, and a rank that failed in it could not be
        matched by the others (they would wait in its collectives)."""
        plan, cb = self.trainer.world.plan, self.trainer.callbacks
        if cb.recovers_errors and (plan.dp_shard > 1 or plan.tp > 1 or plan.cp > 1):
            names = [n for n in cb.names() if cb[n].recovers_errors]
            raise ValueError(
                f"callback(s) {names} recover failed training steps (recovers_errors = True), which needs a layout "
                f"whose collectives start in backward (one process, DDP/replicate); this one (dp_shard={plan.dp_shard}, "
                f"tp={plan.tp}, cp={plan.cp}) communicates in the forward: remove the callback or use "
                "DeviceParameters(dp_replicate=...)"
            )

    def skip_batch(self, ends_step: bool) -> bool:
        """After `pre_train_step`: whether every rank skips this batch. A skipped batch that
        ends an accumulation group drops the group's gradients (no optimizer step)."""
        reason = self.agree(self.path.take_batch_skip())
        if reason is None:
            return False
        trainer = self.trainer
        self.path.skipped_batches += 1
        logger.info("batch %d of epoch %d skipped: %s", trainer.local_batches - 1, trainer.current_epoch, reason)
        if ends_step:
            self.path.stats.skipped = reason
            for optimizer in trainer.named_optimizers().values():
                self.drop_gradients(trainer.model_for(optimizer), optimizer)
        return True

    def end_step(self) -> bool:
        """The end of an optimizer step (the last micro-batch of a group): advance
        ``global_step`` unless the step was skipped, record its time (in the step's telemetry,
        which is also the goodput ledger's clock). Whether it was skipped."""
        path, trainer = self.path, self.trainer
        now, world = time.perf_counter(), trainer.world
        if path.stats.skipped is not None and path.skipped:  # the ledger moves its time before `path.end`
            trainer.goodput.step_skipped(now)
        skipped = path.end(trainer.global_step + 1, now)  # raises for a veto no step took
        collectives = world.collectives
        if collectives.tracking:  # the stragglers compare ranks
            if not path.timeout_relaxed and not skipped:  # the first step of this fit(): warm-up begins
                self.stragglers.start()
            self.stragglers.add(collectives.step_work(now), path.stats.data_wait_s)
        if skipped:
            logger.info("optimizer step %d skipped: %s", trainer.global_step + 1, path.stats.skipped)
        else:
            trainer.global_step += 1
            if not path.timeout_relaxed:  # the first step of this fit(), also after a resume
                path.timeout_relaxed = True
                world.relax_timeout()
        if collectives.tracking:
            collectives.step_ended(trainer.global_step + 1)
        if (collectives.tracking and not skipped
                and trainer.global_step % trainer.config.logging_parameters.log_every_n_steps == 0):
            trainer.metric_log.log(self.stragglers.report(world))  # the trainer's log steps: the same on every rank
        return skipped

    # ------------------------------------------------------------------ agreement
    def _check_armed(self, what: str) -> None:
        if not (self.trainer.vetoes_steps or self.trainer.callbacks.vetoes_steps):
            raise RuntimeError(
                f"trainer.{what}() needs vetoes_steps = True on the trainer class or on the callback that "
                "calls it: the ranks then agree on every optimizer step"
            )

    def agreed_skip(self, vetoes: list[str]) -> str | None:
        """The skip decision of every rank for this optimizer step (None: step), with the
        callbacks that vetoed it in `pre_optimizer_step` (`vetoes`)."""
        cb = self.trainer.callbacks
        if vetoes:
            undeclared = [v for v in vetoes if not cb[v].vetoes_steps]
            if undeclared:
                raise RuntimeError(
                    f"callback(s) {undeclared} returned False from pre_optimizer_step (a veto) but do not declare "
                    "vetoes_steps = True (the ranks agree on vetoed steps only then)"
                )
            self.skip_step(f"vetoed by {', '.join(vetoes)}")
        if not (self.trainer.vetoes_steps or cb.vetoes_steps):
            self.path.clear_vetoes()
            return None
        return self.agree(self.path.take_veto())  # a device decision is read there, once

    def any_rank(self, value: bool) -> bool:
        """Whether `value` is True on any rank: one MAX all-reduce of an int on the CPU."""
        world = self.trainer.world
        if world.world_size == 1:
            return value
        flag = torch.tensor([int(value)], dtype=torch.int32)
        world.all_reduce(flag, "max")
        return bool(flag.item())  # a CPU tensor: no device sync

    def agree(self, reason: str | None) -> str | None:
        """One MAX all-reduce of "does any rank skip" on the CPU; the reasons are gathered
        only when one does."""
        world = self.trainer.world
        if not self.any_rank(reason is not None):
            return None
        if world.world_size == 1:
            return reason
        reasons = [r for r in world.all_gather_object(reason) if r is not None]
        return reasons[0] if reasons else "skipped on another rank"

    def drop_gradients(self, model: nn.Module | None, optimizer: Optimizer) -> None:
        cb = self.trainer.callbacks
        cb.pre_optimizer_zero_grad(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        cb.post_optimizer_zero_grad(model, optimizer)

    # ------------------------------------------------------------------ metric schedulers
    def _metric_schedulers(self) -> dict[str, Any]:
        return {name: s for name, s in self.trainer.named_schedulers().items() if _needs_metric(s)}

    def check_metric_schedulers(self) -> None:
        """Schedulers stepped with a metric (``ReduceLROnPlateau``) need
        `TrainingParameters.scheduler_monitor`: checked at setup, not at the first step."""
        schedulers = self._metric_schedulers()
        if schedulers and getattr(self.trainer.config.training_parameters, "scheduler_monitor", None) is None:
            raise ValueError(
                f"scheduler(s) {sorted(schedulers)} ({type(next(iter(schedulers.values()))).__name__}) step on a "
                "metric: set TrainingParameters(scheduler_monitor=...) to a logged metric, e.g. 'val/loss'"
            )

    def step_metric_schedulers(self) -> None:
        """Step metric schedulers with the monitored metric (after each validation run, or
        at each epoch's end without validation data). Every rank reads the same value:
        logged metrics are reduced over ranks."""
        schedulers = self._metric_schedulers()
        if not schedulers:
            return
        trainer = self.trainer
        monitor, logged = trainer.config.training_parameters.scheduler_monitor, trainer.metric_log.logged
        if monitor not in logged:
            raise KeyError(
                f"TrainingParameters.scheduler_monitor={monitor!r} has not been logged by step {trainer.global_step}; "
                f"logged metrics: {sorted(logged)}"
            )
        others = [s for s in trainer.named_schedulers().values() if hasattr(s, "base_lrs")]
        for scheduler in schedulers.values():
            before = [group["lr"] for group in scheduler.optimizer.param_groups]
            scheduler.step(logged[monitor])
            _carry_reduction(scheduler.optimizer, before, others)

    def _optimizer_name(self, optimizer: Optimizer) -> str:
        for name, opt in self.trainer.named_optimizers().items():
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
