"""Cutting a model into pipeline stages, and running them (`torch.distributed.pipelining`).

A rank's model keeps the layers of its stages under their original names (``blocks.3``),
so checkpoints are keyed as in one process and resume across a change of stages; each
stage is a shallow copy of it that shares its modules (a view: no weight is copied)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.pipeline.plan import PipelineChoice


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model's repeated layers are and what runs before and after them: what a
    trainer declares (its ``pipeline_layout``) so that its model can be cut into stages.

    The model's ``forward`` must run on any stage: take what the stage before it returns
    when the `first` modules are None there (``x = idx if self.tok_emb is None else ...``),
    run the layers it holds by iterating `layers`, and return the hidden states when the
    `last` modules are None.

    Attributes:
        layers: the attribute path of the layer list (an ``nn.ModuleList``: ``"blocks"``,
            ``"model.layers"``).
        first: modules only the first stage keeps (the embeddings), as attribute paths.
        last: modules only the last stage keeps (the final norm, the head).
        model: the trainer attribute that holds the model.
    """

    layers: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    model: str = "model"


class StageLayers(nn.Module):
    """The layers of a model that a rank holds, under their original indices (``"3"``):
    iterating yields them in order, as the full ``nn.ModuleList`` would."""

    def __init__(self, layers: Iterable[tuple[int, nn.Module | None]]):
        super().__init__()
        for index, layer in layers:
            self.add_module(str(index), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]  # type: ignore[return-value]


def layer_list(model: nn.Module, layout: PipelineLayout) -> nn.ModuleList | StageLayers:
    """The model's layer list, checked: a ``ModuleList`` (or `StageLayers`)."""
    layers = _get(model, layout.layers, "layers")
    if not isinstance(layers, (nn.ModuleList, StageLayers)):
        raise TypeError(f"pipeline_layout.layers={layout.layers!r} is a {type(layers).__name__}, not an nn.ModuleList")
    for path in (*layout.first, *layout.last):
        _get(model, path, "first/last")
    return layers


def cut(model: nn.Module, layout: PipelineLayout, layers: Iterable[int], first: bool, last: bool) -> nn.Module:
    """A shallow copy of `model` holding only `layers` (by index), and the `first` / `last`
    modules when asked (None otherwise). It shares every module it keeps with `model`: the
    copies along the attribute paths have their own child and hook tables only."""
    keep = set(layers)
    root = _shallow(model)
    held = layer_list(model, layout)
    indexed = list(held._modules.items())
    _set(root, layout.layers, StageLayers((int(name), layer) for name, layer in indexed if int(name) in keep))
    for path in layout.first if not first else ():
        _set(root, path, None)
    for path in layout.last if not last else ():
        _set(root, path, None)
    return root


def _shallow(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    for name, value in vars(module).items():  # its own tables: children, parameters, hooks
        if isinstance(value, (dict, set)):
            setattr(new, name, copy.copy(value))
    return new


def _get(model: nn.Module, path: str, what: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"pipeline_layout.{what}: {type(model).__name__} has no {path!r}")
        obj = getattr(obj, part)
    return obj


def _set(root: nn.Module, path: str, value: nn.Module | None) -> None:
    """Set `path` on `root`, shallow-copying each module along the way (so `root`'s
    source model is left as it was)."""
    parts = path.split(".")
    parent = root
    for part in parts[:-1]:
        child = _shallow(getattr(parent, part))
        setattr(parent, part, child)
        parent = child
    setattr(parent, parts[-1], value)


class Pipeline:
    """This rank's stages and their schedule; `train_step` and `eval_step` run a whole
    batch through the pipeline and return its mean loss on every rank of the pipeline.

    Args:
        stages: this rank's stage modules, in `stage_ids` order.
        stage_ids: their indices among all `n_stages`.
        n_stages: the number of stages.
        choice: the schedule, stages per rank and micro-batches (`choose_schedule`).
        device: where the stages run.
        group: the pipeline's process group (the ``pp`` mesh dimension).
    """

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], n_stages: int, choice: PipelineChoice,
                 device: torch.device, group: Any):
        import torch.distributed as dist

        self.modules, self.stage_ids, self.n_stages, self.choice = stages, stage_ids, n_stages, choice
        self.device, self.group = device, group
        self.holds_first, self.holds_last = 0 in stage_ids, n_stages - 1 in stage_ids
        ranks = dist.get_process_group_ranks(group)
        pp = len(ranks)
        self.last_rank = ranks[(n_stages - 1) % pp]  # who holds the last stage (looped placement)
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._schedule: Any = None
        self._shapes: Any = None  # the batch shapes the schedule's stages were built for

    def _build(self) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [PipelineStage(module, index, self.n_stages, self.device, group=self.group)
                  for module, index in zip(self.modules, self.stage_ids)]
        cls = get_schedule_class(self.choice.schedule)
        one = self.choice.schedule in ("GPipe", "1F1B")
        return cls(stages[0] if one else stages, n_microbatches=self.choice.microbatches, loss_fn=self._loss)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def _run(self, eval: bool, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist

        check_batch(target, self.choice.microbatches, "validation" if eval else "training")
        shapes = batch_shapes((inputs, target))
        if self._schedule is None or shapes != self._shapes:
            # torch's stages size their receive buffers by the first batch they run (per mode):
            # a batch of another size (a validation loader's smaller last batch) needs new ones.
            # Every rank of the pipeline sees the same batch, so every rank rebuilds together.
            self._schedule, self._shapes = self._build(), shapes
        self._loss_fn = loss_fn
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        run = self._schedule.eval if eval else self._schedule.step
        run(*args, target=target if self.holds_last else None, losses=losses, return_outputs=False)
        if self.holds_last:
            loss = torch.stack([loss.detach().float() for loss in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)  # every stage logs the batch's loss
        return loss

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of a batch through every stage, micro-batch by micro-batch
        (gradients averaged over the micro-batches); its mean loss, on every rank."""
        return self._run(False, inputs, target, loss_fn)

    def eval_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward only; the batch's mean loss, on every rank."""
        return self._run(True, inputs, target, loss_fn)


def batch_shapes(batch: Any) -> Any:
    """The shapes of a batch's tensors, in its (nested tuple, list or dict) structure:
    what a schedule's stages were built for."""
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape), batch.dtype
    if isinstance(batch, (tuple, list)):
        return tuple(batch_shapes(item) for item in batch)
    if isinstance(batch, dict):
        return tuple((key, batch_shapes(value)) for key, value in batch.items())
    return type(batch).__name__


def check_batch(target: Any, microbatches: int, kind: str = "training") -> None:
    """Refuse a batch the schedule's micro-batches cannot split evenly (every rank of the
    pipeline sees the same batch, so every rank refuses it), before any stage runs."""
    size = target.shape[0] if isinstance(target, torch.Tensor) else len(target)
    if size % microbatches:
        raise ValueError(
            f"a {kind} batch of {size} samples cannot be cut into {microbatches} equal pipeline micro-batches: give "
            f"the {kind} loader batches of a multiple of {microbatches} samples (drop a smaller last batch: "
            f"drop_last=True), or set PipelineParameters.microbatches to a divisor of every batch size")
