"""`AbstractTrainer`: the trainer's public API over its components — the counters and named
accessors, the step API (``backward``, ``step``, ``skip_step``...: the work is its
`Stepper`'s), the state (`TrainerState`), the data's lengths (`DataPosition`) and the
logging API (`MetricLog`). `BaseTrainer` adds the loop."""

from __future__ import annotations

from abc import ABC
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs import LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.trainer.goodput import GoodputLedger
from dream_trainer.trainer.metric_log import check_metrics
from dream_trainer.trainer.model_facts import ModelFacts, dense_flops_per_token
from dream_trainer.trainer.telemetry import StepStats, count_batch
from dream_trainer.world.world import DistributedWorld

if TYPE_CHECKING:
    from dream_trainer.protocol.collection import CallbackCollection
    from dream_trainer.trainer.metric_log import MetricLog
    from dream_trainer.trainer.state import TrainerState
    from dream_trainer.trainer.data_position import DataPosition
    from dream_trainer.trainer.step_path import StepPath
    from dream_trainer.trainer.stepping import Stepper

T = TypeVar("T")


class AbstractTrainer(ABC):
    """The public API every trainer has, over the components it holds (the loop is
    `BaseTrainer`'s).

    Attributes:
        global_step: optimizer steps taken (accumulation micro-batches do not count).
        current_epoch: the epoch being run (0-based).
        local_batches: batches (micro-batches) consumed in the current epoch.
    """

    config: TrainerConfig
    world: DistributedWorld
    callbacks: CallbackCollection
    stepper: Stepper
    data_position: DataPosition
    metric_log: MetricLog
    state: TrainerState
    is_accumulating_gradients: bool
    validating: bool
    sanity_checking: bool
    run_dir: Path
    train_dataloader: Iterable[Any] | None = None
    val_dataloader: Iterable[Any] | None = None

    def __init__(self) -> None:
        self.global_step = 0
        self.current_epoch = 0
        self.local_batches = 0
        self.model_facts = ModelFacts()  # parameter owners, model FLOPs
        self.goodput = GoodputLedger()  # where the wall time went (checkpointed with the state)

    # ------------------------------------------------------------------ discovery
    def _named(self, kind: type[T]) -> dict[str, T]:
        """Attributes of this trainer that are instances of `kind`, in assignment order."""
        return {name: value for name, value in vars(self).items() if isinstance(value, kind) and not name.startswith("_")}

    def named_models(self) -> dict[str, nn.Module]:
        """Every ``nn.Module`` assigned as an attribute (``self.model = ...``)."""
        return self._named(nn.Module)

    def named_optimizers(self) -> dict[str, Optimizer]:
        """Every optimizer assigned as an attribute."""
        return self._named(Optimizer)

    def named_schedulers(self) -> dict[str, LRScheduler]:
        """Every learning-rate scheduler assigned as an attribute."""
        return {name: value for name, value in vars(self).items() if isinstance(value, LRScheduler) and not name.startswith("_")}

    def replace_model(self, name: str, model: nn.Module) -> None:
        """Put `model` in the place of model `name`: what a conversion that returns a new
        module (float8, quantization, adapters) does in ``post_configure_models``, before
        the model is parallelized, materialized or given to an optimizer. The seam for
        plug-ins: they never set the trainer's attributes themselves."""
        if name not in self.named_models():
            raise KeyError(f"no model named {name!r}; the trainer has: {list(self.named_models())}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"replace_model({name!r}, ...) takes an nn.Module, got {type(model).__name__}")
        setattr(self, name, model)

    def model_for(self, optimizer: Optimizer) -> nn.Module | None:
        """The model whose parameters `optimizer` updates (None if no model owns them),
        whatever the models' sharding state: an FSDP2 module left unsharded by a forward
        pass without backward (validation) registers its unsharded parameters, not the
        sharded ones the optimizer holds, so the owners recorded by `index_parameters`
        are looked up first."""
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        if first is None:
            return None
        models = self.named_models()
        owner = self.model_facts.owner(first)
        if owner in models:
            return models[owner]
        for model in models.values():
            if any(p is first for p in model.parameters()):
                return model
        return None

    def index_parameters(self) -> None:
        """Record which model owns each parameter (`model_for`), with every FSDP2 module
        resharded first, so the parameters recorded are the sharded ones optimizers hold.
        `fit()` calls it after `configure()`; call it again if models change later."""
        models = self.named_models()
        reshard(models.values())
        self.model_facts.index(models)  # the models may have changed: FLOPs estimated again when read

    # ------------------------------------------------------------------ model FLOPs
    @property
    def model_flops_per_token(self) -> float | None:
        """Training FLOPs (forward and backward) of one token through every model, for
        FLOP/s and MFU (`ThroughputMonitorCallback`, `PerformanceReportCallback`). The value set
        (``self.model_flops_per_token = ...``, e.g. in ``configure``), else
        `estimate_model_flops_per_token()`, computed once, at the first read after the models
        are configured (the monitors read it in ``post_setup``). None: unknown (no models,
        or set to None)."""
        return self.model_facts.flops_per_token(bool(self.named_models()), self.estimate_model_flops_per_token)

    @model_flops_per_token.setter
    def model_flops_per_token(self, value: float | None) -> None:
        self.model_facts.set_flops_per_token(value)

    def estimate_model_flops_per_token(self) -> float | None:
        """The default of `model_flops_per_token`: `dense_flops_per_token` of every model
        (6 x the parameters outside embeddings). Override for a better count, e.g. with
        attention (`dream_trainer.trainer.model_facts.transformer_flops_per_token`: causal
        attention counted at half, as the examples' trainers do); return None for unknown."""
        return dense_flops_per_token(self.named_models().values()) or None

    @property
    def model_flops_per_sample(self) -> float | None:
        """Training FLOPs (forward and backward) of one sample, for models whose batches
        have no token count (``count_batch`` gives none: images, tabular data). None unless
        set (``self.model_flops_per_sample = ...``); with tokens counted,
        `model_flops_per_token` is used instead."""
        return self.model_facts.flops_per_sample

    @model_flops_per_sample.setter
    def model_flops_per_sample(self, value: float | None) -> None:
        self.model_facts.set_flops_per_sample(value)

    # ------------------------------------------------------------------ the step API
    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: derived from ``global_batch_size`` for this
        world (once it is up), else ``TrainingParameters.gradient_accumulation_steps``."""
        derived = self.data_position.accumulation_steps
        return self.config.training_parameters.gradient_accumulation_steps if derived is None else derived

    vetoes_steps: ClassVar[bool] = False
    """Set True on a trainer class whose own code (``training_step``) calls `skip_step`."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by 1/`gradient_accumulation_steps` when accumulating.
        A micro-batch that carries a ``loss_weight`` (an uneven share of the global batch:
        `dream_trainer.data.weighted`, which `TokenLoader` yields under fault tolerance when
        the quorum's slots do not divide the global batch) has its loss multiplied by it
        too, so the step's update is the global batch's mean loss's; call this rather than
        ``loss.backward()`` for that. With a callback that ``recovers_errors``, the ranks
        first agree that no rank's ``training_step`` failed before its backward (see
        `on_train_step_error`)."""
        self.stepper.backward(loss, **kwargs)

    def step(self, optimizer: Optimizer, model: nn.Module | None = None) -> torch.Tensor | None:
        """Clip, step and zero `optimizer`, then step its schedulers; a no-op while
        accumulating. A step vetoed on any rank (`skip_step`, `pre_optimizer_step`
        returning False) is skipped on every rank: no update, no scheduler step, gradients
        dropped. Returns the gradient norm when one was computed (a device tensor)."""
        if self.is_accumulating_gradients:
            return None
        stepper, cb, world = self.stepper, self.callbacks, self.world
        path = stepper.path
        stats, timed = path.stats, path.times_wanted  # `request_step_times`
        started = time.perf_counter() if timed else 0.0
        try:
            route = path.routes.get(id(optimizer)) or path.route(optimizer, stepper.make_route)
            norm = stepper.clip(route)  # the gradient sync seam, then clipping or the norm (if any is due)
            hooks = cb.overridden  # the optimizer hooks some callback overrides (none: no dispatch)
            owner = model if model is not None else route.model
            vetoes = cb.pre_optimizer_step(owner, optimizer) if "pre_optimizer_step" in hooks else None
            # What optimizer.step() sees: read after pre_optimizer_step (a warm-up may set
            # it there); schedulers step after.
            stats.lr[route.name] = optimizer.param_groups[0]["lr"]
            reason = stepper.agreed_skip(vetoes or []) if vetoes or self.vetoes_steps or cb.vetoes_steps else None
            if world.step_seams:
                reason = world.agree_on_step(reason)  # a fault-tolerant world: the quorum's commit
            if reason is None:
                optimizer.step()
                path.stepped = True
                if "post_optimizer_step" in hooks:
                    cb.post_optimizer_step(owner, optimizer)
                if "pre_optimizer_zero_grad" in hooks or "post_optimizer_zero_grad" in hooks:
                    stepper.drop_gradients(owner, optimizer)  # zero_grad between its hooks
                else:
                    optimizer.zero_grad(set_to_none=True)
                for scheduler in route.schedulers:
                    scheduler.step()
            else:
                stats.skipped = reason
                stepper.drop_gradients(owner, optimizer)
            return norm
        finally:
            if timed:
                stats.optimizer_s += time.perf_counter() - started

    def skip_step(self, reason: str = "skipped") -> None:
        """Skip the coming optimizer step, on every rank (call it in ``training_step`` or
        `pre_optimizer_step`, before ``self.step(optimizer)``). Needs ``vetoes_steps = True``
        on the trainer class or on a callback."""
        self.stepper.skip_step(reason)

    def skip_step_if(self, flag: torch.Tensor, reason: str = "skipped") -> None:
        """`skip_step` decided on the device: skip when `flag` (a one-element bool/number
        tensor) is true — nonzero, NaN included, as ``bool(flag)``. Several calls are OR-ed;
        the flag is read to the host once, at the step."""
        self.stepper.skip_step_if(flag, reason)

    def request_skip_batch(self, reason: str = "batch skipped") -> None:
        """Skip the current batch on every rank (what `SkipBatch` raised from
        `pre_train_step` does)."""
        self.step_path.request_batch_skip(reason)

    def request_backward_loss(self, enabled: bool = True) -> None:
        """Record the losses passed to `backward` (``step_stats.backward_loss``) from now
        on: a device op per backward, only for those who ask (False: stop)."""
        self.step_path.backward_loss_wanted = enabled

    def request_step_times(self, enabled: bool = True) -> None:
        """Time each step's ``training_step`` and ``trainer.step(optimizer)`` from now on
        (``step_stats.compute_s``/``optimizer_s``; NaN until asked): four clock reads a step,
        only for those who ask (False: stop)."""
        self.step_path.times_wanted = enabled

    def request_grad_norm(self, enabled: bool = True) -> None:
        """Compute the pre-clip gradient norm on every step from now on
        (``step_stats.grad_norm``), once per step for every reader (False: stop)."""
        self.step_path.grad_norm_wanted = enabled

    def request_batch_counts(self, enabled: bool = True) -> None:
        """Count each micro-batch's samples and tokens (``count_batch``) into
        ``step_stats`` from now on (``samples``, ``tokens``, their totals and the world's;
        None until asked): a look at every batch, only for those who ask (False: stop)."""
        self.step_path.counts_wanted = enabled

    count_batch = staticmethod(count_batch)
    """``count_batch(batch) -> (samples, tokens)`` of a (micro-)batch, for ``step_stats`` and
    throughput. Default: `dream_trainer.trainer.telemetry.count_batch` itself (no wrapper:
    the loop calls it for every batch once something asked, `request_batch_counts`). Override it with a method ``count_batch(self,
    batch)`` for other layouts (e.g. padded sequences: count the non-padding tokens)."""

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
    def step_path(self) -> StepPath:
        """The step's state (`StepPath`: telemetry, vetoes and skips, routes, the step
        cycle, skipped-step counters): the stepper's."""
        return self.stepper.path

    @property
    def step_stats(self) -> StepStats:
        """What the step that just ended (or is running) measured: see `StepStats`."""
        return self.stepper.path.stats  # read by monitors every step: one property, not two

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the run started (vetoes, skipped batches)."""
        return self.step_path.skipped_steps

    @property
    def skipped_batches(self) -> int:
        """Batches skipped since the run started (`SkipBatch`, `request_skip_batch`)."""
        return self.step_path.skipped_batches

    @property
    def step_skipped(self) -> bool:
        """Whether the optimizer step that just ended was skipped (a veto or a skipped
        batch): ``global_step`` did not advance."""
        return self.stepper.path.skipped

    # ------------------------------------------------------------------ state
    # ------------------------------------------------------------------ state, configuration
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly: the composition of the
        ``Stateful`` parts of `state` (`TrainerState`), for checkpoints and torchft heals."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict` returned (`TrainerState.load_state_dict`); `strict`:
        every model and optimizer key must match."""
        self.state.load_state_dict(state, strict)

    @property
    def training_parameters(self) -> TrainingParameters:
        """``config.training_parameters``."""
        return self.config.training_parameters

    @property
    def logging_parameters(self) -> LoggingParameters:
        """``config.logging_parameters``."""
        return self.config.logging_parameters

    # ------------------------------------------------------------------ the data (`DataPosition`)
    @property
    def train_steps_per_epoch(self) -> int | None:
        """The training epoch length every rank agreed on in `setup` (None: until the loader
        is exhausted)."""
        return self.data_position.train_steps_per_epoch

    @property
    def val_steps_per_epoch(self) -> int | None:
        """The validation epoch length every rank agreed on in `setup`."""
        return self.data_position.val_steps_per_epoch

    @property
    def last_epoch_batches(self) -> int | None:
        """Batches the last finished training epoch had."""
        return self.data_position.last_epoch_batches

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps the whole fit is planned to take, counted from step 0 (also
        after a resume): ``max_steps``, or ``n_epochs`` x the optimizer steps per epoch, the
        smaller when both are set. Optimizer steps per epoch = ceil(batches per epoch /
        ``gradient_accumulation_steps``): an epoch's last, partial accumulation group steps
        too. Batches per epoch: the epoch length the ranks agreed on in `setup`
        (``train_steps_per_epoch``, or the smallest loader length over ranks; the smaller of
        the two when both are known), else — a loader without a length —
        ``TrainingParameters.train_steps_per_epoch_hint``, an estimate.

        None when it is unknown: the run is bounded by epochs of a loader without a length
        and no hint was given (or `setup` has not run: only ``max_steps`` is known before).
        A plan: steps that are skipped (vetoes, skipped batches) do not shorten it. The same
        on every rank (it is computed from the configuration and the agreed epoch length),
        known from ``post_setup`` on, and cheap (no communication): read it anywhere."""
        return self.data_position.total_steps(self.config.training_parameters, self.gradient_accumulation_steps)

    # ------------------------------------------------------------------ logging (`MetricLog`)
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

    @property
    def device(self) -> torch.device:
        return self.world.device


def reshard(models: Iterable[nn.Module]) -> None:
    """Reshard every FSDP2 module of `models` (no communication: the sharded parameters
    are registered again, the unsharded ones freed). A forward pass without backward (under
    ``no_grad``) leaves FSDP2's root unsharded; name-keyed state (DCP's helpers) needs the
    sharded parameters. Call it on every rank at the same point, outside forward/backward."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
