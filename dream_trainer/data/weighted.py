"""Micro-batches that carry a loss weight: what a loader yields when the micro-batches of a
step hold different numbers of samples (`dream_trainer.data.TokenLoader` under fault
tolerance, when the quorum's slots do not divide the global batch).

A micro-batch of ``n`` samples out of a global batch of ``G`` split over ``S`` micro-batch
slots (every rank's every micro-batch of the step) carries ``loss_weight = n * S / G``: the
trainer multiplies its mean loss by it in `AbstractTrainer.backward`, so that the mean over
the ``S`` micro-batches (1/accumulation, the data-parallel mean, the fault-tolerant mean over
participants) is the global batch's mean loss. The weight is read from the batch before it
moves to the device (one ``getattr`` per micro-batch), and it survives ``world.transfer``.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import register_pytree_node

from dream_trainer.data.documents import DocumentBatch

__all__ = ["WeightedBatch", "WeightedDocumentBatch", "with_loss_weight"]


class WeightedBatch(tuple):  # type: ignore[type-arg]
    """``(inputs, targets[, sample_ids])`` with a ``loss_weight`` (a float): a tuple, so
    ``inputs, targets = batch`` works as for an unweighted batch."""

    loss_weight: float

    def __new__(cls, items: Any, loss_weight: float) -> WeightedBatch:
        self = super().__new__(cls, items)
        self.loss_weight = float(loss_weight)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (WeightedBatch, (tuple(self), self.loss_weight))

    def __repr__(self) -> str:
        return f"WeightedBatch({tuple.__repr__(self)}, loss_weight={self.loss_weight!r})"


register_pytree_node(  # its tensors move with world.transfer, its weight stays
    WeightedBatch, lambda batch: (list(batch), batch.loss_weight), lambda values, weight: WeightedBatch(values, weight),
    serialized_type_name="dream_trainer.data.weighted.WeightedBatch")


class WeightedDocumentBatch(DocumentBatch):
    """A `DocumentBatch` with a ``loss_weight`` (a float): the same fields."""

    loss_weight: float


def with_loss_weight(batch: tuple[Any, ...] | DocumentBatch,
                     loss_weight: float) -> WeightedBatch | WeightedDocumentBatch:
    """`batch` carrying `loss_weight`: a `WeightedDocumentBatch` for a `DocumentBatch`, else a
    `WeightedBatch`."""
    if isinstance(batch, DocumentBatch):
        weighted = WeightedDocumentBatch(*batch)
        weighted.loss_weight = float(loss_weight)
        return weighted
    return WeightedBatch(batch, loss_weight)
