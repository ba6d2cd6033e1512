"""`AbstractTrainer`: the counters and the named accessors every trainer has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs import TrainerConfig
from dream_trainer.trainer.model_facts import ModelFacts, dense_flops_per_token
from dream_trainer.world.world import DistributedWorld

if TYPE_CHECKING:
    from dream_trainer.protocol.collection import CallbackCollection

T = TypeVar("T")


class AbstractTrainer(ABC):
    """Counters and accessors shared by every trainer.

    Attributes:
        global_step: optimizer steps taken (accumulation micro-batches do not count).
        current_epoch: the epoch being run (0-based).
        local_batches: batches (micro-batches) consumed in the current epoch.
    """

    config: TrainerConfig
    world: DistributedWorld
    callbacks: CallbackCollection
    run_dir: Path
    train_dataloader: Iterable[Any] | None = None
    val_dataloader: Iterable[Any] | None = None

    def __init__(self) -> None:
        self.global_step = 0
        self.current_epoch = 0
        self.local_batches = 0
        self.model_facts = ModelFacts()  # parameter owners, model FLOPs

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
        return self._named(LRScheduler)  # type: ignore[type-abstract]

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
        (6 x the parameters outside embeddings). Override for a better count (e.g. add
        attention's ``12 * n_layers * d_model * seq_len``); return None for unknown."""
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

    # ------------------------------------------------------------------ state
    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

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
