"""`DreamTrainer`: `BaseTrainer` plus the standard model-build sequence, and the step API
(`DreamTrainer.forward_backward`, `DreamTrainer.forward_loss`) that runs the same
``training_step`` with or without pipeline or context parallelism.

``configure()`` runs, in this order::

    configure_models()            under the meta device: no memory, no init cost
    callbacks.post_configure_models(models)   still on meta: callbacks may replace modules
    cut into this rank's pipeline stages      if pipeline_parallel > 1 (`PipelineRuntime`)
    apply_tensor_parallel(tp)     if tensor_parallel > 1
    apply_activation_checkpointing()   if checkpoint_activations
    apply_compile()               if compile_model
    apply_fully_shard(cfg)        if dp_shard > 1 or context_parallel > 1   (FSDP2 / HSDP)
      or apply_replicate(dp)      if dp_replicate > 1  (DDP)
    materialize on the world's device, seed, init_weights()
    callbacks.post_init_weights(models)       initialize what a callback added
    start the pipeline (pp > 1), the context-parallel sharding (context_parallel > 1)
    configure_optimizers() -> configure_schedulers() -> configure_dataloaders()

What was compiled and what was sharded is recorded: ``trainer.compiled_modules`` and
``trainer.fsdp_modules(model)``.

Each ``apply_*`` hook is called only when its option is enabled; if the configuration
needs one the subclass does not implement, configure fails before building anything.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.context_parallel import ContextParallel
from dream_trainer.pipeline import Pipeline, PipelineLayout, PipelineRuntime
from dream_trainer.pipeline.runtime import CostInputs, LossFn
from dream_trainer.trainer.base import BaseTrainer, _must_override
from dream_trainer.trainer.build_record import BuildRecord, CompiledModule
from dream_trainer.trainer.weights import full_size_parameters, shared_parameters, tie
from dream_trainer.utils import seed_everything

logger = logging.getLogger(__name__)


class DreamTrainer(BaseTrainer):
    """A trainer that builds models on the meta device and parallelizes them from config.

    Attributes:
        build: what was compiled, sharded and converted to float8 (`BuildRecord`), read
            through `compiled_modules`, `fsdp_modules` and `float8` too.
        pipeline_runtime: pipeline parallelism (`PipelineRuntime`): the plan, this rank's
            stages and the running pipeline (read as `pipeline`); idle when
            ``pipeline_parallel == 1``.
        context_parallel: the sequence sharding and ring attention of a
            ``context_parallel > 1`` run (`ContextParallel`, which `forward_backward` and
            `forward_loss` apply), None otherwise.
    """

    required_methods = ("configure_models", "configure_optimizers", "configure_dataloaders", "training_step")
    applies_context_parallel = True

    pipeline_layout: ClassVar[PipelineLayout | None] = None
    """Where the model's layers are, what runs before and after them: needed for
    ``pipeline_parallel > 1`` (`PipelineLayout`)."""

    context_parallel_seq_dim: ClassVar[int] = 1
    """The sequence dimension of a step's inputs and targets (``(batch, sequence)`` token
    ids: 1), what context parallelism shards."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.build = BuildRecord()
        self.pipeline_runtime = PipelineRuntime()
        self.context_parallel: ContextParallel | None = None

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's stages and schedule, when the run is pipeline parallel (None
        otherwise, and before `configure`)."""
        return self.pipeline_runtime.pipeline

    @property
    def compiled_modules(self) -> dict[str, CompiledModule]:
        """The compiled regions, ``{"<model>.<submodule path>": CompiledModule}`` in module
        order (empty when nothing was compiled): what `apply_compile` compiled, through
        `compile_module` or ``module.compile()``."""
        return self.build.compiled

    @property
    def float8(self) -> dict[str, str]:
        """``{model name: recipe}`` of the models converted to float8 training (by
        `Fp8QuantizationCallback`, before parallelization): an ``apply_tensor_parallel`` can choose
        torchao's float8 TP styles from it."""
        return self.build.float8

    def compile_module(self, module: nn.Module, **options: Any) -> None:
        """``module.compile(**options)`` (in place), recorded in `compiled_modules` with its
        options. Use it in `apply_compile`.

        A module whose ``forward`` is torch's own (``nn.Sequential``, ``nn.Linear``, ...) is
        compiled through a call of this package's: dynamo skips a top frame in torch's own
        code, so ``module.compile()`` alone would compile nothing for it, silently."""
        self.build.compile_options(module, options)
        module.compile(**options)
        if getattr(type(module).forward, "__module__", "").startswith("torch."):
            call = module._call_impl

            def call_impl(*args: Any, **kwargs: Any) -> Any:
                return call(*args, **kwargs)

            module._compiled_call_impl = torch.compile(call_impl, **options)

    def fsdp_modules(self, model: str | nn.Module) -> dict[str, nn.Module]:
        """The modules ``fully_shard`` was applied to in `model` (a name or the model),
        ``{submodule path: module}`` in module order, the root (``""``) first. Empty when
        the model is not sharded."""
        if isinstance(model, nn.Module):
            names = [name for name, m in self.named_models().items() if m is model]
            if not names:
                raise KeyError(f"{type(model).__name__} is not a model of this trainer: {list(self.named_models())}")
            model = names[0]
        if model not in self.named_models():
            raise KeyError(f"no model named {model!r}; the trainer has: {list(self.named_models())}")
        return dict(self.build.sharded.get(model, {}))

    # ================================================================== the step API
    def forward_backward(self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """``loss_fn(model(inputs), target)``, then `backward` of it; the loss (detached).
        Pipeline parallel: the batch runs through every stage in micro-batches, by the
        schedule (forward and backward interleaved), and its mean loss reaches every rank.
        Context parallel: each rank runs its part of the sequences, and the loss is the
        sequences' mean. Use it in ``training_step``: the same code runs with and without
        either."""
        if self.pipeline is None:
            with self._sequence_shards(inputs, target) as (inputs, target):
                loss = loss_fn(model(*inputs) if isinstance(inputs, tuple) else model(inputs), target)
                self.backward(loss)
            return self._context_mean(loss.detach())
        if self.stepper.loss_weight is not None:  # every rank's batch carries one when any does: agreed
            raise NotImplementedError(
                f"a micro-batch with loss_weight={self.stepper.loss_weight} (an uneven share of the global batch) "
                "under pipeline parallelism: the schedule does not weight its loss; use a global batch that the "
                "quorum's micro-batch slots divide")
        self.stepper.before_backward()
        loss = self.pipeline_runtime.train_step(inputs, target, loss_fn, self.gradient_accumulation_steps)
        self.stepper.after_loss(loss)
        return loss

    def forward_loss(self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """``loss_fn(model(inputs), target)`` with no backward (validation); pipeline
        parallel, the batch's mean loss through every stage, on every rank."""
        if self.pipeline is None:
            with self._sequence_shards(inputs, target) as (inputs, target):
                loss = loss_fn(model(*inputs) if isinstance(inputs, tuple) else model(inputs), target)
            return self._context_mean(loss)
        return self.pipeline.eval_step(inputs, target, loss_fn)

    def _sequence_shards(self, inputs: Any, target: Any) -> AbstractContextManager[tuple[Any, Any]]:
        """Context parallel: this rank's part of the sequences, and ring attention while
        the step runs (`ContextParallel.sharded_step`); otherwise `inputs` and `target`."""
        if self.context_parallel is None:
            return contextlib.nullcontext((inputs, target))
        return self.context_parallel.sharded_step(inputs, target, self.world.device)

    def _context_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """Context parallel: each rank's loss is its tokens' mean (equal shares); the
        sequences' mean on every rank of the group (a collective, no host sync)."""
        if self.context_parallel is None:
            return loss
        return self.world.all_reduce(loss.clone(), "mean", group=self.context_parallel.group)

    # ================================================================== user hooks
    @_must_override
    def configure_models(self) -> None:
        """Create the models as attributes (``self.model = GPT(cfg)``). Runs under
        ``torch.device("meta")``: allocate nothing, initialize nothing here."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_models()")

    def init_weights(self) -> None:
        """Initialize every parameter and buffer after materialization (runs under
        ``torch.no_grad()`` after seeding). Default: each model's ``init_weights()`` if it
        has one, else ``reset_parameters()`` of every submodule that has it."""
        for model in self.named_models().values():
            init = getattr(model, "init_weights", None)
            if callable(init):
                init()
                continue
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    @_must_override
    def configure_optimizers(self) -> None:
        """Create the optimizers as attributes (models are materialized by now)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def configure_schedulers(self) -> None:
        """Create learning-rate schedulers as attributes (optional)."""

    @_must_override
    def configure_dataloaders(self) -> tuple[Iterable[Any], Iterable[Any] | None] | None:
        """Return ``(train_dataloader, val_dataloader_or_None)``, or set the attributes.
        Shard the data with ``self.world.dp_rank`` / ``self.world.dp_size``."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_dataloaders()")

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Parallelize the models over `tp_mesh` (``parallelize_module``)."""

    def apply_activation_checkpointing(self) -> None:
        """Wrap blocks with activation checkpointing."""

    def apply_compile(self) -> None:
        """Compile the models (per block: ``block.compile()``)."""

    def apply_fully_shard(self, fsdp_config: dict[str, Any]) -> None:
        """``fully_shard(block, **fsdp_config)`` per block, then on each model root."""

    def apply_replicate(self, dp_mesh: DeviceMesh) -> None:
        """Data parallelism by replication, on each model root: gradients all-reduced in
        buckets during backward. Plain parameters use DDP's reducer (composable
        ``replicate``: the module keeps its class and names); a model whose parameters are
        DTensors (tensor parallel), or a pipeline stage, uses FSDP2-style ``replicate`` over
        `dp_mesh` (the pipeline schedule defers its gradient reduction to a batch's last
        micro-batch; DDP's reducer would reduce each micro-batch's as its forwards
        interleave, and train other weights)."""
        from torch.distributed.tensor import DTensor

        pipelined = self.world.plan.pp > 1
        for model in self.named_models().values():
            if pipelined or any(isinstance(p, DTensor) for p in model.parameters()):
                from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_dtensors

                replicate_dtensors(model, mesh=dp_mesh)
            else:
                from torch.distributed._composable.replicate import replicate

                replicate(model, process_group=dp_mesh.get_group())

    # ================================================================== the build sequence
    def _require(self, hook: str, because: str) -> None:
        if getattr(type(self), hook) is getattr(DreamTrainer, hook):
            raise NotImplementedError(
                f"{because}, but {type(self).__name__} does not implement {hook}(); implement it "
                f"or change the DeviceParameters"
            )

    def configure(self) -> None:
        world = self.world  # the config's, or one a callback set in pre_launch
        params, plan = world.device_parameters, world.plan
        self._check_configuration()  # before anything is built

        with torch.device("meta"):
            self.configure_models()
        models = self.named_models()
        if not models:
            raise ValueError(f"{type(self).__name__}.configure_models() set no nn.Module attribute")
        with torch.device("meta"):  # what a callback builds here is on meta too
            self.callbacks.post_configure_models(models)
        if plan.pp > 1:
            self._plan_pipeline()  # this rank's stages of the model

        if plan.tp > 1:
            self.apply_tensor_parallel(world.get_mesh("tp"))
        if params.checkpoint_activations:
            self.apply_activation_checkpointing()
        if params.compile_model:
            self.apply_compile()
            self._record_compiled()
        if plan.dp_shard > 1 or plan.cp > 1:  # context-parallel ranks shard the parameters too
            self.pipeline_runtime.for_each_stage(self, lambda: self.apply_fully_shard(world.fsdp_config))
            self.build.record_sharded(self.named_models())
        elif plan.dp_replicate > 1:
            self.pipeline_runtime.for_each_stage(self, lambda: self.apply_replicate(world.get_mesh("dp_replicate")))

        self.materialize()  # init_weights(), then callbacks.post_init_weights(models)
        if plan.pp > 1:
            self.pipeline_runtime.start(world.device, world.get_mesh("pp").get_group())
        if plan.cp > 1:
            self.context_parallel = ContextParallel(world.get_mesh("cp"), self.context_parallel_seq_dim)

        self.configure_optimizers()
        if not self.named_optimizers():
            raise ValueError(f"{type(self).__name__}.configure_optimizers() set no optimizer attribute")
        self.configure_schedulers()
        loaders = self.configure_dataloaders()
        if loaders is not None:
            if not (isinstance(loaders, tuple) and len(loaders) == 2):
                raise TypeError(
                    "configure_dataloaders() must return (train_dataloader, val_dataloader or None) "
                    f"or None, got {type(loaders).__name__}"
                )
            self.train_dataloader, self.val_dataloader = loaders

    def _plan_pipeline(self) -> None:
        """Choose the schedule and cut the meta-device model into this rank's part
        (`PipelineRuntime.plan`), before anything is allocated."""
        world = self.world
        layout, pp = self.pipeline_layout, world.plan.pp
        if layout is None:
            raise NotImplementedError(
                f"DeviceParameters.pipeline_parallel={pp}, but {type(self).__name__} declares no pipeline_layout: set "
                "pipeline_layout = PipelineLayout(layers='blocks', first=(...), last=(...)) on the trainer class")
        self.pipeline_runtime.plan(self, layout, world.device_parameters.pipeline, pp=pp,
                                   pp_rank=world.get_mesh("pp").get_local_rank(), batch=self._pipeline_batch,
                                   sharded=world.plan.dp_shard > 1, costs=self._pipeline_costs(),
                                   gather=world.all_gather_object)

    def _pipeline_costs(self) -> CostInputs:
        """What the automatic schedule's cost model knows of this trainer (`CostInputs`)."""
        from dream_trainer.world.peaks import device_name, lookup_peak, training_dtype

        dtype, device = training_dtype(self), self.world.device
        return CostInputs(self.model_flops_per_token, self.model_flops_per_sample, 4 if dtype in ("fp32", "tf32") else 2,
                          device, lookup_peak(device_name(device), dtype), self.world.plan.dp_shard)

    def _pipeline_batch(self) -> int:
        """Samples in each batch a rank trains on (what the micro-batches must divide)."""
        from dream_trainer.data.tokens import split_global_batch

        training = self.training_parameters
        if training.global_batch_size is not None:
            return split_global_batch(training.global_batch_size, self.world.dp_size, training.micro_batch_size)[0]
        if training.micro_batch_size is not None:
            return int(training.micro_batch_size)
        raise ValueError("pipeline parallelism needs the batch size before the model is built: set "
                         "TrainingParameters.global_batch_size (or micro_batch_size)")

    def _check_configuration(self) -> None:
        """Fail before building anything: a hook the configuration needs is missing, or
        a setting this device cannot honor."""
        world = self.world
        params, plan = world.device_parameters, world.plan
        if plan.tp > 1:
            self._require("apply_tensor_parallel", f"DeviceParameters.tensor_parallel={plan.tp}")
        if params.checkpoint_activations:
            self._require("apply_activation_checkpointing", "DeviceParameters.checkpoint_activations=True")
        if params.compile_model:
            self._require("apply_compile", "DeviceParameters.compile_model=True")
        if plan.dp_shard > 1 or plan.cp > 1:
            self._require("apply_fully_shard", f"DeviceParameters.dp_shard={plan.dp_shard}" if plan.dp_shard > 1 else
                          f"DeviceParameters.context_parallel={plan.cp} (FSDP2 over the context-parallel ranks)")
        if plan.cp > 1 and (plan.pp > 1 or plan.tp > 1):
            raise ValueError(
                f"DeviceParameters.context_parallel={plan.cp} with pipeline_parallel={plan.pp}, tensor_parallel="
                f"{plan.tp}: context parallelism composes with FSDP2/HSDP only for now; use pipeline_parallel=1 "
                "and tensor_parallel=1")
        if params.weight_init == "sharded" and world.device.type == "cpu" and (plan.dp_shard > 1 or plan.tp > 1):
            raise ValueError(
                "DeviceParameters.weight_init='sharded' needs DTensor's RNG tracker, which CPU meshes do not have: "
                "every shard would draw the same numbers. Use weight_init='full' (the default) on "
                f"{world.device}"
            )

    def _record_compiled(self) -> None:
        self.build.record_compiled(self.named_models())
        if not self.build.compiled:
            logger.warning(
                "DeviceParameters.compile_model=True but %s.apply_compile() compiled nothing this trainer can "
                "see (use self.compile_module(module) or module.compile())", type(self).__name__
            )

    def materialize(self) -> None:
        """Allocate the meta-device models on the world's device, seed, `init_weights()`,
        ``callbacks.post_init_weights(models)``, and check that nothing is left on the meta
        device.

        Sharded models (DTensor parameters) are initialized on full-size tensors, each rank
        keeping its part (``DeviceParameters.weight_init="full"``, see
        `dream_trainer.trainer.weights`): every layout starts from the weights one process
        would have with the same seed."""
        models = self.named_models()
        tied = shared_parameters(models.values())
        for model in models.values():
            model.to_empty(device=self.world.device)
        tie(tied)  # to_empty unties shared parameters (an embedding tied to the output head)
        if self.seed is not None:
            seed_everything(self.seed)
        with torch.no_grad():
            if self.world.device_parameters.weight_init == "full":
                whole_model = self.pipeline_runtime.whole_model(self, self.world.device)
                with whole_model as whole, full_size_parameters([*models.values(), *whole], self.world.device):
                    self.init_weights()
                    self.callbacks.post_init_weights(models)
            else:  # "sharded": DTensor's random ops on each shard (CUDA; checked in configure)
                self.init_weights()
                self.callbacks.post_init_weights(models)
        left = [
            f"{model_name}.{name}"
            for model_name, model in self.named_models().items()
            for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
            if tensor.device.type == "meta"
        ]
        if left:
            raise RuntimeError(
                f"after materialization {len(left)} tensor(s) are still on the meta device: "
                f"{', '.join(left[:10])}{' ...' if len(left) > 10 else ''}. Create them in "
                "configure_models() as parameters or buffers of a model (not on a plain attribute)."
            )
