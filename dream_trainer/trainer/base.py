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
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from dream_trainer.callbacks.base import StopTraining
from dream_trainer.callbacks.collection import CallbackCollection
from dream_trainer.configs import TrainerConfig
from dream_trainer.launch import RunIdentity
from dream_trainer.trainer.metrics import MetricsMixin
from dream_trainer.trainer.preemption import EXIT_PREEMPTED, PreemptionMixin, TrainingInterrupted
from dream_trainer.trainer.state import StateMixin, is_stateful
from dream_trainer.utils import detach_result, seed_everything, to_device
from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)


class BaseTrainer(MetricsMixin, StateMixin, PreemptionMixin):
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
        self.training_parameters = config.training_parameters
        self.logging_parameters = config.logging_parameters
        self.world = DistributedWorld(config.device_parameters)  # a bad mesh plan fails here
        cbs = config.callbacks
        self.callbacks = cbs if isinstance(cbs, CallbackCollection) else CallbackCollection(cbs)
        self.is_accumulating_gradients = False
        self.validating = False
        self.sanity_checking = False
        self.resumed = False
        self.status = "created"
        self.stop_reason: str | None = None
        self.is_last_batch = False  # the current batch ends the epoch (or the run)
        self.seed: int | None = config.seed
        self.run_name: str | None = None
        self.train_steps_per_epoch: int | None = None
        self.val_steps_per_epoch: int | None = None
        self.last_epoch_batches: int | None = None
        self._log_gate: bool | None = None  # None outside a step: log_dict always logs
        self._val_sums: dict[str, list[Any]] = {}
        self._pending_logs: dict[str, Any] = {}
        self._grad_norms: dict[str, torch.Tensor] = {}
        self._optimizer_params: dict[int, list[nn.Parameter]] = {}
        self._optimizer_models: dict[int, nn.Module | None] = {}
        self._optimizer_schedulers: dict[int, list[Any]] = {}
        self._optimizer_names: dict[int, str] = {}
        self._last_val_step: int | None = None
        self._epoch_complete = False
        self._data_snapshot: Any = None
        self._loader_restored = False
        self._resume_rng: dict[str, Any] | None = None
        self._signal: int | None = None
        self._signal_work: Any = None

    # ================================================================== user hooks
    def configure(self) -> None:
        """Build models, optimizers, schedulers and dataloaders (set them as attributes)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure()")

    def setup(self) -> None:
        """Resolve epoch lengths and check that every rank agrees. Override to add more
        (call ``super().setup()``)."""
        if self.train_dataloader is None:
            raise ValueError(
                f"{type(self).__name__} has no training data: set self.train_dataloader in configure()"
            )
        tp = self.training_parameters
        self.train_steps_per_epoch = self._agreed_length(self.train_dataloader, tp.train_steps_per_epoch, "train")
        if self.val_dataloader is not None:
            self.val_steps_per_epoch = self._agreed_length(self.val_dataloader, tp.val_steps_per_epoch, "val")
        if not self.world.global_agreement((self.seed, self.train_steps_per_epoch)):
            raise RuntimeError("ranks disagree on the seed or the epoch length; see the configuration")

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One (micro-)batch: compute the loss, ``self.backward(loss)``, ``self.step(opt)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step()")

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One validation batch; the returned scalars are averaged and logged as ``val/<key>``."""
        raise NotImplementedError(
            f"{type(self).__name__} has a val_dataloader but does not implement validation_step()"
        )

    # ================================================================== lifecycle
    def fit(self) -> None:
        """Run the whole lifecycle. The world is torn down on every path."""
        cb = self.callbacks
        restore_signals = self._install_signal_handlers()
        self.status = "running"
        try:
            cb.initialize(self)
            cb.pre_launch()
            self.world.launch()
            self._agree_on_run_identity()
            if self.seed is not None:
                seed_everything(self.seed)
            cb.pre_configure()
            self.configure()
            cb.post_configure()
            cb.pre_setup()
            self.setup()
            cb.post_setup()
            try:
                cb.pre_fit()
                self._fit_loop()
                self.status = "completed"
            except StopTraining as stop:
                self._stopped(stop)
            self._drain_signal_check()
            cb.post_fit()
        except StopTraining as stop:
            self._stopped(stop)
        except TrainingInterrupted as interrupt:
            if not interrupt.at_step_boundary:
                self.status = "failed"
                cb.on_interrupt()
                raise
            self.status, self.stop_reason = "preempted", interrupt.reason
            logger.warning("preempted at step %d (%s)", self.global_step, interrupt.reason)
            cb.on_interrupt()  # the checkpoint callback saves here, at a step boundary
        except BaseException:
            self.status = "failed"
            cb.on_interrupt()
            raise
        finally:
            restore_signals()
            self.world.teardown()

    @property
    def exit_code(self) -> int:
        """The process exit status this run asks for: `EXIT_PREEMPTED` (75) when
        preempted, else 0. ``raise SystemExit(trainer.exit_code)`` in a script."""
        return EXIT_PREEMPTED if self.status == "preempted" else 0

    def _stopped(self, stop: StopTraining) -> None:
        self.status, self.stop_reason = "stopped", stop.reason
        logger.info("training stopped at step %d: %s", self.global_step, stop.reason)

    def _fit_loop(self) -> None:
        tp = self.training_parameters
        if self.val_dataloader is not None and tp.num_sanity_val_steps and not self.resumed:
            self._validate(sanity=True)
        while not self._done():
            cb = self.callbacks
            cb.pre_epoch()
            cb.pre_train_epoch()
            result = self._train_epoch()
            cb.post_train_epoch(result)
            if tp.validate_at_epoch_end and self._last_val_step != self.global_step:
                self._validate()
            cb.post_epoch()
            self.current_epoch += 1
            self.local_batches = 0
            self._epoch_complete = False

    def _done(self) -> bool:
        tp = self.training_parameters
        return (tp.n_epochs is not None and self.current_epoch >= tp.n_epochs) or (
            tp.max_steps is not None and self.global_step >= tp.max_steps
        )

    # ================================================================== training
    def _train_epoch(self) -> dict[str, Any]:
        tp, cb = self.training_parameters, self.callbacks
        accumulation, log_every = tp.gradient_accumulation_steps, self.logging_parameters.log_every_n_steps
        move = self.world.device.type != "cpu"
        for model in self.named_models().values():
            model.train()
        _set_epoch(self.train_dataloader, self.current_epoch)
        losses: list[torch.Tensor] = []
        batch_idx = self.local_batches - 1  # > -1 when resuming mid-epoch
        for batch_idx, (batch, is_last) in enumerate(self._epoch_batches(), self.local_batches):
            self.local_batches = batch_idx + 1
            self.is_accumulating_gradients = accumulating = not is_last and (batch_idx + 1) % accumulation != 0
            self.is_last_batch = is_last or (
                not accumulating and tp.max_steps is not None and self.global_step + 1 >= tp.max_steps
            )
            self._log_gate = not accumulating and (self.global_step + 1) % log_every == 0
            if move:
                batch = to_device(batch, self.world.device)
            cb.pre_train_step(batch, batch_idx)
            result = self._run_step(self.training_step, batch, batch_idx, "train_context", accumulating)
            if not accumulating:
                self.global_step += 1
                if self.global_step == 1:
                    self.world.relax_timeout()
            cb.post_train_step(result, batch_idx)
            loss = result.get("loss")
            if isinstance(loss, torch.Tensor) and loss.ndim == 0:
                losses.append(loss)
            if self._log_gate:
                self._log_train_step(result)
            self._log_gate = None
            if not accumulating:
                if self.validation_due:
                    self._validate()
                if self._signal_agreed():
                    raise TrainingInterrupted(f"received signal {self._signal_name()}", at_step_boundary=True)
                if tp.max_steps is not None and self.global_step >= tp.max_steps:
                    break
        else:
            self._epoch_complete = True  # not cut short by max_steps: a resume starts the next epoch
        self.is_accumulating_gradients = self.is_last_batch = False
        self.last_epoch_batches = batch_idx + 1
        result: dict[str, Any] = {"batches": batch_idx + 1}
        if losses:
            result["loss"] = torch.stack(losses).float().mean()
        return result

    @property
    def validation_due(self) -> bool:
        """Whether the loop validates at the end of the current optimizer step."""
        every = self.training_parameters.val_every_n_steps
        return every is not None and self.val_dataloader is not None and self.global_step % every == 0

    def _epoch_batches(self) -> Iterator[tuple[Any, bool]]:
        """``(batch, is_last)`` for the rest of the epoch. On a mid-epoch resume a stateful
        loader continues by itself; any other loader is fast-forwarded past the batches
        already consumed (exact when its order depends only on the epoch, e.g. a
        `DistributedSampler`). Then the saved RNG state is restored."""
        loader, start = self.train_dataloader, self.local_batches
        limit = self.train_steps_per_epoch
        iterator = iter(loader)  # type: ignore[arg-type]
        if start and not self._loader_restored:
            skipped = sum(1 for _ in itertools.islice(iterator, start))
            logger.info("resuming epoch %d at batch %d: skipped %d batches", self.current_epoch, start, skipped)
        self._loader_restored, self._data_snapshot = False, None
        self._restore_resume_rng()
        remaining = None if limit is None else limit - start
        try:
            known = len(loader) - start  # type: ignore[arg-type]
        except TypeError:
            known = None
        if known is not None and (remaining is None or known >= remaining):
            count = known if remaining is None else remaining
            return ((batch, i + 1 == count) for i, batch in enumerate(itertools.islice(iterator, count)))
        snapshot = self._snapshot_data if is_stateful(loader) else None
        return _with_last(iterator, remaining, snapshot)

    def _snapshot_data(self) -> None:
        # Looking one batch ahead moves a stateful loader past the current batch; keep its
        # position from before the lookahead for `state_dict`.
        self._data_snapshot = self.train_dataloader.state_dict()  # type: ignore[union-attr]

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

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by 1/gradient_accumulation_steps when accumulating."""
        accumulation = self.training_parameters.gradient_accumulation_steps
        if accumulation > 1:
            loss = loss / accumulation
        loss.backward(**kwargs)

    def step(self, optimizer: Optimizer, model: nn.Module | None = None) -> torch.Tensor | None:
        """Clip, step and zero `optimizer`, then step its schedulers; a no-op while
        accumulating. Returns the gradient norm when one was computed (a device tensor)."""
        if self.is_accumulating_gradients:
            return None
        key = id(optimizer)
        if key not in self._optimizer_params:
            self._optimizer_params[key] = [p for g in optimizer.param_groups for p in g["params"]]
            self._optimizer_models[key] = self.model_for(optimizer)
            self._optimizer_names[key] = self._optimizer_name(optimizer)
            self._optimizer_schedulers[key] = [
                s for s in self.named_schedulers().values() if s.optimizer is optimizer
            ]
        model = model if model is not None else self._optimizer_models[key]
        norm = None
        clip = self.training_parameters.gradient_clip_val
        if clip is not None:
            norm = self.world.clip_grad_norm_(self._optimizer_params[key], clip)
        elif self._log_gate and self.logging_parameters.log_grad_norm:
            norm = self.world.total_gradient_norm(self._optimizer_params[key])
        if norm is not None:
            self._grad_norms[self._optimizer_names[key]] = norm
        cb = self.callbacks
        cb.pre_optimizer_step(model, optimizer)  # type: ignore[arg-type]
        optimizer.step()
        cb.post_optimizer_step(model, optimizer)  # type: ignore[arg-type]
        cb.pre_optimizer_zero_grad(model, optimizer)  # type: ignore[arg-type]
        optimizer.zero_grad(set_to_none=True)
        cb.post_optimizer_zero_grad(model, optimizer)  # type: ignore[arg-type]
        for scheduler in self._optimizer_schedulers[key]:
            scheduler.step()
        return norm

    def _optimizer_name(self, optimizer: Optimizer) -> str:
        for name, opt in self.named_optimizers().items():
            if opt is optimizer:
                return name
        return f"optimizer_{id(optimizer):x}"

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

    # ================================================================== validation
    @torch.no_grad()
    def _validate(self, sanity: bool = False) -> dict[str, Any]:
        loader = self.val_dataloader
        if loader is None:
            return {}
        cb = self.callbacks
        limit = self.training_parameters.num_sanity_val_steps if sanity else self.val_steps_per_epoch
        modes = {name: m.training for name, m in self.named_models().items()}
        for model in self.named_models().values():
            model.eval()
        self.validating, self.sanity_checking, self._val_sums = True, sanity, {}
        move = self.world.device.type != "cpu"
        try:
            cb.pre_validation_epoch()
            for batch_idx, batch in enumerate(itertools.islice(loader, limit)):
                if move:
                    batch = to_device(batch, self.world.device)
                cb.pre_validation_step(batch, batch_idx)
                result = self._run_step(self.validation_step, batch, batch_idx, "validation_context", False)
                cb.post_validation_step(result, batch_idx)
                self._accumulate({f"val/{k}" if "/" not in k else k: v for k, v in result.items()})
            means = self._reduced_means()
            if not sanity:
                self._last_val_step = self.global_step
                self._dispatch_log(means)
            cb.post_validation_epoch(means)
            return means
        finally:
            self.validating = self.sanity_checking = False
            for name, model in self.named_models().items():
                model.train(modes[name])

    # ================================================================== plumbing
    def _agreed_length(self, loader: Iterable[Any], configured: int | None, what: str) -> int | None:
        """The epoch length every rank uses: the configured one, else the smallest
        ``len(loader)`` over ranks, else None (iterate until the loader is exhausted)."""
        try:
            length: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        lengths = self.world.all_gather_object(length)
        if configured is not None:
            known = [n for n in lengths if n is not None]
            if known and min(known) < configured:
                logger.warning("%s_steps_per_epoch=%d but a %s loader has only %d batches", what, configured, what, min(known))
            return configured
        if any(n is None for n in lengths):
            return None
        if len(set(lengths)) > 1:
            logger.warning("%s loaders differ in length across ranks %s; every rank uses %d", what, lengths, min(lengths))
        return min(lengths)  # type: ignore[type-var]

    def _agree_on_run_identity(self) -> None:
        """Every rank takes rank 0's run name, directory and seed. Run name: the config's,
        else the launcher's (`RunIdentity`), else a timestamp. Run directory and seed: the
        launcher's when it set them, else from the config."""
        env, cfg = RunIdentity.from_env(), self.config
        run_name = cfg.run_name or env.run_name or time.strftime("%Y%m%d-%H%M%S")
        run_dir = env.run_dir or os.path.join(cfg.root_dir, env.experiment or cfg.experiment, run_name)
        seed = env.seed if env.seed is not None else cfg.seed
        self.run_name, run_dir, self.seed = self.world.broadcast_object((run_name, run_dir, seed))
        self.run_dir = Path(run_dir)
        if self.world.is_rank_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)


def _with_last(loader: Iterable[Any], limit: int | None, before_fetch: Any = None) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, is_last)`` for at most `limit` batches. Looks one batch ahead, so
    the final micro-batch of an epoch steps the optimizer even when the loader is shorter
    than expected or has no length. `before_fetch` (if given) runs before each lookahead."""
    iterator = iter(itertools.islice(loader, limit))
    try:
        current = next(iterator)
    except StopIteration:
        return
    while True:
        if before_fetch is not None:
            before_fetch()
        try:
            upcoming = next(iterator)
        except StopIteration:
            break
        yield current, False
        current = upcoming
    yield current, True


def _set_epoch(loader: Any, epoch: int) -> None:
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None), loader):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return
