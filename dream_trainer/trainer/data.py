"""`DataMixin`: the epoch's batches, their agreed count, and the data position a resume
continues from. A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there).

The data position of a rank (saved under ``ranks.rank<N>.data``):

- a stateful loader (torchdata's ``StatefulDataLoader``, anything with ``state_dict``),
  or a loader whose batch sampler is stateful (`FaultTolerantSampler`), saves and restores
  its own position;
- any other loader is re-created and fast-forwarded past the batches already consumed.
  Its order comes from the RNG states when its iterator is created — a shuffling
  sampler's ``generator`` (``DataLoader(shuffle=True, generator=g)``) or, without one, the
  global RNGs — so those states are recorded at the start of every epoch and restored
  before the iterator is re-created: a resume mid-epoch, or in any later epoch, sees the
  same order as an uninterrupted run. The generators' current states are saved too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.utils import rng_state, set_rng_state

logger = logging.getLogger(__name__)


def state_owner(loader: Any) -> Any:
    """What saves a dataloader's position itself: the loader (torchdata's
    ``StatefulDataLoader``), else its batch sampler (e.g. `FaultTolerantSampler`), else
    None (the trainer re-creates and fast-forwards it)."""
    for obj in (loader, getattr(loader, "batch_sampler", None)):
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            return obj
    return None


def is_stateful(loader: Any) -> bool:
    """Whether a dataloader (or its batch sampler) saves its own position."""
    return state_owner(loader) is not None


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader draws its order from: its own, its
    sampler's and its batch sampler's sampler's (each once)."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
    return list(found.values())


class DataMixin(AbstractTrainer):
    """Iterating the training data, and where a resume continues it."""

    train_steps_per_epoch: int | None
    _epoch_complete: bool
    _data_snapshot: Any
    _loader_restored: bool
    _resume_rng: dict[str, Any] | None
    _epoch_start_state: dict[str, Any] | None
    _resume_epoch_start: dict[str, Any] | None
    _train_loader_batches: int | None = None  # the smallest len(train loader) over ranks (setup)
    _train_length_agreed = False  # setup agreed on the training epoch length

    # ------------------------------------------------------------------ the plan
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
        training = self.training_parameters  # type: ignore[attr-defined]
        by_epochs = None
        batches = self._planned_epoch_batches()
        if training.n_epochs is not None and batches is not None:
            by_epochs = training.n_epochs * -(-batches // training.gradient_accumulation_steps)
        candidates = [n for n in (training.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    def _planned_epoch_batches(self) -> int | None:
        """Batches per training epoch for `total_steps` (None: unknown)."""
        known = [n for n in (self.train_steps_per_epoch, self._train_loader_batches) if n is not None]
        if known:
            return min(known)
        if not self._train_length_agreed:
            return None
        return self.training_parameters.train_steps_per_epoch_hint  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ iterating
    def _epoch_batches(self) -> Iterator[tuple[Any, bool]]:
        """``(batch, is_last)`` for the rest of the epoch. On a mid-epoch resume a stateful
        loader continues by itself; any other loader is re-created from the epoch's saved
        RNG states and fast-forwarded past the batches already consumed. Then the RNG state
        saved with the step is restored."""
        loader, start = self.train_dataloader, self.local_batches
        limit = self.train_steps_per_epoch
        if not is_stateful(loader):
            if self._resume_epoch_start is not None:
                self._set_epoch_start_state(self._resume_epoch_start)
                self._resume_epoch_start = None
            self._epoch_start_state = self._get_epoch_start_state()
        iterator = iter(loader)  # type: ignore[arg-type]
        if start and not self._loader_restored:
            skipped = sum(1 for _ in itertools.islice(iterator, start))
            logger.info("resuming epoch %d at batch %d: skipped %d batches", self.current_epoch, start, skipped)
        if self.world.announces_batches:  # e.g. a fault-tolerant world: its quorum before each step's data
            iterator = _announced(iterator, self._announce_batch)
        self._loader_restored, self._data_snapshot = False, None
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None
        remaining = None if limit is None else limit - start
        try:
            known = len(loader) - start  # type: ignore[arg-type]
        except TypeError:
            known = None
        if known is not None and (remaining is None or known >= remaining):
            count = known if remaining is None else remaining
            return ((batch, i + 1 == count) for i, batch in enumerate(itertools.islice(iterator, count)))
        snapshot = self._snapshot_data if is_stateful(loader) else None
        return _with_last(iterator, remaining, snapshot)

    def _announce_batch(self) -> None:
        accumulation = self.training_parameters.gradient_accumulation_steps  # type: ignore[attr-defined]
        self.world.before_batch(starts_step=self.local_batches % accumulation == 0)

    def _snapshot_data(self) -> None:
        # Looking one batch ahead moves a stateful loader past the current batch; keep its
        # position from before the lookahead for `state_dict`.
        self._data_snapshot = state_owner(self.train_dataloader).state_dict()

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
            self._train_loader_batches, self._train_length_agreed = min(known, default=None), True
        if configured is not None:
            if known and min(known) < configured:
                logger.warning("%s_steps_per_epoch=%d but a %s loader has only %d batches", what, configured, what, min(known))
            return configured
        if any(n is None for n in lengths):
            return None
        if len(set(lengths)) > 1:
            logger.warning("%s loaders differ in length across ranks %s; every rank uses %d", what, lengths, min(lengths))
        return min(lengths)  # type: ignore[type-var]

    # ------------------------------------------------------------------ position
    def _get_epoch_start_state(self) -> dict[str, Any]:
        return {"rng": rng_state(), "generators": [g.get_state() for g in loader_generators(self.train_dataloader)]}

    def _set_epoch_start_state(self, state: dict[str, Any]) -> None:
        set_rng_state(state["rng"])
        self._set_generator_states(state["generators"])

    def _set_generator_states(self, states: list[torch.Tensor]) -> None:
        generators = loader_generators(self.train_dataloader)
        if len(generators) != len(states):
            logger.warning(
                "the checkpoint has %d dataloader generator state(s), this loader has %d generator(s): "
                "the data order after the resume may differ from the saved run",
                len(states),
                len(generators),
            )
            return
        for generator, state in zip(generators, states):
            generator.set_state(state)

    def _data_position(self) -> dict[str, Any]:
        """This rank's data position (see the module docstring)."""
        loader = self.train_dataloader
        owner = state_owner(loader)
        if owner is not None:
            return {"loader": self._data_snapshot if self._data_snapshot is not None else owner.state_dict()}
        mid_epoch = self.local_batches > 0 and not self._epoch_complete
        return {
            "epoch_start": self._epoch_start_state if mid_epoch else None,
            "generators": [g.get_state() for g in loader_generators(loader)],
        }

    def _restore_data_position(self, position: dict[str, Any]) -> None:
        owner = state_owner(self.train_dataloader)
        if position.get("loader") is not None and owner is not None:
            owner.load_state_dict(position["loader"])
            self._loader_restored = True
        elif position.get("epoch_start") is not None and self.local_batches:
            self._resume_epoch_start = position["epoch_start"]  # applied when the epoch's iterator is made
        elif "generators" in position:
            self._set_generator_states(position["generators"])


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
