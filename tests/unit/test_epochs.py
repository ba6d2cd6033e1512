"""The data position's plan and its epoch, on their own (`DataPosition.plan_batches`,
`agree_lengths`, `total_steps`, `epoch_batches`): a stand-in world and counters, no trainer."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dream_trainer.configs import TrainingParameters
from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.trainer.epochs import loader_length, numbered, set_epoch


class World:
    """The other ranks' loader lengths (this rank's is passed in); batch announcements."""

    def __init__(self, others: tuple[int | None, ...] = (), announces: bool = False):
        self.others, self.announces_batches = list(others), announces
        self.announced: list[bool] = []
        self.dp_rank, self.dp_size = 0, 1 + len(self.others)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, *self.others]

    def before_batch(self, starts_step: bool) -> None:
        self.announced.append(starts_step)


class Counters:
    def __init__(self, local_batches: int = 0, current_epoch: int = 0):
        self.local_batches, self.current_epoch = local_batches, current_epoch


class Unsized:
    """A loader without a length."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def agreed(others, loader, **training) -> DataPosition:
    position = DataPosition()
    position.agree_lengths(World(others), loader, None, TrainingParameters(**training), accumulation=1)
    return position


def test_the_ranks_agree_on_the_smallest_length_and_plan_with_it(caplog):
    with caplog.at_level(logging.WARNING):
        position = agreed((10,), list(range(12)), n_epochs=2)
    assert "differ in length" in caplog.text
    assert position.train_steps_per_epoch == 10
    assert position.total_steps(TrainingParameters(n_epochs=2), accumulation=3) == 8  # groups of 3, 3, 3, 1
    assert position.total_steps(TrainingParameters(n_epochs=2, max_steps=5), accumulation=3) == 5


def test_a_loader_without_a_length_plans_with_the_hint():
    position = agreed((None,), Unsized(7), n_epochs=3)
    assert position.train_steps_per_epoch is None
    assert position.total_steps(TrainingParameters(n_epochs=3, train_steps_per_epoch_hint=9), accumulation=2) == 15
    assert position.total_steps(TrainingParameters(n_epochs=3), accumulation=2) is None
    before = DataPosition()  # before the lengths are agreed, only max_steps is known
    assert before.total_steps(TrainingParameters(max_steps=4, train_steps_per_epoch_hint=9), accumulation=1) == 4


def test_a_configured_length_wins_and_warns_when_a_loader_is_shorter(caplog):
    with caplog.at_level(logging.WARNING):
        position = agreed((3,), list(range(8)), n_epochs=1, train_steps_per_epoch=4)
    assert position.train_steps_per_epoch == 4 and "has only 3 batches" in caplog.text
    assert position.total_steps(TrainingParameters(n_epochs=1, train_steps_per_epoch=4), accumulation=1) == 3


def test_an_empty_loader_and_a_loader_that_splits_batches_otherwise_are_refused():
    with pytest.raises(ValueError, match="dataloader is empty"):
        agreed((5,), [], n_epochs=1)

    class Splits(list):
        global_position, accumulation_steps = True, 2

    with pytest.raises(ValueError, match="splits each global batch into 2"):
        DataPosition().agree_lengths(World(), Splits(range(4)), None, TrainingParameters(n_epochs=1), accumulation=4)


def test_a_global_batch_is_split_for_the_data_parallel_ranks():
    position = DataPosition()
    position.plan_batches(TrainingParameters(n_epochs=1, global_batch_size=32, micro_batch_size=4), dp_size=2)
    assert position.accumulation_steps == 4
    position.plan_batches(TrainingParameters(n_epochs=1), dp_size=2)  # no global batch: nothing derived
    assert position.accumulation_steps == 4


def epoch(position: DataPosition, loader, counters=None, world=None, accumulation=1) -> list[tuple[Any, bool]]:
    counters = counters or Counters()
    out = []
    for batch, is_last in position.epoch_batches(loader, counters, world or World(), accumulation):
        out.append((batch, is_last))
        counters.local_batches += 1  # what the loop does
    return out


@pytest.mark.parametrize("loader", [list(range(5)), Unsized(5)], ids=["sized", "unsized"])
def test_an_epoch_marks_its_last_batch(loader):
    assert epoch(DataPosition(), loader) == [(0, False), (1, False), (2, False), (3, False), (4, True)]
    limited = agreed((None,), loader, n_epochs=1, train_steps_per_epoch=3)
    assert epoch(limited, loader) == [(0, False), (1, False), (2, True)]


def test_a_mid_epoch_resume_fast_forwards_past_the_consumed_batches():
    position = DataPosition()
    assert epoch(position, list(range(5)), Counters(local_batches=2)) == [(2, False), (3, False), (4, True)]
    assert position.mid_epoch(2) and not position.mid_epoch(0)
    position.epoch_complete = True
    assert not position.mid_epoch(2)


def test_a_world_that_announces_batches_hears_of_each_fetch_and_whether_it_starts_a_step():
    world = World(announces=True)
    assert len(epoch(DataPosition(), list(range(4)), world=world, accumulation=2)) == 4
    assert world.announced == [True, False, True, False]


def test_set_epoch_and_the_loader_length():
    class Sampler:
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    class Loader(list):
        sampler = Sampler()

    loader = Loader([1, 2])
    set_epoch(loader, 3)
    assert loader.sampler.epoch == 3
    assert loader_length(loader) == 2 and loader_length(Unsized(2)) is None


@pytest.mark.parametrize("count, expected", [(3, [(0, False), (1, False), (2, True)]), (1, [(0, True)]), (0, [])])
def test_numbered_marks_the_last_batch_and_pulls_none_past_the_count(count, expected):
    pulled = []

    def source():
        for i in range(5):
            pulled.append(i)
            yield i

    assert list(numbered(source(), count)) == expected
    assert pulled == list(range(count))  # a stateful loader's position: no batch fetched and dropped
