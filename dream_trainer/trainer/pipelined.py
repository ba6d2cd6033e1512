"""`PipelineMixin`: `DreamTrainer`'s pipeline parallelism and the step API that runs the
same ``training_step`` with or without it (`forward_backward`, `forward_loss`), which also
applies context parallelism (`dream_trainer.context_parallel`) when ``context_parallel > 1``.

With ``DeviceParameters.pipeline_parallel = p > 1`` the model a trainer builds on the meta
device is cut, by its `PipelineLayout`, into stages; each rank keeps its stages' layers
under their original names (the model attribute now holds that part), the parallelization
hooks run on it (FSDP2/replicate per stage), the weights are initialized on the whole
model (a single process's, from the same seed) and the rest is dropped."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from dream_trainer.context_parallel import ContextParallel
from dream_trainer.pipeline import Pipeline, PipelineLayout, choose_schedule, cut, split_layers, stage_ids
from dream_trainer.pipeline.stages import layer_list

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineMixin:
    """Pipeline parallelism for `DreamTrainer` (see the module docstring)."""

    pipeline_layout: ClassVar[PipelineLayout | None] = None
    """Where the model's layers are, what runs before and after them: needed for
    ``pipeline_parallel > 1`` (`PipelineLayout`)."""

    pipeline: Pipeline | None = None
    """This rank's stages and schedule, when the run is pipeline parallel."""

    context_parallel: ContextParallel | None = None
    """The sequence sharding and ring attention of a ``context_parallel > 1`` run
    (`forward_backward` and `forward_loss` apply it)."""

    context_parallel_seq_dim: ClassVar[int] = 1
    """The sequence dimension of a step's inputs and targets (``(batch, sequence)`` token
    ids: 1), what context parallelism shards."""

    _pipeline_whole: nn.Module | None = None
    _pipeline_stages: list[nn.Module] = []

    # ------------------------------------------------------------------ the step API
    def forward_backward(self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """``loss_fn(model(inputs), target)``, then `backward` of it; the loss (detached).
        Pipeline parallel: the batch runs through every stage in micro-batches, by the
        schedule (forward and backward interleaved), and its mean loss reaches every rank.
        Use it in ``training_step``: the same code runs with and without a pipeline."""
        if self.pipeline is None:
            with self._sequence_shards(inputs, target) as (inputs, target):
                loss = loss_fn(model(*inputs) if isinstance(inputs, tuple) else model(inputs), target)
                self.backward(loss)  # type: ignore[attr-defined]
            return self._context_mean(loss.detach())
        accumulation = self.gradient_accumulation_steps  # type: ignore[attr-defined]
        scaled = loss_fn if accumulation == 1 else (lambda out, tgt: loss_fn(out, tgt) / accumulation)
        self._before_backward()  # type: ignore[attr-defined]
        loss = self.pipeline.train_step(inputs, target, scaled)
        loss = loss * accumulation if accumulation > 1 else loss
        self._after_loss(loss)  # type: ignore[attr-defined]
        return loss

    def forward_loss(self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """``loss_fn(model(inputs), target)`` with no backward (validation); pipeline
        parallel, the batch's mean loss through every stage, on every rank."""
        if self.pipeline is None:
            with self._sequence_shards(inputs, target) as (inputs, target):
                loss = loss_fn(model(*inputs) if isinstance(inputs, tuple) else model(inputs), target)
            return self._context_mean(loss)
        return self.pipeline.eval_step(inputs, target, loss_fn)

    @contextlib.contextmanager
    def _sequence_shards(self, inputs: Any, target: Any) -> Iterator[tuple[Any, Any]]:
        """Context parallel: this rank's part of the sequences of `inputs` and `target`,
        and attention as ring attention while the step runs (forward and backward)."""
        context = self.context_parallel
        if context is None:
            yield inputs, target
            return
        inputs, target = context.shard((inputs, target)) if isinstance(inputs, torch.Tensor) else (
            context.shard(inputs), context.shard(target))
        with context.region(self.world.device):  # type: ignore[attr-defined]
            yield inputs, target

    def _context_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """Context parallel: each rank's loss is its tokens' mean (equal shares); the
        sequences' mean on every rank of the group (a collective, no host sync)."""
        if self.context_parallel is None:
            return loss
        return self.world.all_reduce(loss.clone(), "mean", group=self.context_parallel.group)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ building
    def _plan_pipeline(self) -> None:
        """Choose the schedule and cut the meta-device model into this rank's part (before
        anything is allocated: a bad split or micro-batch count fails here)."""
        world = self.world  # type: ignore[attr-defined]
        layout, pp = self.pipeline_layout, world.plan.pp
        if layout is None:
            raise NotImplementedError(
                f"DeviceParameters.pipeline_parallel={pp}, but {type(self).__name__} declares no pipeline_layout: set "
                "pipeline_layout = PipelineLayout(layers='blocks', first=(...), last=(...)) on the trainer class")
        whole = getattr(self, layout.model, None)
        if not isinstance(whole, nn.Module):
            raise AttributeError(f"pipeline_layout.model={layout.model!r}: the trainer has no such model")
        layers = layer_list(whole, layout)
        _check_untied(whole, layout)
        params = world.device_parameters.pipeline
        batch = self._pipeline_batch()
        choice = choose_schedule(params, pp, batch, len(layers), world.plan.dp_shard > 1)
        logger.info(choice.describe(pp))
        n_stages = pp * choice.stages_per_rank
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        ranges = split_layers(len(layers), n_stages, params.split, sizes)
        pp_rank = world.get_mesh("pp").get_local_rank()
        mine = stage_ids(choice.schedule, pp_rank, pp, choice.stages_per_rank)
        held = sorted(i for s in mine for i in ranges[s])
        part = cut(whole, layout, held, 0 in mine, n_stages - 1 in mine)
        stages = [part] if len(mine) == 1 else [cut(part, layout, ranges[s], s == 0, s == n_stages - 1) for s in mine]
        self._pipeline_whole, self._pipeline_stages = whole, stages
        self._pipeline_plan = (mine, n_stages, choice)
        setattr(self, layout.model, part)
        logger.info("pipeline rank %d holds stage(s) %s: layers %s", pp_rank, mine, [list(ranges[s]) for s in mine])

    def _pipeline_batch(self) -> int:
        """Samples in each batch a rank trains on (what the micro-batches must divide)."""
        from dream_trainer.data.tokens import split_global_batch

        training = self.training_parameters  # type: ignore[attr-defined]
        if training.global_batch_size is not None:
            return split_global_batch(training.global_batch_size, self.world.dp_size, training.micro_batch_size)[0]  # type: ignore[attr-defined]
        if training.micro_batch_size is not None:
            return int(training.micro_batch_size)
        raise ValueError("pipeline parallelism needs the batch size before the model is built: set "
                         "TrainingParameters.global_batch_size (or micro_batch_size)")

    def _for_each_stage(self, apply: Callable[[], None]) -> None:
        """Run a parallelization hook once per stage, the model attribute holding that
        stage (one stage per rank: the rank's part itself)."""
        if self.pipeline_layout is None or len(self._pipeline_stages) <= 1:
            apply()
            return
        name = self.pipeline_layout.model
        part = getattr(self, name)
        try:
            for stage in self._pipeline_stages:
                setattr(self, name, stage)
                apply()
        finally:
            setattr(self, name, part)

    @contextlib.contextmanager
    def _whole_model(self) -> Iterator[list[nn.Module]]:
        """While weights are initialized: the model attribute holds the whole model (this
        rank's part shares its modules), allocated, so that `init_weights` draws what one
        process draws from the same seed; the rest is dropped after."""
        whole, layout = self._pipeline_whole, self.pipeline_layout
        if whole is None or layout is None:
            yield []
            return
        part = getattr(self, layout.model)
        for module in whole.modules():  # what other ranks hold (this rank's part is allocated)
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if any(t.is_meta for t in own):
                module.to_empty(device=self.world.device, recurse=False)  # type: ignore[attr-defined]
        setattr(self, layout.model, whole)
        try:
            yield [whole]
        finally:
            setattr(self, layout.model, part)
            self._pipeline_whole = None

    def _start_pipeline(self) -> None:
        mine, n_stages, choice = self._pipeline_plan
        world = self.world  # type: ignore[attr-defined]
        self.pipeline = Pipeline(self._pipeline_stages, mine, n_stages, choice, world.device,
                                 world.get_mesh("pp").get_group())


def _check_untied(model: nn.Module, layout: PipelineLayout) -> None:
    """The first stage's modules and the last's cannot share a weight (a tied embedding
    and head): they are on different ranks."""
    first = {id(p) for path in layout.first for p in model.get_submodule(path).parameters()}
    tied = [path for path in layout.last if any(id(p) in first for p in model.get_submodule(path).parameters())]
    if tied:
        raise ValueError(f"pipeline_layout: {tied} share weights with {list(layout.first)} (tied embeddings), which "
                         "would be on different pipeline stages: untie them, or use pipeline_parallel=1")
