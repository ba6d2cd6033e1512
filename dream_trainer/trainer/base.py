"""`BaseTrainer`: the `fit()` lifecycle and the training/validation loops, in one file.

Subclasses write `configure()` (set models, optimizers, schedulers and
``self.train_dataloader`` / ``self.val_dataloader``), `training_step` and, optionally,
`validation_step`. Everything else is a callback.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import torch

from dream_trainer.protocol.base import StopTraining
from dream_trainer.protocol.collection import CallbackCollection
from dream_trainer.configs import TrainerConfig
from dream_trainer.exits import exit_code_for, record_exit_code, record_preemption
from dream_trainer.run_identity import RunIdentity, default_run_name
from dream_trainer.trainer.metric_log import MetricLog
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.control import ControlPlane, TrainingInterrupted
from dream_trainer.trainer.epochs import set_epoch, train_mode
from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.trainer.fused import prefer_fused
from dream_trainer.trainer.state import TrainerState
from dream_trainer.trainer.stepping import Stepper
from dream_trainer.trainer.telemetry import RunningMean
from dream_trainer.utils import detach_result, seed_everything
from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)


def _must_override(fn: Any) -> Any:
    """Mark a user hook that a subclass must implement (see `required_methods`)."""
    fn._must_override = True
    return fn


class BaseTrainer(AbstractTrainer):
    """The training loop. See the lifecycle in the docs (``docs/lifecycle.md``).

    Attributes:
        status: ``"created"``, ``"running"``, then ``"completed"``, ``"stopped"``
            (`StopTraining`), ``"preempted"`` (a signal, handled at a step boundary) or
            ``"failed"``.
    """

    def __init__(self, config: TrainerConfig):
        super().__init__()
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"config must be a TrainerConfig, got {type(config).__name__}")
        self.config = config
        self.data_position = DataPosition()  # agreed epoch lengths, where a resume continues the data
        self.world = DistributedWorld(config.device_parameters)  # a bad mesh plan fails here
        self._check_plan(self.world)
        cbs = config.callbacks
        self.callbacks = cbs if isinstance(cbs, CallbackCollection) else CallbackCollection(cbs)
        self.validating = self.sanity_checking = self.resumed = self.is_accumulating_gradients = False
        self.status = "created"
        self.stop_reason: str | None = None
        self.is_last_batch = False  # the current batch ends the epoch (or the run)
        self.seed: int | None = config.seed
        self.run_name: str | None = None
        self.metric_log = MetricLog.for_trainer(self)  # what was logged, what waits to be sent
        self.stepper = Stepper(self)  # the optimizer step, step control and its telemetry
        self._last_val_step: int | None = None
        self.control = ControlPlane()  # signals, stop and disable requests, agreed by every rank
        self.state = TrainerState(self)  # the registry of Statefuls: state_dict / load_state_dict

    def set_world(self, world: DistributedWorld) -> None:
        """Use `world` instead of the one built from the config: call it in `pre_launch`
        (a callback supplying a fault-tolerant world, a DDP fallback). Its plan, device and
        `DeviceParameters` are then the run's."""
        if not isinstance(world, DistributedWorld):
            raise TypeError(f"set_world() takes a DistributedWorld, got {type(world).__name__}")
        if self.world.launched:
            raise RuntimeError("set_world() must be called before the world is launched (in pre_launch)")
        self._check_plan(world)
        self.world = world

    applies_context_parallel: bool = False
    """Whether this trainer shards sequences over ``cp`` (`DreamTrainer`'s step API does)."""

    def _check_plan(self, world: DistributedWorld) -> None:
        if world.plan.cp > 1 and not self.applies_context_parallel:
            raise ValueError(
                f"DeviceParameters.context_parallel={world.plan.cp}: {type(self).__name__} does not apply context "
                "parallelism (DreamTrainer does, in forward_backward/forward_loss); use context_parallel=1")

    # ================================================================== control
    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask every rank to stop: the run ends at the next agreed point (see
        `StopTraining`) with ``status == "stopped"`` on every rank. Safe to call on one
        rank only, from a hook or from ``training_step``; the first reason wins."""
        if self.control.request_stop(reason):
            logger.info("stop requested at step %d: %s", self.global_step, reason)

    def request_disable(self, name: str, why: str) -> None:
        """Disable callback `name` on every rank at the next agreed point (called by the
        callback collection for a non-critical callback that keeps failing)."""
        self.control.request_disable(name, why)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank has asked to stop (not yet acted on)."""
        return self.control.stop_requested

    def _control_point(self, blocking: bool = True) -> None:  # every rank acts on the agreed requests here
        self.control.decide(self.world, self.callbacks, blocking)

    required_methods: ClassVar[tuple[str, ...]] = ("configure", "training_step")
    """Methods a subclass must implement; checked when `fit()` starts, before anything is built."""

    # ================================================================== user hooks
    @_must_override
    def configure(self) -> None:
        """Build models, optimizers, schedulers and dataloaders (set them as attributes)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure()")

    def setup(self) -> None:
        """Resolve epoch lengths and check that every rank agrees. Override to add more
        (call ``super().setup()``)."""
        if self.train_dataloader is None:
            raise ValueError(f"{type(self).__name__} has no training data: set self.train_dataloader in configure()")
        self.data_position.agree_lengths(self.world, self.train_dataloader, self.val_dataloader,
                                         self.training_parameters, self.gradient_accumulation_steps)
        if not self.world.global_agreement((self.seed, self.train_steps_per_epoch)):
            raise RuntimeError("ranks disagree on the seed or the epoch length; see the configuration")
        self.stepper.check_metric_schedulers()
        self.stepper.check_recovery()

    @_must_override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One (micro-)batch: compute the loss, ``self.backward(loss)``, ``self.step(opt)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step()")

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One validation batch; the returned scalars are averaged and logged as ``val/<key>``."""
        raise NotImplementedError(f"{type(self).__name__} has a val_dataloader but does not implement validation_step()")

    # ================================================================== lifecycle
    def fit(self) -> None:
        """Run the whole lifecycle. `on_teardown` runs and the world is torn down on every
        path; a decision to stop (a signal, `StopTraining`) is agreed by every rank."""
        self._check_required_methods()
        self.control.reset()
        # Before the world is up a signal cannot be agreed on (and nothing needs saving): it
        # stops the run at once, also while waiting for the other ranks to arrive.
        restore_signals = self.control.install_signal_handlers(lambda: self.status == "running" and self.world.launched)
        self.status = "running"
        self.goodput.start()  # the ledger's clock: wall time from here
        self.step_path.timeout_relaxed = False
        failure: BaseException | None = None  # a critical callback's error at the end
        try:
            self._start()
            self._run()
        except StopTraining as stop:
            self.control.drain()
            self._stopped(stop)
        except TrainingInterrupted as interrupt:
            self._interrupted(interrupt)
        except BaseException as exc:
            self.status = "failed"
            self.world.explain_failure(exc)  # posts this rank's error, or names the ranks lost
            self.callbacks.on_interrupt(exc)
            raise
        finally:
            restore_signals()
            failure = self._teardown()
        if failure is not None:
            raise failure

    def _start(self) -> None:
        """launch, configure and setup, with the control points where every rank acts on
        the agreed requests."""
        cb = self.callbacks
        cb.initialize(self)
        cb.pre_launch()
        self.world.launch()
        self.data_position.plan_batches(self.training_parameters, self.world.dp_size)  # the accumulation for this world
        self._agree_on_run_identity()
        self._control_point()
        if self.seed is not None:
            seed_everything(self.seed)
        cb.pre_configure()
        self.configure()
        self.index_parameters()
        if self.world.device_parameters.fused_optimizers:
            for optimizer in self.named_optimizers().values():
                prefer_fused(optimizer)
        cb.post_configure()
        self._control_point()
        cb.pre_setup()
        self.setup()
        cb.post_setup()
        self._control_point()

    def _run(self) -> None:
        """pre_fit, a sanity validation, the epochs and post_fit."""
        cb, training = self.callbacks, self.training_parameters
        try:
            cb.pre_fit()
            if self.val_dataloader is not None and training.num_sanity_val_steps and not self.resumed:
                self._validate(sanity=True)
            self._control_point()  # requests from pre_fit and the sanity check
            while not self._done():
                cb.pre_epoch()
                cb.pre_train_epoch()
                cb.post_train_epoch(self._train_epoch())
                if training.validate_at_epoch_end and self._last_val_step != self.global_step:
                    self._validate()
                if self.val_dataloader is None:
                    self.stepper.step_metric_schedulers()
                cb.post_epoch()
                self.current_epoch += 1
                self.local_batches = 0
                self.data_position.epoch_complete = False
                self._control_point()
            self._control_point()  # the last steps' requests: every rank ends alike
            self.status = "completed"
        except StopTraining as stop:
            self._stopped(stop)
        self.control.drain()
        cb.post_fit()
        try:
            self._control_point()  # a stop asked for in post_fit: "stopped" everywhere
        except StopTraining as stop:
            self._stopped(stop)

    def _interrupted(self, interrupt: TrainingInterrupted) -> None:
        """A signal: handled at a step boundary it is a preemption (the checkpoint callback
        saves in `on_interrupt`); elsewhere the run failed."""
        if not interrupt.at_step_boundary:
            self.status = "failed"
            self.callbacks.on_interrupt(interrupt)
            raise interrupt
        self.status, self.stop_reason = "preempted", interrupt.reason
        logger.warning("preempted at step %d (%s)", self.global_step, interrupt.reason)
        failures = self.callbacks.on_interrupt(interrupt)
        if failures:  # e.g. the preemption save failed: never report a resumable run
            self.status = "failed"
            raise failures[0] from interrupt
        record_preemption(interrupt.agreed_signal, self.step_path.timeout_relaxed)  # relaxed: a step of this fit() done

    def _teardown(self) -> BaseException | None:
        """On every path: pending collectives, `on_teardown`, the world, `post_teardown`,
        the exit code. Returns a critical callback's teardown failure (the run then failed)."""
        # No collective may outlive the run: a pending one keeps its tensors in gloo's
        # threads and can abort the process at exit. A failed run drops it unwaited (a
        # peer may be gone).
        if self.status == "failed":
            self.control.drop()
        else:
            self.control.drain()
        failure = None
        self.goodput.finish(getattr(self, "run_dir", None), report=self.world.is_rank_zero)
        failures = self.callbacks.on_teardown(self.status)
        if failures and self.status != "failed":
            self.status, failure = "failed", failures[0]
        # A failed rank aborts its process group, so its peers fail at once even if this
        # process lingers (a user `except` block that keeps running).
        self.world.teardown(abort=self.status == "failed")
        late = self.callbacks.post_teardown(self.status)  # after the world: nothing left to hang on
        if late and self.status != "failed":
            self.status, failure = "failed", late[0]
        record_exit_code(self.exit_code)  # entrypoint exits with it, whatever the script does
        return failure

    @property
    def exit_code(self) -> int:
        """The process exit status this run asks for: `EXIT_PREEMPTED` (75) when
        preempted, `EXIT_FAILED` (1) when failed, else 0. ``raise SystemExit(trainer.exit_code)``
        in a script."""
        return exit_code_for(self.status)

    def _stopped(self, stop: StopTraining) -> None:
        self.status, self.stop_reason = "stopped", stop.reason
        logger.info("training stopped at step %d: %s", self.global_step, stop.reason)

    def _check_required_methods(self) -> None:
        missing = [name for name in self.required_methods if getattr(getattr(type(self), name), "_must_override", False)]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} must implement {', '.join(f'{m}()' for m in missing)} "
                f"(required: {', '.join(self.required_methods)})"
            )

    def _done(self) -> bool:
        training = self.training_parameters
        return (training.n_epochs is not None and self.current_epoch >= training.n_epochs) or (
            training.max_steps is not None and self.global_step >= training.max_steps
        )

    # ================================================================== training
    def _train_epoch(self) -> dict[str, Any]:
        """The training epoch (its rest, on a mid-epoch resume): ``{"batches", "loss"}``."""
        train_mode(self.named_models().values())
        set_epoch(self.train_dataloader, self.current_epoch)
        losses = RunningMean() if self.callbacks.listens("post_train_epoch") else None  # its reader's; on the device
        start = batch_idx = self.local_batches - 1  # > -1 when resuming mid-epoch
        path, position = self.step_path, self.data_position
        path.step_end = self.goodput.fetching(path)  # the ledger follows the path's clock; the first wait makes the iterator
        try:
            self.stepper.accumulation = accumulation = self.gradient_accumulation_steps  # fixed for the fit (its world's)
            batches = position.epoch_batches(self.train_dataloader, self, self.world, accumulation)
            position.iterating = True
            for batch, is_last in batches:
                # Read after the fetch: state restored between two steps (a torchft heal,
                # at the fetch) moves the counters, and the loop goes on from there.
                batch_idx = self.local_batches
                loss, done = self._train_on(batch, batch_idx, is_last)
                if loss is not None and losses is not None:
                    losses.add(loss)
                if done:
                    break
                path.fetch_start = time.perf_counter()  # the next fetch (the ledger's "data" from here)
            else:
                position.epoch_complete = True  # not cut short by max_steps: a resume starts the next epoch
        finally:  # also when a step raises (StopTraining, a failure): no stale per-step flag
            self.metric_log.gate = None
            self.is_accumulating_gradients = self.is_last_batch = False
            path.open = position.iterating = False
            self.goodput.idle()
        self.metric_log.flush()  # values logged since the last log step: not dropped
        if batch_idx == start == -1:
            raise ValueError(
                f"the training dataloader yielded no batches in epoch {self.current_epoch} "
                f"(dp_rank {self.world.dp_rank}): an empty or exhausted iterable?"
            )
        position.last_epoch_batches = batch_idx + 1
        result: dict[str, Any] = {"batches": batch_idx + 1}
        if losses is not None and losses.count:
            result["loss"] = losses.mean()
        return result

    def _train_on(self, batch: Any, batch_idx: int, is_last: bool) -> tuple[torch.Tensor | None, bool]:
        """One (micro-)batch: its step and hooks, its log, and at the end of an optimizer
        step validation and the control point. ``(its scalar loss or None, max_steps reached)``.
        The common step runs inline (``fit`` -> `_run` -> `_train_epoch` -> here ->
        ``training_step`` -> `step`); a step the callbacks may retry goes through `Stepper.recoverable`."""
        accumulating, log_kind = self._open_batch(batch, batch_idx, is_last)
        batch = self.world.transfer(batch) if self.world.transfer.moves else batch
        cb, path = self.callbacks, self.stepper.path
        stats = path.stats
        if cb.recovers_errors:
            skipped, result, loss = self.stepper.recoverable(batch, batch_idx, accumulating, self._contexts_step)
        else:
            batch = cb.pre_train_step(batch, batch_idx) if "pre_train_step" in cb.overridden else batch
            skipped = cb.skips_batches and self.stepper.skip_batch(ends_step=not accumulating)
            result, loss = {}, None
            if not skipped:
                collectives, timed = self.world.collectives, path.times_wanted  # `request_step_times`
                started = collectives.compute_starts() if collectives.tracking else time.perf_counter() if timed else 0.0
                if accumulating or cb.has_train_context or self.world.train_context() is not None:
                    result = self._run_step(self.training_step, batch, batch_idx, "train_context", accumulating)
                else:  # no context to enter
                    result = detach_result(self.training_step(batch, batch_idx), "training_step")
                if timed:
                    stats.compute_s += time.perf_counter() - started
                loss = stats.add_loss(result.get("loss"))
        return loss, self._close_batch(batch_idx, accumulating, log_kind, skipped, result)

    def _open_batch(self, batch: Any, batch_idx: int, is_last: bool) -> tuple[bool, int]:
        """The counters and flags of a new micro-batch and its arrival in the step's
        telemetry: ``(accumulating, log step kind)``."""
        stepper, config = self.stepper, self.config
        step, max_steps = self.global_step + 1, config.training_parameters.max_steps
        self.local_batches = batch_idx + 1
        accumulating = not is_last and (batch_idx + 1) % stepper.accumulation != 0  # the epoch's (`_train_epoch`)
        self.is_accumulating_gradients = accumulating
        ends_run = not accumulating and max_steps is not None and step >= max_steps
        self.is_last_batch = is_last or ends_run
        log_kind = 2 if ends_run else (  # the run's last step logs
            self.metric_log.step_kind(step, config.logging_parameters.log_every_n_steps, self.callbacks.log_intervals))
        self.metric_log.gate = not accumulating and log_kind > 0
        stepper.loss_weight = getattr(batch, "loss_weight", None)  # before the transfer: this batch's own
        stepper.batch_arrived(batch, step, time.perf_counter())
        return accumulating, log_kind

    def _close_batch(self, batch_idx: int, accumulating: bool, log_kind: int, skipped: bool,
                     result: dict[str, Any]) -> bool:
        """After the micro-batch's step: the step's end, `post_train_step`, `on_step_end`,
        the log, and at the end of an optimizer step validation and the control point.
        Whether ``max_steps`` is reached."""
        training, cb, log_ = self.config.training_parameters, self.callbacks, self.metric_log
        step, max_steps = self.global_step + 1, training.max_steps
        kind = 0 if accumulating else log_kind
        means = log_.step_means(step, result, accumulating) if log_kind == 2 and not skipped else None
        step_skipped = not accumulating and self.stepper.end_step()  # the goodput ledger reads its clock there
        log = kind > 0 and not step_skipped
        own: dict[str, Any] = {}
        if kind == 2 and log and means is not None:  # the trainer's own metrics
            logging_ = self.config.logging_parameters
            own = log_.own_step_metrics(means, self.step_path.stats, self.world, self.current_epoch, logging_.log_lr,
                                        logging_.log_grad_norm or training.gradient_clip_val is not None)
        if not skipped and "post_train_step" in cb.overridden:
            cb.post_train_step(result, batch_idx)
        if not accumulating and "on_step_end" in cb.overridden:
            cb.on_step_end(step)
        if log:
            log_.send_step(own)
        log_.gate = None
        if accumulating:
            return False
        validated = training.val_every_n_steps is not None and self.validation_due
        if validated:
            self._validate()
            self.step_path.step_end = time.perf_counter()  # a step's time leaves validation out
        self.control.decide(self.world, cb, blocking=validated)  # the control point: agreed requests
        return max_steps is not None and self.global_step >= max_steps

    @property
    def validation_due(self) -> bool:
        """Whether the loop validates at the end of the current optimizer step (never after
        a skipped step: ``global_step`` did not advance)."""
        every = self.training_parameters.val_every_n_steps
        return (
            every is not None and self.val_dataloader is not None and self.global_step % every == 0
            and not self.step_skipped
        )

    def _contexts_step(self, batch: Any, batch_idx: int, accumulating: bool) -> dict[str, Any]:
        """``training_step`` in its contexts (what the stepper retries)."""
        return self._run_step(self.training_step, batch, batch_idx, "train_context", accumulating)

    def _run_step(self, fn: Any, batch: Any, batch_idx: int, context_hook: str, no_sync: bool) -> dict[str, Any]:
        """Call a step function inside the world's and the callbacks' contexts."""
        training = context_hook == "train_context"
        world_ctx = self.world.train_context() if training else None
        has_callback_ctx = self.callbacks.has_train_context if training else self.callbacks.has_validation_context
        if world_ctx is None and not no_sync and not has_callback_ctx:
            return detach_result(fn(batch, batch_idx), fn.__name__)  # the common case: no ExitStack
        with ExitStack() as stack:
            if no_sync:
                stack.enter_context(self.no_gradient_sync())
            if world_ctx is not None:
                stack.enter_context(world_ctx)
            for ctx in self.callbacks.contexts(context_hook):
                stack.enter_context(ctx)
            return detach_result(fn(batch, batch_idx), fn.__name__)

    # ================================================================== validation
    @torch.no_grad()
    def _validate(self, sanity: bool = False) -> dict[str, Any]:
        loader = self.val_dataloader
        if loader is None:
            return {}
        cb = self.callbacks
        limit = self.training_parameters.num_sanity_val_steps if sanity else self.val_steps_per_epoch
        modes = {name: m.training for name, m in self.named_models().items()}
        self.goodput.push("validation")
        for model in self.named_models().values():
            model.eval()
        self.validating, self.sanity_checking = True, sanity
        self.metric_log.start_validation()
        try:
            cb.pre_validation_epoch()
            for batch_idx, batch in enumerate(itertools.islice(loader, limit)):
                batch = self.world.transfer(batch)
                cb.pre_validation_step(batch, batch_idx)
                result = self._run_step(self.validation_step, batch, batch_idx, "validation_context", False)
                cb.post_validation_step(result, batch_idx)
                self.metric_log.accumulate({f"val/{k}" if "/" not in k else k: v for k, v in result.items()})
            means = self.metric_log.validation_means(self.world)
            self.validating = False  # from here, log_dict logs at once (not into the means)
            if not sanity:
                self._last_val_step = self.global_step
                self.metric_log.dispatch(means)
            cb.post_validation_epoch(means)
            if not sanity:
                self.stepper.step_metric_schedulers()
            return means
        finally:
            self.goodput.pop("validation")
            self.validating = self.sanity_checking = False
            for name, model in self.named_models().items():
                model.train(modes[name])

    # ================================================================== plumbing
    def _agree_on_run_identity(self) -> None:
        """Every rank takes rank 0's run name, directory and seed. Run name: the config's,
        else the launcher's (`RunIdentity`), else a timestamp. Run directory and seed: the
        launcher's when it set them, else from the config; the run directory ends in the
        world's `run_subdirectory` when it has one."""
        env, cfg = RunIdentity.from_env(), self.config
        run_name = cfg.run_name or env.run_name or default_run_name()
        run_dir = env.run_dir or os.path.join(cfg.root_dir, env.experiment or cfg.experiment, run_name)
        seed = env.seed if env.seed is not None else cfg.seed
        self.run_name, run_dir, self.seed = self.world.broadcast_object((run_name, run_dir, seed))
        # A world that shares the run with others (a replica group) keeps its files apart.
        self.run_dir = Path(run_dir) / (self.world.run_subdirectory or "")
        if self.world.is_rank_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)
