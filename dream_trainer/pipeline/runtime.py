"""`PipelineRuntime`: one trainer's pipeline parallelism, from the cut of its model to the
running `Pipeline`.

With ``DeviceParameters.pipeline_parallel = p > 1`` the model a trainer builds on the meta
device is cut, by its `PipelineLayout`, into stages; each rank keeps its stages' layers
under their original names (the model attribute now holds that part), the parallelization
hooks run on it (FSDP2/replicate per stage), and the weights are initialized by the whole
model's ``init_weights`` (a single process's draws, from the same seed): what other ranks
hold stays on the meta device, its random fills drawn and dropped (`DrawForMeta`).

The runtime holds no trainer: the object that holds the model (the trainer) is passed to
each call that reads or swaps the model attribute (`PipelineLayout.model`), and what it
needs from the world (the pipeline rank, the device, the process group) is passed in."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dream_trainer.pipeline.cost import DeviceCost, ModelCost, cpu_gloo, cuda_nccl, model_cost
from dream_trainer.pipeline.plan import PipelineChoice, PipelineParameters, choose_schedule, split_layers, stage_ids
from dream_trainer.pipeline.stages import Pipeline, PipelineLayout, cut, layer_list

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostInputs:
    """What a trainer knows for the schedule's cost model (`dream_trainer.pipeline.cost`):
    training FLOPs per token (x ``PipelineParameters.sample_tokens``) or per sample (None:
    unknown), activation element bytes (2 under bf16), the device, its dense peak FLOP/s
    (None: unknown), and the ways the model state is sharded besides the pipeline (FSDP2's
    ``dp_shard``)."""

    flops_per_token: float | None
    flops_per_sample: float | None
    element_bytes: int
    device: torch.device
    peak_flops: float | None = None
    state_shards: int = 1

    def resolve(self, layers: list[nn.Module], whole: nn.Module, sample_tokens: int | None,
                gloo: bool) -> tuple[ModelCost, DeviceCost] | None:
        per_sample = self.flops_per_sample
        if per_sample is None and self.flops_per_token and sample_tokens:
            per_sample = self.flops_per_token * sample_tokens
        model = model_cost(layers, whole, per_sample, sample_tokens, self.element_bytes, self.state_shards)
        if model is None:
            return None
        return model, (cpu_gloo() if gloo or self.device.type != "cuda" else cuda_nccl(self.device, self.peak_flops))

LossFn = Callable[[Any, Any], torch.Tensor]


def agree_on_choice(choice: PipelineChoice, gather: Callable[[Any], list[Any]]) -> None:
    """Every rank must cut the model alike: gather each rank's (schedule, stages per rank,
    micro-batches) and raise on every rank, naming each, when they differ (a cost model fed
    different numbers on one rank, e.g. another thread count)."""
    mine = (choice.schedule, choice.stages_per_rank, choice.microbatches)
    chosen = [tuple(c) for c in gather(mine)]
    if len(set(chosen)) > 1:
        each = "; ".join(f"rank {r}: {s} x{v}, {m} micro-batches" for r, (s, v, m) in enumerate(chosen))
        raise RuntimeError(f"the ranks chose different pipeline schedules ({each}): set "
                           "PipelineParameters.schedule and stages_per_rank explicitly, or give every rank the same "
                           "threads and device")


class PipelineRuntime:
    """The pipeline state of one trainer, built in three calls at fixed points of its
    model build: `plan` (cut the meta-device model), `whole_model` (initialize the weights
    on the whole model) and `start` (the running `Pipeline`); `for_each_stage` runs a
    parallelization hook per stage in between. Before `plan` (a run that is not pipeline
    parallel) every call is a no-op and `pipeline` is None.

    Attributes:
        layout: the layout the model was cut by (None before `plan`).
        stage_ids: the indices of this rank's stages among all `n_stages`.
        n_stages: the number of stages of the whole pipeline (0 before `plan`).
        choice: the schedule, stages per rank and micro-batches (`choose_schedule`).
        stages: this rank's stage modules, in `stage_ids` order (views of the model).
        whole: the whole model, from `plan` until its weights are initialized.
        pipeline: the running stages and schedule, once `start` ran.
    """

    def __init__(self) -> None:
        self.layout: PipelineLayout | None = None
        self.stage_ids: list[int] = []
        self.n_stages = 0
        self.choice: PipelineChoice | None = None
        self.stages: list[nn.Module] = []
        self.whole: nn.Module | None = None
        self.pipeline: Pipeline | None = None

    def plan(self, holder: object, layout: PipelineLayout, params: PipelineParameters, *, pp: int, pp_rank: int,
             batch: Callable[[], int], sharded: bool = False, gloo: bool | None = None,
             costs: CostInputs | None = None,
             gather: Callable[[Any], list[Any]] | None = None) -> None:
        """Choose the schedule and cut the meta-device model (``holder.<layout.model>``)
        into this rank's part, which replaces it on `holder` (before anything is allocated:
        a bad split or micro-batch count fails here). `batch` gives the samples in each
        batch a rank trains on (asked once the model is checked); `sharded`: FSDP2 inside
        the stages (``dp_shard > 1``); `gloo`: the stages talk over gloo (None: the default
        process group's backend says); `costs`: what the automatic choice's cost model needs
        (`CostInputs`; None: it falls back to the expected bubble); `gather`: the world's
        ``all_gather_object``, to check that every rank chose alike (`agree_on_choice`). The
        choice and why are logged once, on rank 0, at WARNING: what a run's user sees."""
        whole = getattr(holder, layout.model, None)
        if not isinstance(whole, nn.Module):
            raise AttributeError(f"pipeline_layout.model={layout.model!r}: the trainer has no such model")
        layers = layer_list(whole, layout)
        check_untied(whole, layout)
        gloo = _over_gloo() if gloo is None else gloo
        cost = costs.resolve(layers, whole, params.sample_tokens, gloo) if costs is not None else None
        choice = choose_schedule(params, pp, batch(), len(layers), sharded, gloo, cost)
        if gather is not None:
            agree_on_choice(choice, gather)
        if _rank() == 0:
            logger.warning(choice.describe(pp))
        n_stages = pp * choice.stages_per_rank
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        ranges = split_layers(len(layers), n_stages, params.split, sizes)
        mine = stage_ids(choice.schedule, pp_rank, pp, choice.stages_per_rank)
        held = sorted(i for s in mine for i in ranges[s])
        part = cut(whole, layout, held, 0 in mine, n_stages - 1 in mine)
        stages = [part] if len(mine) == 1 else [cut(part, layout, ranges[s], s == 0, s == n_stages - 1) for s in mine]
        self.layout, self.whole, self.stages = layout, whole, stages
        self.stage_ids, self.n_stages, self.choice = mine, n_stages, choice
        setattr(holder, layout.model, part)
        logger.info("pipeline rank %d holds stage(s) %s: layers %s", pp_rank, mine, [list(ranges[s]) for s in mine])

    def for_each_stage(self, holder: object, apply: Callable[[], None]) -> None:
        """Run a parallelization hook once per stage, the model attribute of `holder`
        holding that stage (one stage per rank, or no pipeline: once, as it is)."""
        if self.layout is None or len(self.stages) <= 1:
            apply()
            return
        name = self.layout.model
        part = getattr(holder, name)
        try:
            for stage in self.stages:
                setattr(holder, name, stage)
                apply()
        finally:
            setattr(holder, name, part)

    @contextlib.contextmanager
    def whole_model(self, holder: object, device: torch.device) -> Iterator[list[nn.Module]]:
        """While weights are initialized: the model attribute of `holder` holds the whole
        model (this rank's part, allocated, shares its modules), so that ``init_weights``
        draws what one process draws from the same seed. What other ranks hold stays on the
        meta device: a random fill of one of its tensors (``normal_``, ``uniform_``, ...)
        draws the same numbers into a scratch tensor on `device`, dropped at once, so the
        random stream advances as in one process and a rank allocates one layer's tensor
        at a time beyond its own. Yields ``[whole model]`` (``[]`` when there is none)."""
        whole, layout = self.whole, self.layout
        if whole is None or layout is None:
            yield []
            return
        part = getattr(holder, layout.model)
        setattr(holder, layout.model, whole)
        try:
            with DrawForMeta(device):
                yield [whole]
        finally:
            setattr(holder, layout.model, part)
            self.whole = None

    def start(self, device: torch.device, group: Any) -> Pipeline:
        """The running `Pipeline` of the planned stages on `device`, over `group` (the
        mesh's ``pp`` process group)."""
        if self.choice is None:
            raise RuntimeError("PipelineRuntime.start() before plan(): there are no stages to run")
        self.pipeline = Pipeline(self.stages, self.stage_ids, self.n_stages, self.choice, device, group)
        return self.pipeline

    def train_step(self, inputs: Any, target: Any, loss_fn: LossFn, accumulation: int = 1) -> torch.Tensor:
        """`Pipeline.train_step` of the batch, its loss scaled by 1/`accumulation` for the
        gradients (``gradient_accumulation_steps``); the batch's mean loss, unscaled."""
        if self.pipeline is None:
            raise RuntimeError("PipelineRuntime.train_step() before start(): the run is not pipeline parallel")
        if accumulation < 1:
            raise ValueError(f"accumulation={accumulation!r} is invalid: expected gradient accumulation steps >= 1")
        scaled = loss_fn if accumulation == 1 else (lambda out, tgt: loss_fn(out, tgt) / accumulation)
        loss = self.pipeline.train_step(inputs, target, scaled)
        return loss * accumulation if accumulation > 1 else loss


RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                          "log_normal_", "cauchy_"})
"""The in-place random fills `DrawForMeta` draws for a meta tensor."""


