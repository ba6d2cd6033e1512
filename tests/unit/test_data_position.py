"""`DataPosition` on its own: a shuffled loader resumed mid-epoch sees the rest of the saved
order, a stateful loader restores itself, the planned epoch length — no trainer."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.utils import rng_state


def _loader(seed: int) -> DataLoader:
    data = TensorDataset(torch.arange(40).float())
    return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _epoch(position: DataPosition, loader: DataLoader, start: int = 0) -> list[list[float]]:
    """What the trainer's loop does with a position: open, make the iterator, fast-forward."""
    position.open_epoch(loader)
    iterator = iter(loader)
    if not position.take_restored() and start:
        for _ in range(start):
            next(iterator)
    position.apply_resume_rng()
    return [batch[0].tolist() for batch in iterator]


def test_a_shuffled_loader_resumed_mid_epoch_continues_the_saved_order_and_rng():
    torch.manual_seed(0)
    saved, loader = DataPosition(), _loader(seed=1)
    _epoch(saved, loader)  # epoch 0: the generator moves on
    saved.open_epoch(loader)
    iterator = iter(loader)
    first = [next(iterator)[0].tolist() for _ in range(3)]
    state, rng = saved.rank_state(loader, mid_epoch=True), rng_state()
    rest = [batch[0].tolist() for batch in iterator]
    after = torch.rand(3)  # what the uninterrupted run draws next

    torch.manual_seed(123)  # the resuming process starts elsewhere
    resumed, fresh = DataPosition(), _loader(seed=999)
    resumed.load_rank_state(state, fresh, mid_epoch=True, rng=rng)
    assert _epoch(resumed, fresh, start=3) == rest
    assert len(first) == 3 and first + rest != sorted(first + rest)  # shuffled, not trivially equal
    assert torch.equal(torch.rand(3), after)


def test_an_epoch_start_is_saved_only_mid_epoch_and_generators_always():
    position, loader = DataPosition(), _loader(seed=1)
    _epoch(position, loader)
    at_boundary = position.rank_state(loader, mid_epoch=False)
    assert at_boundary["epoch_start"] is None and len(at_boundary["generators"]) == 1
    other = _loader(seed=5)
    DataPosition().load_rank_state(at_boundary, other, mid_epoch=False)
    assert torch.equal(other.generator.get_state(), loader.generator.get_state())


class _StatefulLoader:
    def __init__(self, n: int) -> None:
        self.n, self.position = n, 0

    def __iter__(self) -> Any:
        while self.position < self.n:
            self.position += 1
            yield self.position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_a_stateful_loader_restores_itself_and_a_lookahead_snapshot_wins():
    position, loader = DataPosition(), _StatefulLoader(10)
    iterator = iter(loader)
    next(iterator), next(iterator)
    position.snapshot(loader)  # before a lookahead
    next(iterator)
    assert position.rank_state(loader, mid_epoch=True) == {"loader": {"position": 2}}
    fresh, resumed = _StatefulLoader(10), DataPosition()
    resumed.load_rank_state({"loader": {"position": 2}}, fresh, mid_epoch=True)
    assert resumed.take_restored() is True and resumed.take_restored() is False
    assert list(fresh) == list(range(3, 11))


def test_the_planned_epoch_length():
    position = DataPosition()
    assert position.planned_epoch_batches(hint=50) is None  # setup has not agreed yet
    position.length_agreed = True
    assert position.planned_epoch_batches(hint=50) == 50  # a loader without a length: the hint
    position.train_loader_batches = 12
    assert position.planned_epoch_batches(hint=50) == 12
    position.train_steps_per_epoch = 7
    assert position.planned_epoch_batches(hint=None) == 7


def test_a_generator_count_mismatch_warns_and_keeps_the_loader(caplog):
    loader = _loader(seed=1)
    before = loader.generator.get_state()
    with caplog.at_level(logging.WARNING, logger="dream_trainer.trainer.data_position"):
        DataPosition().load_rank_state({"generators": []}, loader, mid_epoch=False)
    assert "1 generator(s)" in caplog.text and torch.equal(loader.generator.get_state(), before)
