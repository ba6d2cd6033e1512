"""The batches of a training epoch, as the loop sees them: ``(batch, is_last)``. Helpers of
`DataPosition.epoch_batches`, which opens and iterates the epoch (this module holds no
state and imports no trainer); the generators live apart from `DataPosition` so that a
step's fetch never re-enters the module a restore between two steps (a torchft heal, from
`before_batch`) calls into.

`set_epoch` and `train_mode` are what the loop calls at the start of every epoch;
`loader_length` is ``len(loader)`` or None.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Protocol


class BatchAnnouncer(Protocol):
    """What announcing batches needs of the world (a fault-tolerant world's quorum runs
    before each step's data is fetched)."""

    @property
    def announces_batches(self) -> bool: ...

    def before_batch(self, starts_step: bool) -> None: ...


class EpochCounters(Protocol):
    """The loop's counters (the trainer's): read when the epoch is opened, and
    ``local_batches`` before every announced fetch (a restore between two steps moves it)."""

    @property
    def local_batches(self) -> int: ...

    @property
    def current_epoch(self) -> int: ...


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler, batch sampler or the loader."""
    candidates: tuple[Any, ...] = (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None), loader)
    for obj in candidates:
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def train_mode(models: Iterable[Any]) -> None:
    """Put `models` (``nn.Module``) in training mode: ``model.train()`` where any of its
    modules is not (validation or a callback left it in eval mode); a model already training
    is only read (``train()`` sets the flag on every module: a walk of attribute writes)."""
    for model in models:
        if not all(module.training for module in model.modules()):
            model.train()


def loader_length(loader: object) -> int | None:
    """``len(loader)``, or None for a loader without a length (an iterable dataset's
    `DataLoader` raises `TypeError`)."""
    if not isinstance(loader, Sized):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def numbered(iterator: Iterator[Any], count: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, is_last)`` for the first `count` batches of `iterator` (its length is known).
    Built of C iterators (no Python frame per batch); the batches are pulled first, so none
    is fetched past the `count`-th."""
    last = itertools.chain(itertools.repeat(False, count - 1), (True,))
    return zip(itertools.islice(iterator, count), last)


def with_last(loader: Iterable[Any], limit: int | None,
              before_fetch: Callable[[], object] | None = None) -> Iterator[tuple[Any, bool]]:
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


def announced(iterator: Iterator[Any], world: BatchAnnouncer, counters: EpochCounters,
              accumulation: int) -> Iterator[Any]:
    """`iterator`, calling ``world.before_batch`` before each item is fetched (whether the
    batch starts an optimizer step: from the counters as they stand then)."""
    while True:
        world.before_batch(starts_step=counters.local_batches % accumulation == 0)
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item