class DrawForMeta(TorchDispatchMode):
    """Inside: a random in-place fill of a meta tensor (the layers other pipeline ranks
    hold) draws its numbers into a scratch tensor of the same shape and dtype on `device`,
    which is dropped, and leaves the meta tensor as it is; every other op runs as it is
    (on a meta tensor: shapes only). The generator advances as if the tensor were real."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.is_meta and func.overloadpacket.__name__ in RANDOM_FILLS:
            scratch = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            func(scratch, *args[1:], **kwargs)
            return target
        return func(*args, **kwargs)


def _over_gloo() -> bool:
    """The default process group's backend is gloo (CPU ranks; not a CUDA world's NCCL)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    backend = str(dist.get_backend())
    return "gloo" in backend and "nccl" not in backend


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def check_untied(model: nn.Module, layout: PipelineLayout) -> None:
    """The first stage's modules and the last's cannot share a weight (a tied embedding
    and head): they are on different ranks."""
    first = {id(p) for path in layout.first for p in model.get_submodule(path).parameters()}
    tied = [path for path in layout.last if any(id(p) in first for p in model.get_submodule(path).parameters())]
    if tied:
        raise ValueError(f"pipeline_layout: {tied} share weights with {list(layout.first)} (tied embeddings), which "
                         "would be on different pipeline stages: untie them, or use pipeline_parallel=1")
