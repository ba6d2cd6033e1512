"""An elastic global batch under fault tolerance: a `TokenLoader` splits each step's global
batch over whatever slots the quorum has (participants x ranks x accumulation), unevenly
when they do not divide it, with every micro-batch carrying the loss weight that makes the
update the whole global batch's; and the trainer applies that weight in its backward."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dream_trainer import DeviceParameters, DreamTrainer, TrainerConfig, TrainingParameters
from dream_trainer.data import DocumentBatch, GlobalOrder, TokenLoader, write_tokens
from dream_trainer.data.weighted import WeightedBatch, WeightedDocumentBatch, with_loss_weight
from dream_trainer.world.transfer import BatchTransfer

SEQ, RANKS = 8, 2


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(5, 60))) for _ in range(120)]
    return write_tokens(tmp_path / "c.tokens", docs)


class Clock:
    """The quorum every group sees: the step's attempt, committed steps, participants."""

    attempt = committed = participants = micro = 0


class FakeWorld:
    """A fault-tolerant world's data view for one rank of one replica group."""

    def __init__(self, clock: Clock, dp_rank: int) -> None:
        self.clock, self.dp_rank, self.dp_size, self.replica_rank = clock, dp_rank, RANKS, 0

    def step_slot(self) -> tuple[int, int, int, int, int]:
        c = self.clock
        return c.attempt, c.committed, c.participants, self.replica_rank, c.micro


@pytest.mark.parametrize("gbs", [20, 24])  # 20: uneven for 4 and 3 groups; 24: uneven for 4, even for 3
def test_every_quorum_splits_the_global_batch_into_slots_weighted_to_the_full_batch(corpus, gbs):
    clock, accumulation = Clock(), 2
    micro = gbs // (RANKS * accumulation)
    worlds = [[FakeWorld(clock, r) for r in range(RANKS)] for _ in range(4)]
    loaders = [[TokenLoader(corpus, SEQ, gbs, world=w, micro_batch_size=micro, seed=3, return_ids=True) for w in g]
               for g in worlds]
    iterators = [[iter(loader) for loader in g] for g in loaders]
    reference = GlobalOrder(loaders[0][0].order.n_samples, gbs, seed=3)
    for step, members in enumerate([[0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3], [1, 2, 3]]):  # 4 -> 3 -> 4 -> 3
        clock.attempt, clock.committed, clock.participants = step, step, len(members)
        if step == 2:  # group 1 comes back: it heals from a peer (the peer's position)
            for loader in loaders[1]:
                loader.load_state_dict(loaders[0][0].state_dict())
        ids, weights, sizes = [], [], []
        for replica_rank, group in enumerate(members):  # slot order: replica rank, dp rank, micro-batch
            for rank in range(RANKS):
                worlds[group][rank].replica_rank = replica_rank
                for clock.micro in range(accumulation):
                    batch = next(iterators[group][rank])
                    inputs, targets, sample_ids = batch  # still a tuple
                    assert inputs.shape == targets.shape == (len(sample_ids), SEQ)
                    ids.append(sample_ids.numpy())
                    sizes.append(len(sample_ids))
                    weights.append(getattr(batch, "loss_weight", None))
        slots = len(members) * RANKS * accumulation
        np.testing.assert_array_equal(np.concatenate(ids), reference.peek())  # each sample once, in the run's order
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == gbs
        if gbs % slots == 0:
            assert weights == [None] * slots
        else:  # every micro-batch of an uneven step carries one: n * S / G
            assert weights == pytest.approx([n * slots / gbs for n in sizes])
            assert sum(weights) == pytest.approx(slots)
        reference.advance()
        # the cursor moves once per committed step, as before (at the next step's first micro-batch)
        assert {loader.order.consumed for group in members for loader in loaders[group]} == {step * gbs}


