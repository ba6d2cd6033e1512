"""`ProgressBarCallback`: a tqdm bar per epoch with step, loss, lr and it/s (rank zero)."""

from __future__ import annotations

import sys
from typing import IO, Any, Protocol, runtime_checkable

from dream_trainer.protocol.base import RankZeroCallback
from dream_trainer.protocol.trainers import Counters, Displays


@runtime_checkable
class ProgressTrainer(Counters, Displays, Protocol):
    """What `ProgressBarCallback` needs of a trainer (any trainer with these pieces)."""


class ProgressBarCallback(RankZeroCallback[ProgressTrainer]):
    """A tqdm progress bar over each training epoch.

    Shows the optimizer step, the last logged loss and learning rate, tqdm's rate, and the
    short fields monitors publish in ``trainer.display_fields`` (e.g. memory use).
    When the epoch length is unknown (an iterable loader without ``__len__``) the total is
    estimated, and marked with ``~``: from the previous epoch, else (the first epoch) from
    ``TrainingParameters.train_steps_per_epoch_hint``.

    Args:
        enabled: True to always show, False never; None (default) shows it only when
            `file` is a terminal, so logs of batch jobs stay clean.
        file: where to draw (default: ``sys.stderr``).
    """

    critical = False

    def __init__(self, enabled: bool | None = None, file: IO[str] | None = None):
        self.enabled = enabled
        self.file = file
        self._bar: Any = None
        self._postfix: dict[str, str] = {}

    @property
    def active(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        stream = self.file or sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)())

    def estimated_total(self) -> tuple[int | None, bool]:
        """(batches in this epoch, whether that number is an estimate): the agreed epoch
        length; else the previous epoch's batches; else the configured
        ``train_steps_per_epoch_hint`` (the estimate `trainer.total_steps` plans with)."""
        trainer: Any = self.trainer
        known = getattr(trainer, "train_steps_per_epoch", None)
        if known is not None:
            return known, False
        previous = getattr(trainer, "last_epoch_batches", None)
        if previous is not None:
            return previous, True
        training = getattr(trainer, "training_parameters", None)
        return getattr(training, "train_steps_per_epoch_hint", None), True

    def pre_train_epoch(self) -> None:
        from tqdm.auto import tqdm

        self._close()
        total, estimated = self.estimated_total()
        desc = f"epoch {self.trainer.current_epoch}" + (" (~total)" if estimated and total else "")
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="batch",
            file=self.file or sys.stderr,
            disable=not self.active,
            dynamic_ncols=True,
            leave=True,
        )

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if self._bar is None:
            return
        self._postfix["step"] = str(step)
        for key, short in (("train/loss", "loss"), ("train/lr", "lr"), ("val/loss", "val_loss")):
            if key in metrics:
                self._postfix[short] = f"{metrics[key]:.4g}"
        self._postfix.update(getattr(self.trainer, "display_fields", {}))  # e.g. a memory monitor's "mem"
        self._bar.set_postfix(self._postfix, refresh=False)

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_teardown(self, status: str) -> None:
        self._close()

