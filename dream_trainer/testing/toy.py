"""`ToyTrainer`: a tiny regression trainer for tests (ours and users')."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from dream_trainer.configs import TrainerConfig
from dream_trainer.trainer.dream import DreamTrainer


def toy_data(n_samples: int = 256, in_features: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: ``y = tanh(x @ w) + 0.01 * noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, in_features, generator=g)
    w = torch.randn(in_features, 1, generator=g)
    y = torch.tanh(x @ w) + 0.01 * torch.randn(n_samples, 1, generator=g)
    return x, y


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, which may be a DTensor: each rank keeps
    its own part, with no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


class _Stream(IterableDataset):
    """An iterable view of a tensor dataset without ``__len__``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        return iter(zip(self.x, self.y))


class ToyTrainer(DreamTrainer):
    """Fits a 2-layer MLP to `toy_data` with SGD; data sharded over data-parallel ranks.
    `dropout` > 0 drops inputs in training (so steps depend on the RNG state).
    `sampler`: ``"distributed"`` (a `DistributedSampler`, shuffled with `shuffle`),
    ``"random"`` (``DataLoader(shuffle=True)``: the order comes from the global RNG) or
    ``"generator"`` (``DataLoader(shuffle=True, generator=g)`` with a seeded `g`); the last
    two shard the data by slicing over data-parallel ranks.

    ``self.step_losses`` holds each micro-batch's loss (device tensors).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        in_features: int = 8,
        hidden: int = 16,
        n_samples: int = 256,
        batch_size: int = 16,
        lr: float = 0.05,
        iterable: bool = False,
        with_validation: bool = True,
        shuffle: bool = False,
        dropout: float = 0.0,
        sampler: str = "distributed",
    ):
        if sampler not in ("distributed", "random", "generator"):
            raise ValueError(f"sampler={sampler!r} is invalid: expected 'distributed', 'random' or 'generator'")
        super().__init__(config)
        self.in_features, self.hidden, self.n_samples = in_features, hidden, n_samples
        self.batch_size, self.lr, self.iterable = batch_size, lr, iterable
        self.with_validation, self.shuffle, self.dropout = with_validation, shuffle, dropout
        self.sampler = sampler
        self.step_losses: list[torch.Tensor] = []

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(self.in_features, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def init_weights(self) -> None:
        """Deterministic and layout-independent: each full tensor is drawn from a generator
        seeded with the run's seed, then each rank keeps its part (FSDP shard, TP slice), so
        runs on 1 and N ranks start from the same weights."""
        g = torch.Generator().manual_seed(self.seed or 0)
        for name, param in self.model.named_parameters():
            fan_in = param.shape[-1] if param.ndim > 1 else self.hidden
            bound = 1.0 / fan_in**0.5
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=g)
            copy_full_(param, full)

    def apply_fully_shard(self, fsdp_config: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in (self.model[0], self.model[2]):
            fully_shard(layer, **fsdp_config)
        fully_shard(self.model, **fsdp_config)

    def apply_compile(self) -> None:
        for layer in (self.model[0], self.model[2]):
            self.compile_module(layer)

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def _loader(self, x: torch.Tensor, y: torch.Tensor) -> DataLoader[Any]:
        world = self.world
        if self.iterable:
            shard = slice(world.dp_rank, None, world.dp_size)
            return DataLoader(_Stream(x[shard], y[shard]), batch_size=self.batch_size)
        if self.sampler != "distributed":
            shard = slice(world.dp_rank, None, world.dp_size)
            generator = torch.Generator().manual_seed(self.seed or 0) if self.sampler == "generator" else None
            return DataLoader(TensorDataset(x[shard], y[shard]), batch_size=self.batch_size, shuffle=True, generator=generator)
        dataset = TensorDataset(x, y)
        # A DistributedSampler even on one rank: the same seed gives the same global order
        # whatever the world size, so runs on 1 and N ranks see the same global batches.
        sampler = DistributedSampler(
            dataset, num_replicas=world.dp_size, rank=world.dp_rank, shuffle=self.shuffle, seed=self.seed or 0
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)

    def configure_dataloaders(self) -> tuple[Any, Any]:
        x, y = toy_data(self.n_samples, self.in_features)
        split = self.n_samples * 3 // 4
        train = self._loader(x[:split], y[:split])
        val = self._loader(x[split:], y[split:]) if self.with_validation else None
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        if self.dropout:  # input dropout: draws from the torch RNG every step
            x = nn.functional.dropout(x, self.dropout)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        self.step_losses.append(loss.detach())
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"loss": nn.functional.mse_loss(self.model(x), y)}
