"""`FaultTolerantSampler`: training data that follows the fault-tolerant quorum (see
``docs/fault_tolerance.md``)."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from dream_trainer.fault_tolerance.world import FaultToleranceError, FaultTolerantWorld


def step_units(position: int, participants: int, units_per_epoch: int) -> int:
    """The first data unit of a step: `position` (units used by committed steps), moved to
    the next data epoch when the step's `participants` units would straddle two epochs
    (two permutations of the dataset could share a sample; the epoch's tail is dropped)."""
    epoch = position // units_per_epoch
    if (position + participants - 1) // units_per_epoch != epoch:
        return (epoch + 1) * units_per_epoch
    return position


class FaultTolerantSampler(Sampler[list[int]]):
    """A batch sampler whose batches follow the fault-tolerant quorum: at each step the
    ``n`` participating groups take ``n`` consecutive *units* of the data (a unit: one
    group's samples for one optimizer step, ``micro_batches x in-group data-parallel ranks
    x batch_size``), the group of replica rank ``r`` the ``r``-th. So no sample is trained
    twice in a step, a step that is not committed is retried on the same units, and
    whatever the groups that come and go, committed steps walk through the data in order:
    data epoch ``e`` is a permutation of the dataset (seeded with ``seed + e``), cut into
    units. Endless (its length is nominal): train by ``max_steps``.

    Use it as ``DataLoader(dataset, batch_sampler=FaultTolerantSampler(dataset, 8,
    self.world, micro_batches=...))`` with ``num_workers=0``, in ``configure_dataloaders``.
    Its position is saved in checkpoints and sent with a heal (it is a stateful sampler).
    """

    NOMINAL_LENGTH = 2**62

    def __init__(self, data: Sized | int, batch_size: int, world: FaultTolerantWorld, *, micro_batches: int = 1,
                 shuffle: bool = True, seed: int = 0):
        if not isinstance(world, FaultTolerantWorld):
            raise TypeError(f"FaultTolerantSampler needs the trainer's FaultTolerantWorld, got {type(world).__name__}: "
                            "add a FaultToleranceCallback")
        size = data if isinstance(data, int) else len(data)
        for name, value in (("batch_size", batch_size), ("micro_batches", micro_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FaultTolerantSampler({name}={value!r}) is invalid: expected an int >= 1")
        self.world, self.size, self.batch_size, self.micro_batches = world, size, batch_size, micro_batches
        self.shuffle, self.seed = shuffle, seed
        self.unit_size = micro_batches * world.dp_size * batch_size
        self.units_per_epoch = size // self.unit_size
        if self.units_per_epoch < 1:
            raise ValueError(
                f"FaultTolerantSampler: {size} samples are fewer than one unit ({micro_batches} micro-batch(es) x "
                f"{world.dp_size} rank(s) x batch_size {batch_size} = {self.unit_size})"
            )
        self.position = 0  # units used by committed steps
        self._last: tuple[int, int, int] | None = None  # (committed count, first unit, participants) of the last step
        self._attempt: int | None = None
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.NOMINAL_LENGTH

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def next_indices(self) -> list[int]:
        attempt, committed, participants, replica_rank, micro = self.world.step_slot()
        if micro >= self.micro_batches:
            raise FaultToleranceError(
                f"micro-batch {micro + 1} of a step, but FaultTolerantSampler(micro_batches={self.micro_batches}): "
                "set it to TrainingParameters.gradient_accumulation_steps"
            )
        if attempt != self._attempt:  # the first batch of a new step
            if self._last is not None and committed > self._last[0]:  # the previous step was committed
                self.position = self._last[1] + self._last[2]
            self._last = (committed, step_units(self.position, participants, self.units_per_epoch), participants)
            self._attempt = attempt
        unit = self._last[1] + replica_rank
        epoch, within = divmod(unit, self.units_per_epoch)
        start = within * self.unit_size + (micro * self.world.dp_size + self.world.dp_rank) * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.size)
            self._perm = (epoch, order)
        return self._perm[1]

    @property
    def data_epoch(self) -> int:
        """The data epoch of the units the committed steps have reached."""
        return self.position // self.units_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self._last = tuple(state["last"]) if state["last"] is not None else None  # type: ignore[assignment]
        self._attempt = None  # the next batch starts a step
