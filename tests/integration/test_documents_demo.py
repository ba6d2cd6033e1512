"""The GPT and Llama demos with ``--data.documents``: the corpus split into documents (one per
line), the batches `DocumentBatch`es (positions and document ids through the trainer's batch
path into the model), a loss that skips the boundaries, and a model that learns."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dream_trainer import Callback
from dream_trainer.data import TokenFile
from dream_trainer.data.documents import DocumentBatch
from tests.demos import SMALL, load


class Batches(Callback[Any]):
    """Keeps the first training batch the trainer hands to `training_step`."""

    def __init__(self) -> None:
        self.first: Any = None

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = batch


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_the_demo_trains_on_documents(tmp_path, example):
    seen = Batches()
    trainer = load(example).main([*SMALL, "--steps", "24", "--val-every", "12", "--val-batches", "2",
                                  "--data.documents", "--root-dir", str(tmp_path), "--run-name", "docs",
                                  "--resume", "None", "--checkpoint-every", "None"], callbacks=[seen])
    assert trainer.global_step == 24
    assert TokenFile(trainer.train_file).n_docs > 50  # a document per line
    batch = seen.first
    assert isinstance(batch, DocumentBatch) and batch.position_ids.shape == batch.inputs.shape
    assert bool((batch.targets == -100).any())  # windows that cross a boundary: no loss there
    starts = batch.position_ids == 0
    assert torch.equal(starts[:, 1:], batch.document_ids[:, 1:] != batch.document_ids[:, :-1])
    history = trainer.callbacks["ValidationHistory"].history
    assert history[-1][1] < 0.75 * history[0][1]  # learning
