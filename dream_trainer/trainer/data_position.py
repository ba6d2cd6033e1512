"""`DataPosition`: where a rank stands in its training data, the component the trainer owns
as ``trainer.data_position``.

The data position of a rank (saved under ``ranks.rank<N>.data``):

- a loader whose position is the run's (``global_position = True``, e.g. `TokenLoader`:
  one cursor, the same on every rank) is saved once per run instead, under
  ``trainer.data``, and loads into any number of ranks;
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

import functools
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dream_trainer.data.tokens import split_global_batch
from dream_trainer.trainer.epochs import BatchAnnouncer, EpochCounters, announced, loader_length, numbered, with_last
from dream_trainer.utils import rng_state, set_rng_state

if TYPE_CHECKING:
    from dream_trainer.configs import TrainingParameters

logger = logging.getLogger(__name__)


def state_owner(loader: Any) -> Any:
    """What saves a dataloader's position itself: the loader (torchdata's
    ``StatefulDataLoader``), else its batch sampler (e.g. `FaultTolerantSampler`), else
    None (the trainer re-creates and fast-forwards it)."""
    for obj in (loader, getattr(loader, "batch_sampler", None)):
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            return obj
    return None


def is_global(owner: Any) -> bool:
    """Whether a position owner (see `state_owner`) holds the run's position, the same on
    every rank (``global_position = True``)."""
    return owner is not None and getattr(owner, "global_position", False) is True


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


class LengthAgreement(Protocol):
    """What agreeing on the epoch lengths needs of the world."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class DataPosition:
    """Where this rank stands in its training data, what a resume must apply, and the
    epoch it opens and iterates (`epoch_batches`): owned by the trainer as
    ``trainer.data_position``. Needs no trainer: the loader, the world, the training
    parameters and the loop's counters are passed in.

    Attributes:
        train_steps_per_epoch: the training epoch length every rank agreed on in `setup`
            (None: until the loader is exhausted).
        val_steps_per_epoch: the same for validation.
        train_loader_batches: the smallest ``len(train loader)`` over ranks (None: unknown).
        length_agreed: `setup` agreed on the training epoch length.
        last_epoch_batches: batches the last finished training epoch had.
        epoch_complete: the current epoch ran to its end (a resume starts the next one).
        iterating: an epoch's batches are being iterated: a restore now happens between two
            steps of the running loop (a torchft heal).
        accumulation_steps: micro-batches per optimizer step derived from
            ``TrainingParameters.global_batch_size`` for this world (None: not derived).
    """

    def __init__(self) -> None:
        self.train_steps_per_epoch: int | None = None
        self.val_steps_per_epoch: int | None = None
        self.train_loader_batches: int | None = None
        self.length_agreed = False
        self.last_epoch_batches: int | None = None
        self.epoch_complete = False
        self._epoch_start: dict[str, Any] | None = None  # RNG and loader generators when the epoch's iterator was made
        self._resume_epoch_start: dict[str, Any] | None = None  # a resume's, applied at the next iterator
        self._resume_rng: dict[str, Any] | None = None  # the RNG of the saved step, set after the fast-forward
        self._snapshot: Any = None  # a stateful loader's position before its one-batch lookahead
        self.loader_restored = False  # a stateful loader restored its own position (no fast-forward)
        self.iterating = False  # an epoch's batches are being iterated (a restore now is between two steps)
        self.accumulation_steps: int | None = None

    def planned_epoch_batches(self, hint: int | None) -> int | None:
        """Batches per training epoch for a plan: the agreed length, else the loader's,
        else (once the length was agreed and is unknown) `hint`."""
        known = [n for n in (self.train_steps_per_epoch, self.train_loader_batches) if n is not None]
        if known:
            return min(known)
        return hint if self.length_agreed else None

    # ------------------------------------------------------------------ the plan
    def plan_batches(self, training: TrainingParameters, dp_size: int) -> None:
        """With ``global_batch_size``: the micro-batch and the accumulation
        (`accumulation_steps`) for `dp_size` data-parallel ranks, refused (naming the sizes
        that work) before anything is built."""
        if training.global_batch_size is None:
            return
        micro, self.accumulation_steps = split_global_batch(training.global_batch_size, dp_size,
                                                            training.micro_batch_size)
        logger.info("global batch %d = %d data-parallel rank(s) x micro-batch %d x %d accumulation step(s)",
                    training.global_batch_size, dp_size, micro, self.accumulation_steps)

    def agree_lengths(self, world: LengthAgreement, train: Iterable[Any], val: Iterable[Any] | None,
                      training: TrainingParameters, accumulation: int) -> None:
        """The epoch lengths every rank uses (`train_steps_per_epoch`, `val_steps_per_epoch`):
        the configured one, else the smallest ``len(loader)`` over ranks, else None (iterate
        until the loader is exhausted); one gather per loader, on every rank. Refuses an
        empty training loader, and a loader that splits global batches itself (`TokenLoader`)
        into another number of micro-batches than `accumulation`."""
        self.train_steps_per_epoch, self.train_loader_batches = _agreed_length(
            world, train, training.train_steps_per_epoch, "train")
        self.length_agreed = True  # for `total_steps`
        if self.train_steps_per_epoch == 0:
            raise ValueError(
                f"the training dataloader is empty (len 0 on at least one rank; dp_rank={world.dp_rank}, "
                f"dp_size={world.dp_size}): give every data-parallel rank at least one batch"
            )
        _check_loader_batches(train, accumulation)
        if val is not None:
            self.val_steps_per_epoch = _agreed_length(world, val, training.val_steps_per_epoch, "val")[0]

    def total_steps(self, training: TrainingParameters, accumulation: int) -> int | None:
        """The optimizer steps the fit is planned to take (``trainer.total_steps``):
        ``max_steps``, or ``n_epochs`` x ceil(`planned_epoch_batches` / `accumulation`), the
        smaller when both are known; None when neither is."""
        by_epochs = None
        batches = self.planned_epoch_batches(training.train_steps_per_epoch_hint)
        if training.n_epochs is not None and batches is not None:
            by_epochs = training.n_epochs * -(-batches // accumulation)
        candidates = [n for n in (training.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    def mid_epoch(self, local_batches: int) -> bool:
        """Whether batches of an unfinished epoch were consumed (`local_batches`: the
        trainer's count in the current epoch)."""
        return local_batches > 0 and not self.epoch_complete

    # ------------------------------------------------------------------ iterating
    def epoch_batches(self, loader: Iterable[Any] | None, counters: EpochCounters, world: BatchAnnouncer,
                      accumulation: int) -> Iterator[tuple[Any, bool]]:
        """``(batch, is_last)`` for the rest of the epoch (`train_steps_per_epoch` at most),
        from ``counters.local_batches`` on. On a mid-epoch resume a stateful loader continues
        by itself; any other loader is re-created from the epoch's saved RNG states and
        fast-forwarded past the batches already consumed. Then the RNG state saved with the
        step is restored. A world that ``announces_batches`` hears of each fetch first.
        `loader` None (the trainer's ``train_dataloader`` was cleared): `ValueError`."""
        if loader is None:
            raise ValueError("there is no training dataloader to iterate: set train_dataloader in configure()")
        start = counters.local_batches
        self.open_epoch(loader)
        iterator = iter(loader)
        if not self.take_restored() and start:
            skipped = sum(1 for _ in itertools.islice(iterator, start))
            logger.info("resuming epoch %d at batch %d: skipped %d batches", counters.current_epoch, start, skipped)
        if world.announces_batches:  # e.g. a fault-tolerant world: its quorum before each step's data
            iterator = announced(iterator, world, counters, accumulation)
        self.apply_resume_rng()  # the fast-forward drew what the saved run had drawn: now its RNG
        limit = self.train_steps_per_epoch
        remaining = None if limit is None else limit - start
        length = loader_length(loader)
        known = None if length is None else length - start
        if known is not None and (remaining is None or known >= remaining):
            return numbered(iterator, known if remaining is None else remaining)
        snapshot = functools.partial(self.snapshot, loader) if is_stateful(loader) else None
        return with_last(iterator, remaining, snapshot)

    def open_epoch(self, loader: Any) -> None:
        """Before the epoch's iterator is made: a resume's saved epoch start is applied
        (RNG and generators), then this epoch's start is recorded (loaders that do not save
        their own position are re-created from it on a resume)."""
        if is_stateful(loader):
            return
        if self._resume_epoch_start is not None:
            _set_epoch_start(loader, self._resume_epoch_start)
            self._resume_epoch_start = None
        self._epoch_start = {"rng": rng_state(), "generators": [g.get_state() for g in loader_generators(loader)]}

    def take_restored(self) -> bool:
        """After the epoch's iterator is made: whether the loader restored its own position
        (then nothing is fast-forwarded); cleared, with the lookahead snapshot."""
        restored, self.loader_restored, self._snapshot = self.loader_restored, False, None
        return restored

    def apply_resume_rng(self) -> None:
        """After a mid-epoch resume fast-forwarded the epoch's iterator: the RNG of the saved
        step is set (once)."""
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None

    def snapshot(self, loader: Any) -> None:
        """Keep a stateful loader's position before it looks one batch ahead."""
        self._snapshot = state_owner(loader).state_dict()

    def rank_state(self, loader: Any, mid_epoch: bool) -> dict[str, Any]:
        """This rank's position in `loader` (see the module docstring); `mid_epoch`: batches
        of an unfinished epoch were consumed. The torch ``Stateful`` that saves it, with the
        trainer's loader and counters, is `dream_trainer.trainer.state.DataPositionState`."""
        owner = state_owner(loader)
        if is_global(owner):
            return {"run": True}  # saved once for the run: `run_state`
        if owner is not None:
            return {"loader": self._snapshot if self._snapshot is not None else owner.state_dict()}
        return {"epoch_start": self._epoch_start if mid_epoch else None,
                "generators": [g.get_state() for g in loader_generators(loader)]}

    def load_rank_state(self, position: dict[str, Any], loader: Any, mid_epoch: bool,
                        rng: dict[str, Any] | None = None) -> None:
        """Restore a position `rank_state` returned. A loader that saves its own position
        restores it now; another one is re-created from the saved epoch start at the next
        `open_epoch` (`mid_epoch`: the counters say batches of the epoch were consumed) or
        gets its generators' states now. `rng`: the saved step's RNG, set now unless the
        epoch's iterator is made again mid-epoch (then after it, see `apply_resume_rng`)."""
        owner = state_owner(loader)
        if position.get("run") and not is_global(owner):
            logger.warning("the checkpoint's data position is a run position (a TokenLoader's), this run's training "
                           "loader is a %s: it starts from its beginning", type(loader).__name__)
        if position.get("loader") is not None and owner is not None and not is_global(owner):
            owner.load_state_dict(position["loader"])
            self.loader_restored = True
        elif position.get("epoch_start") is not None and mid_epoch:
            self._resume_epoch_start = position["epoch_start"]  # applied when the epoch's iterator is made
        elif "generators" in position:
            _set_generator_states(loader, position["generators"])
        if rng is None:
            return
        if mid_epoch:
            self._resume_rng = rng  # the iterator made again may draw from the RNG: set after it
        else:
            set_rng_state(rng)

    def run_state(self, loader: Any) -> dict[str, Any] | None:
        """The position of a loader whose position is the run's (see `is_global`), saved
        once per run; None for any other loader."""
        owner = state_owner(loader)
        return owner.state_dict() if is_global(owner) else None

    def load_run_state(self, state: dict[str, Any] | None, loader: Any) -> None:
        """Restore a `run_state` (it seeks: nothing is fast-forwarded). None (a checkpoint
        without one) for a loader that has one: warned, the loader is fast-forwarded."""
        owner = state_owner(loader)
        if not is_global(owner):
            return
        if state is None:
            logger.warning("the checkpoint holds no run data position (written with another loader or an older "
                           "dream_trainer): the %s is fast-forwarded by the batches consumed", type(loader).__name__)
            return
        owner.load_state_dict(state)
        self.loader_restored = True


def _set_epoch_start(loader: Any, state: dict[str, Any]) -> None:
    set_rng_state(state["rng"])
    _set_generator_states(loader, state["generators"])


def _set_generator_states(loader: Any, states: list[torch.Tensor]) -> None:
    generators = loader_generators(loader)
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


def _agreed_length(world: LengthAgreement, loader: Iterable[Any], configured: int | None,
                   what: str) -> tuple[int | None, int | None]:
    """``(the epoch length every rank uses, the smallest known loader length)``: the
    configured length, else the smallest ``len(loader)`` over ranks, else None."""
    lengths: list[int | None] = world.all_gather_object(loader_length(loader))
    known = [n for n in lengths if n is not None]
    smallest = min(known, default=None)
    if configured is not None:
        if smallest is not None and smallest < configured:
            logger.warning("%s_steps_per_epoch=%d but a %s loader has only %d batches", what, configured, what, smallest)
        return configured, smallest
    if len(known) < len(lengths):
        return None, smallest
    if len(set(known)) > 1:
        logger.warning("%s loaders differ in length across ranks %s; every rank uses %d", what, lengths, smallest)
    return smallest, smallest


def _check_loader_batches(loader: Iterable[Any], accumulation: int) -> None:
    """A loader that splits global batches itself (`TokenLoader`) must split them as the
    trainer accumulates."""
    theirs = getattr(loader, "accumulation_steps", None)
    if getattr(loader, "global_position", False) is True and theirs is not None and theirs != accumulation:
        raise ValueError(
            f"the training loader ({type(loader).__name__}) splits each global batch into {theirs} micro-batch(es) "
            f"per rank, the trainer accumulates {accumulation}: make it with TokenLoader.for_trainer(self, ...) "
            "(or set TrainingParameters.global_batch_size/micro_batch_size to the loader's)")
