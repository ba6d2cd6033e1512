"""The trainer with ``global_batch_size`` and a `TokenLoader`: the accumulation derived
from the data-parallel size, the logged loss of a step averaged over its micro-batches, and
a checkpoint resumed with another accumulation (what another world size does) continuing
the same samples and the same loss curve."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DreamTrainer,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.data import TokenLoader, write_tokens

SEQ = 8


class TinyLM(DreamTrainer):
    def __init__(self, config: TrainerConfig, path: Any, loader_micro: int | None = None):
        super().__init__(config)
        self.path, self.loader_micro = path, loader_micro

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))

    def init_weights(self) -> None:
        torch.manual_seed(0)
        for module in self.model:
            module.reset_parameters()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[Any, None]:
        if self.loader_micro is not None:  # made by hand, with another split than the trainer's
            return TokenLoader(self.path, SEQ, 16, micro_batch_size=self.loader_micro, return_ids=True), None
        return TokenLoader.for_trainer(self, self.path, SEQ, return_ids=True), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, ids = batch
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss, "ids": ids}


class Record(Callback[DreamTrainer]):
    def __init__(self) -> None:
        self.micro: list[tuple[int, float, list[int]]] = []  # (step, loss, sample ids) per micro-batch
        self.logged: dict[int, float] = {}

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        step = self.trainer.global_step + (1 if self.trainer.is_accumulating_gradients else 0)
        self.micro.append((step, result["loss"].item(), result["ids"].tolist()))

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.logged[step] = metrics["train/loss"]


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    return write_tokens(tmp_path / "c.tokens", [rng.integers(0, 64, size=2000) % (1 + np.arange(2000) % 64)])


def _fit(root, corpus, micro, max_steps, *, every=None, loader_micro=None, record=None):
    record = record or Record()
    callbacks: list[Any] = [record]
    if every is not None:
        callbacks.append(CheckpointCallback(CheckpointParameters(root_dir=root, every_n_steps=every, async_mode="off")))
    config = TrainerConfig(run_name="lm", seed=0, device_parameters=DeviceParameters.SINGLE_DEVICE(), callbacks=callbacks,
                           training_parameters=TrainingParameters(n_epochs=None, max_steps=max_steps, global_batch_size=16,
                                                                  micro_batch_size=micro, num_sanity_val_steps=0))
    config.logging_parameters.log_every_n_steps = 1
    trainer = TinyLM(config, corpus, loader_micro)
    trainer.fit()
    return trainer, record


def test_the_accumulation_is_derived_and_the_logged_loss_averages_the_step(tmp_path, corpus):
    trainer, record = _fit(tmp_path, corpus, 4, 5)
    assert trainer.gradient_accumulation_steps == 4 and trainer.global_step == 5
    for step in range(1, 6):
        losses = [loss for s, loss, _ in record.micro if s == step]
        assert len(losses) == 4
        assert record.logged[step] == pytest.approx(sum(losses) / 4, rel=1e-6)


def test_a_checkpoint_resumes_with_another_accumulation_on_the_same_samples(tmp_path, corpus):
    _, full = _fit(tmp_path / "full", corpus, 4, 20)
    _, first = _fit(tmp_path / "cut", corpus, 8, 6, every=6)  # 2 micro-batches per step
    trainer, second = _fit(tmp_path / "cut", corpus, 4, 20, every=6)  # resumed: 4 per step
    assert trainer.callbacks["CheckpointCallback"].resumed_from.name == "step_000000006"
    steps = lambda rec: {s: sorted(i for t, _, ids in rec.micro if t == s for i in ids) for s in range(1, 21)}  # noqa: E731
    cut = {**{s: v for s, v in steps(first).items() if v}, **{s: v for s, v in steps(second).items() if v}}
    assert cut == steps(full)  # every step trained on the same 16 samples, none twice, none skipped
    resumed = {s: v for s, v in second.logged.items() if s > 6}
    assert sorted(resumed) == list(range(7, 21))  # across an epoch boundary (15 steps each)
    # The same global batches; the means over 2 and 4 micro-batches differ only in summation order.
    assert resumed == pytest.approx({s: full.logged[s] for s in resumed}, rel=1e-5)


def test_a_loader_split_otherwise_than_the_trainer_accumulates_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"splits each global batch into 4 micro-batch\(es\) per rank, the trainer "
                                         "accumulates 2: make it with TokenLoader.for_trainer"):
        _fit(tmp_path, corpus, 8, 3, loader_micro=4)