def test_a_step_not_committed_is_retried_on_the_same_uneven_shares(corpus):
    clock = Clock()
    clock.participants = 3
    world = FakeWorld(clock, 1)
    world.replica_rank = 2
    loader = TokenLoader(corpus, SEQ, 20, world=world, micro_batch_size=5, return_ids=True)
    batches = iter(loader)
    first = [next(batches) for clock.micro in range(2)]
    clock.attempt = 1  # a new attempt, committed still 0
    again = [next(batches) for clock.micro in range(2)]
    assert [b[2].tolist() for b in first] == [b[2].tolist() for b in again]
    assert [b.loss_weight for b in first] == [b.loss_weight for b in again] == [pytest.approx(2 * 12 / 20)] * 2


def test_only_a_quorum_that_would_leave_a_slot_empty_is_refused(corpus):
    clock = Clock()
    clock.participants = 3  # 3 x 2 ranks x 2 micro-batches = 12 slots > 8 samples
    loader = TokenLoader(corpus, SEQ, 8, world=FakeWorld(clock, 0), micro_batch_size=2)
    with pytest.raises(ValueError, match=r"global_batch_size=8 is fewer samples than the 12 micro-batch slots of a "
                                         r"step \(3 replica group\(s\) x 2 rank\(s\) x 2 micro-batch\(es\)\).*at most "
                                         r"2 group\(s\)"):
        next(iter(loader))


def test_document_batches_carry_the_weight_and_it_survives_the_transfer(corpus):
    clock = Clock()
    clock.participants = 3
    loader = TokenLoader(corpus, SEQ, 20, world=FakeWorld(clock, 0), micro_batch_size=5, document_info=True)
    batch = next(iter(loader))
    assert isinstance(batch, DocumentBatch) and batch.inputs.shape == (1, SEQ)  # slot 0 of 12: 20 // 12 = 1 sample
    assert batch.loss_weight == pytest.approx(12 / 20)
    transfer = BatchTransfer()
    transfer.start(torch.device("meta"))  # moves every tensor (no data): what a GPU's transfer rebuilds
    plain = with_loss_weight((torch.zeros(2, 3), torch.ones(2, 3)), 0.5)
    for weighted in (batch, plain):
        moved = transfer(weighted)
        assert type(moved) is type(weighted) and moved.loss_weight == weighted.loss_weight
        assert all(t.device.type == "meta" for t in tree_flatten(moved)[0] if isinstance(t, torch.Tensor))
    leaves, spec = tree_flatten(plain)
    assert isinstance(tree_unflatten(leaves, spec), WeightedBatch)
    assert isinstance(with_loss_weight(batch, 2.0), WeightedDocumentBatch)


# ---------------------------------------------------------------------- the trainer's update
class LinearFit(DreamTrainer):
    def __init__(self, config: TrainerConfig, batches: list[Any]):
        super().__init__(config)
        self.batches = batches

    def configure_models(self) -> None:
        self.model = nn.Linear(4, 2)

    def init_weights(self) -> None:
        torch.manual_seed(0)
        self.model.reset_parameters()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)

    def configure_dataloaders(self) -> tuple[Any, None]:
        return self.batches, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


def _one_step(batches: list[Any], accumulation: int) -> dict[str, torch.Tensor]:
    config = TrainerConfig(run_name="fit", seed=0, device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=None, max_steps=1, num_sanity_val_steps=0,
                                                                  gradient_accumulation_steps=accumulation))
    trainer = LinearFit(config, batches)
    trainer.fit()
    assert trainer.global_step == 1
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_uneven_weighted_micro_batches_update_as_the_whole_batch_does():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g) * 3
    full = _one_step([(x, y)], 1)
    cuts, slots = [(0, 3), (3, 6), (6, 8)], 3
    weighted = _one_step([with_loss_weight((x[a:b], y[a:b]), (b - a) * slots / 8) for a, b in cuts], slots)
    unweighted = _one_step([(x[a:b], y[a:b]) for a, b in cuts], slots)
    for name, value in full.items():
        torch.testing.assert_close(weighted[name], value, rtol=1e-6, atol=1e-7)
    assert not all(torch.allclose(unweighted[k], v, rtol=1e-4, atol=1e-5) for k, v in full.items())
