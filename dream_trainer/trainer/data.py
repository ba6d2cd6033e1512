"""`DataMixin`: the epoch's batches and their agreed count, a mixin of `BaseTrainer`. Where a
rank stands in its data is `DataPosition` (`dream_trainer.trainer.data_position`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from dream_trainer.data.tokens import split_global_batch
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.data_position import DataPosition, is_stateful

logger = logging.getLogger(__name__)


class DataMixin(AbstractTrainer):
    """Iterating the training data; the position itself is `DataPosition`."""

    data_position: DataPosition

    @property
    def train_steps_per_epoch(self) -> int | None:
        """The training epoch length every rank agreed on in `setup` (None: until the loader
        is exhausted)."""
        return self.data_position.train_steps_per_epoch

    @train_steps_per_epoch.setter
    def train_steps_per_epoch(self, value: int | None) -> None:
        self.data_position.train_steps_per_epoch = value

    @property
    def val_steps_per_epoch(self) -> int | None:
        """The validation epoch length every rank agreed on in `setup`."""
        return self.data_position.val_steps_per_epoch

    @val_steps_per_epoch.setter
    def val_steps_per_epoch(self, value: int | None) -> None:
        self.data_position.val_steps_per_epoch = value

    @property
    def last_epoch_batches(self) -> int | None:
        """Batches the last finished training epoch had."""
        return self.data_position.last_epoch_batches

    # ------------------------------------------------------------------ the plan
    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: derived from ``global_batch_size`` for this
        world (once it is up), else ``TrainingParameters.gradient_accumulation_steps``."""
        derived = self.data_position.accumulation_steps
        return self.config.training_parameters.gradient_accumulation_steps if derived is None else derived

    def _plan_batches(self) -> None:
        """With ``global_batch_size``: the micro-batch and the accumulation for this world's
        data-parallel size (refused, naming the sizes that work, before anything is built)."""
        training = self.config.training_parameters
        if training.global_batch_size is None:
            return
        micro, accumulation = split_global_batch(training.global_batch_size, self.world.dp_size, training.micro_batch_size)
        self.data_position.accumulation_steps = accumulation
        logger.info("global batch %d = %d data-parallel rank(s) x micro-batch %d x %d accumulation step(s)",
                    training.global_batch_size, self.world.dp_size, micro, accumulation)

    def _check_loader_batches(self) -> None:
        """A loader that splits global batches itself (`TokenLoader`) must split them as the
        trainer accumulates."""
        loader, accumulation = self.train_dataloader, self.gradient_accumulation_steps
        theirs = getattr(loader, "accumulation_steps", None)
        if getattr(loader, "global_position", False) is True and theirs is not None and theirs != accumulation:
            raise ValueError(
                f"the training loader ({type(loader).__name__}) splits each global batch into {theirs} micro-batch(es) "
                f"per rank, the trainer accumulates {accumulation}: make it with TokenLoader.for_trainer(self, ...) "
                "(or set TrainingParameters.global_batch_size/micro_batch_size to the loader's)")

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps the whole fit is planned to take, counted from step 0 (also
        after a resume): ``max_steps``, or ``n_epochs`` x the optimizer steps per epoch, the
        smaller when both are set. Optimizer steps per epoch = ceil(batches per epoch /
        ``gradient_accumulation_steps``): an epoch's last, partial accumulation group steps
        too. Batches per epoch: the epoch length the ranks agreed on in `setup`
        (``train_steps_per_epoch``, or the smallest loader length over ranks; the smaller of
        the two when both are known), else — a loader without a length —
        ``TrainingParameters.train_steps_per_epoch_hint``, an estimate.

        None when it is unknown: the run is bounded by epochs of a loader without a length
        and no hint was given (or `setup` has not run: only ``max_steps`` is known before).
        A plan: steps that are skipped (vetoes, skipped batches) do not shorten it. The same
        on every rank (it is computed from the configuration and the agreed epoch length),
        known from ``post_setup`` on, and cheap (no communication): read it anywhere."""
        training = self.config.training_parameters
        by_epochs = None
        batches = self.data_position.planned_epoch_batches(training.train_steps_per_epoch_hint)
        if training.n_epochs is not None and batches is not None:
            by_epochs = training.n_epochs * -(-batches // self.gradient_accumulation_steps)
        candidates = [n for n in (training.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    # ------------------------------------------------------------------ iterating
    def _epoch_batches(self) -> Iterator[tuple[Any, bool]]:
        """``(batch, is_last)`` for the rest of the epoch. On a mid-epoch resume a stateful
        loader continues by itself; any other loader is re-created from the epoch's saved
        RNG states and fast-forwarded past the batches already consumed. Then the RNG state
        saved with the step is restored."""
        loader, start, position = self.train_dataloader, self.local_batches, self.data_position
        position.open_epoch(loader)
        iterator = iter(loader)  # type: ignore[arg-type]
        if not position.take_restored() and start:
            skipped = sum(1 for _ in itertools.islice(iterator, start))
            logger.info("resuming epoch %d at batch %d: skipped %d batches", self.current_epoch, start, skipped)
        if self.world.announces_batches:  # e.g. a fault-tolerant world: its quorum before each step's data
            iterator = _announced(iterator, self._announce_batch)
        position.apply_resume_rng()  # the fast-forward drew what the saved run had drawn: now its RNG
        limit = position.train_steps_per_epoch
        remaining = None if limit is None else limit - start
        try:
            known = len(loader) - start  # type: ignore[arg-type]
        except TypeError:
            known = None
        if known is not None and (remaining is None or known >= remaining):
            count = known if remaining is None else remaining
            return ((batch, i + 1 == count) for i, batch in enumerate(itertools.islice(iterator, count)))
        snapshot = (lambda: position.snapshot(loader)) if is_stateful(loader) else None
        return _with_last(iterator, remaining, snapshot)

    def _announce_batch(self) -> None:
        self.world.before_batch(starts_step=self.local_batches % self.gradient_accumulation_steps == 0)

    def _agreed_length(self, loader: Iterable[Any], configured: int | None, what: str) -> int | None:
        """The epoch length every rank uses: the configured one, else the smallest
        ``len(loader)`` over ranks, else None (iterate until the loader is exhausted)."""
        try:
            length: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        lengths = self.world.all_gather_object(length)
        known = [n for n in lengths if n is not None]
        if what == "train":  # for `total_steps`
            self.data_position.train_loader_batches, self.data_position.length_agreed = min(known, default=None), True
        if configured is not None:
            if known and min(known) < configured:
                logger.warning("%s_steps_per_epoch=%d but a %s loader has only %d batches", what, configured, what, min(known))
            return configured
        if any(n is None for n in lengths):
            return None
        if len(set(lengths)) > 1:
            logger.warning("%s loaders differ in length across ranks %s; every rank uses %d", what, lengths, min(lengths))
        return min(lengths)  # type: ignore[type-var]

    @property
    def _mid_epoch(self) -> bool:
        """Batches of an unfinished epoch were consumed."""
        return self.local_batches > 0 and not self.data_position.epoch_complete


def _with_last(loader: Iterable[Any], limit: int | None, before_fetch: Any = None) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, is_last)`` for at most `limit` batches. Looks one batch ahead, so
    the final micro-batch of an epoch steps the optimizer even when the loader is shorter
    than expected or has no length. `before_fetch` (if given) runs before each lookahead."""
    iterator = iter(itertools.islice(loader, limit))
    try:
        current = next(iterator)
    except StopIteration:
        return
    while True:
        if before_fetch is not None:
            before_fetch()
        try:
            upcoming = next(iterator)
        except StopIteration:
            break
        yield current, False
        current = upcoming
    yield current, True


def _announced(iterator: Iterator[Any], before: Any) -> Iterator[Any]:
    """`iterator`, calling `before()` before each item is fetched."""
    while True:
        before()
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler, batch sampler or the loader."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None), loader):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return
