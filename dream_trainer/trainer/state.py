"""`TrainerState`: the trainer's state as a registry of torch ``Stateful`` parts, held by
the trainer as ``trainer.state``.

Each part is a ``torch.distributed.checkpoint.stateful.Stateful`` (``state_dict()`` with
no arguments, ``load_state_dict(state)``); `TrainerState.state_dict` composes their states
under one key each, the layout every checkpoint of this format holds:

- ``trainer`` (`Progress`): the counters (global step, epoch, batches consumed in the epoch
  and the accumulation they count in, whether the epoch had finished, the step of the last
  validation, skipped steps and batches), the run's data position when the loader keeps
  one (`TokenLoader`: the same on every rank, so it loads into any world size) and the
  names of the saved callbacks;
- ``models`` (`ModelsState`) / ``optimizers`` (`OptimizersState`): DCP's state-dict
  helpers, so FSDP2/TP shards are DTensors and load into any layout; optimizer state
  flattened, keyed per parameter name;
- ``schedulers`` (`SchedulersState`) and ``callbacks`` (`CallbacksState`): each one's
  ``state_dict()`` by name (``callbacks`` holds one copy for all ranks, the fallback of a
  rank the checkpoint has no entry for);
- ``ranks`` (`RankState`): ``rank<N>``, this rank's RNG states, data position
  (`DataPositionState`) and own callback states (a callback's state may differ per rank; a
  state holding DTensors is restored from the shared copy), under a per-rank key so every
  rank writes and reads its own;
- ``goodput`` (the trainer's `GoodputLedger`): where the wall time went so far, so a
  resumed run continues it (optional: a checkpoint without it resumes; rank 0's copy).

Checkpoints (`CheckpointCallback`) and fault-tolerant heals (`FaultToleranceCallback`)
both use ``trainer.state_dict()`` / ``trainer.load_state_dict()``: this registry, as is.
Everything stored as bytes goes through `dream_trainer.serialization` (checked at the
save, restricted at the load: nothing read back runs code).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from dream_trainer.protocol.collection import warn_absent_callbacks
from dream_trainer.serialization import check_storable, dumps, loads
from dream_trainer.trainer.abstract import reshard
from dream_trainer.utils import rng_state, set_rng_state

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

    from dream_trainer.protocol.collection import CallbackCollection
    from dream_trainer.trainer.data_position import DataPosition
    from dream_trainer.trainer.goodput import GoodputLedger
    from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)

__all__ = [
    "CallbacksState",
    "DataPositionState",
    "ModelsState",
    "OptimizersState",
    "Progress",
    "RankState",
    "SchedulersState",
    "StateOwner",
    "TrainerState",
]


class StateOwner(Protocol):
    """What the trainer's state reads and restores of the trainer (`BaseTrainer` is one):
    its counters, the models, optimizers and schedulers assigned to it, its callbacks,
    world, training loader, data position and step path (skipped steps and batches)."""

    global_step: int
    current_epoch: int
    local_batches: int
    resumed: bool
    _last_val_step: int | None

    @property
    def world(self) -> DistributedWorld: ...

    @property
    def callbacks(self) -> CallbackCollection: ...

    @property
    def train_dataloader(self) -> Iterable[Any] | None: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def data_position(self) -> DataPosition: ...

    @property
    def step_path(self) -> Stateful: ...

    @property
    def goodput(self) -> GoodputLedger: ...

    def named_models(self) -> dict[str, nn.Module]: ...

    def named_optimizers(self) -> dict[str, Optimizer]: ...

    def named_schedulers(self) -> dict[str, LRScheduler]: ...

    def model_for(self, optimizer: Optimizer) -> nn.Module | None: ...


class ModelsState:
    """``models``: each model's state by name, from DCP's state-dict helpers (FSDP2/TP
    shards are DTensors; float8 wrappers are stored as the plain tensors they wrap)."""

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        models = self._owner.named_models()
        reshard(models.values())
        return _plain({name: get_model_state_dict(model) for name, model in models.items()})

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        models = self._owner.named_models()
        reshard(models.values())
        for name, model in models.items():
            set_model_state_dict(model, state_dict[name], options=StateDictOptions(strict=strict))


class OptimizersState:
    """``optimizers``: each optimizer's state by name in DCP's flattened form (keyed per
    parameter name, param-group settings included: what pipeline stages, each holding some
    parameters, save side by side, and what resumes on another layout); an optimizer no
    model owns in its own form (``optimizer.state_dict()``). A checkpoint holding DCP's
    grouped form (``param_groups.0.params``: dream_trainer before optimizer state was keyed
    per parameter name) is refused on load (`dream_trainer.checkpoint.load_checkpoint`)
    and converted once with ``python -m dream_trainer.migrate``."""

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        owner, options = self._owner, StateDictOptions(flatten_optimizer_state_dict=True)
        reshard(owner.named_models().values())  # state by parameter name needs the sharded parameters
        states = {}
        for name, optimizer in owner.named_optimizers().items():
            model = owner.model_for(optimizer)
            states[name] = (optimizer.state_dict() if model is None
                            else get_optimizer_state_dict(model, optimizer, options=options))
        check_storable(states, "optimizer state")  # what a restricted load would refuse fails at the save
        return _plain(states)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        owner = self._owner
        options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)
        reshard(owner.named_models().values())
        for name, optimizer in owner.named_optimizers().items():
            model, saved = owner.model_for(optimizer), state_dict[name]
            if model is not None and not _is_native(saved):
                set_optimizer_state_dict(model, optimizer, saved, options=options)
            else:
                optimizer.load_state_dict(saved)


class SchedulersState:
    """``schedulers``: each learning-rate scheduler's ``state_dict()`` by name."""

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        states = {name: scheduler.state_dict() for name, scheduler in self._owner.named_schedulers().items()}
        check_storable(states, "scheduler state")
        return states

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, scheduler in self._owner.named_schedulers().items():
            scheduler.load_state_dict(state_dict[name])


class CallbacksState:
    """``callbacks``: each callback's state by name (``CallbackCollection.state_dict``),
    one copy for every rank. Within `taken_once`, `state_dict` returns the state taken at
    its start, so the parts that read it too (the saved names in `Progress`, this rank's
    own copy in `RankState`) see the same one and every callback is asked once."""

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner
        self._taken: dict[str, Any] | None = None

    @contextmanager
    def taken_once(self) -> Iterator[None]:
        """Ask the callbacks for their state once, for everything composed inside."""
        self._taken = self._take()
        try:
            yield
        finally:
            self._taken = None

    def state_dict(self) -> dict[str, Any]:
        return self._taken if self._taken is not None else self._take()

    def _take(self) -> dict[str, Any]:
        states = self._owner.callbacks.state_dict()
        check_storable(states, "callback state")
        return states

    def load_state_dict(self, state_dict: dict[str, Any], own: dict[str, Any] | None = None,
                        saved: list[str] | None = None) -> None:
        """Restore the shared copy `state_dict`, this rank's `own` states in place of
        theirs, each callback once. `saved`: the names the checkpoint saved (default: those
        in the states); the ones absent from this run are warned about here, once (their
        shared copy is not in the resuming template, so DCP never loads it)."""
        callbacks = self._owner.callbacks
        states = {**state_dict, **(own or {})}
        absent = [name for name in (list(states) if saved is None else saved) if name not in callbacks]
        if absent:
            warn_absent_callbacks(absent, callbacks.names())
        callbacks.load_state_dict({name: value for name, value in states.items() if name in callbacks})


class DataPositionState:
    """This rank's data position (``ranks.rank<N>.data``, see `DataPosition`) as a torch
    ``Stateful``: the trainer's `DataPosition` with its training loader and counters. Also
    the run's position (``trainer.data``: `run_state` / `load_run_state`), for a loader
    whose position is the same on every rank.

    Attributes:
        run_position_restored: the last `load_run_state` got a run position (the
            checkpoint held one).
    """

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner
        self.run_position_restored = False

    def state_dict(self) -> dict[str, Any]:
        owner = self._owner
        position = owner.data_position
        mid_epoch = owner.local_batches > 0 and not position.epoch_complete
        return position.rank_state(owner.train_dataloader, mid_epoch)

    def load_state_dict(self, state_dict: dict[str, Any], rng: dict[str, Any] | None = None) -> None:
        """Restore the position, after the counters (mid-epoch: they say batches of the
        epoch were consumed). `rng`: the saved step's RNG states. Before the loop (a
        resume) a mid-epoch position is applied when the epoch's iterator is made again,
        which may draw from the RNG: the RNG is set after it. While an epoch is being
        iterated (a torchft heal, between two steps, before a step's data is fetched) the
        RNG is set now and only a loader that restores its own position moves; the loop
        goes on from the restored counters."""
        owner = self._owner
        position, loader, mid_epoch = owner.data_position, owner.train_dataloader, owner.local_batches > 0
        if not position.iterating:
            position.load_rank_state(state_dict, loader, mid_epoch, rng=rng)
            return
        if state_dict.get("loader") is not None:
            position.load_rank_state(state_dict, loader, mid_epoch)
        if rng is not None:
            set_rng_state(rng)

    def run_state(self) -> dict[str, Any] | None:
        """The run's position (a loader whose position is the same on every rank), else None."""
        return self._owner.data_position.run_state(self._owner.train_dataloader)

    def load_run_state(self, state: dict[str, Any] | None) -> None:
        self._owner.data_position.load_run_state(state, self._owner.train_dataloader)
        self.run_position_restored = state is not None


class Progress:
    """``trainer``: the counters, the run's data position and the names of the saved
    callbacks. Loading restores the counters (a batch counter saved under another
    accumulation is converted; an epoch saved complete resumes at the next one) and the
    run's position.

    Attributes:
        saved_callbacks: the callbacks the last loaded state saved (None: a checkpoint
            without the list).
    """

    def __init__(self, owner: StateOwner, callbacks: CallbacksState, data: DataPositionState) -> None:
        self._owner, self._callbacks, self._data = owner, callbacks, data
        self.saved_callbacks: list[str] | None = None

    def state_dict(self) -> dict[str, Any]:
        owner, run_position = self._owner, self._data.run_state()
        last_val = owner._last_val_step
        return {
            **({} if run_position is None else {"data": dumps(run_position, "run data position")}),
            "accumulation": owner.gradient_accumulation_steps,
            "global_step": owner.global_step,
            "current_epoch": owner.current_epoch,
            "local_batches": owner.local_batches,
            "epoch_complete": owner.data_position.epoch_complete,
            "last_val_step": -1 if last_val is None else last_val,
            **owner.step_path.state_dict(),  # skipped steps and batches
            "callbacks": dumps(sorted(self._callbacks.state_dict()), "saved callback names"),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner, counters = self._owner, state_dict
        owner.global_step = int(counters["global_step"])
        owner.current_epoch = int(counters["current_epoch"])
        owner.local_batches = self.converted_batches(int(counters["local_batches"]), counters)
        last_val = int(counters.get("last_val_step", -1))
        owner._last_val_step = None if last_val < 0 else last_val
        owner.step_path.load_state_dict(counters)
        if counters.get("epoch_complete", False):  # saved after the epoch's last hooks ran
            owner.current_epoch += 1
            owner.local_batches = 0
        owner.resumed = owner.global_step > 0 or owner.current_epoch > 0
        self._data.load_run_state(loads(counters["data"], "the run data position") if "data" in counters else None)
        self.saved_callbacks = (loads(counters["callbacks"], "the list of saved callbacks")
                                if "callbacks" in counters else None)

    def converted_batches(self, batches: int, counters: dict[str, Any]) -> int:
        """The epoch's consumed micro-batches `batches` in this run's accumulation (the
        saved run's, ``counters["accumulation"]``, may differ: another data-parallel size
        under one ``global_batch_size``)."""
        now = self._owner.gradient_accumulation_steps
        saved = int(counters.get("accumulation", now))
        if saved == now:
            return batches
        steps, within = divmod(batches, saved)
        if within:
            raise ValueError(f"the checkpoint was taken {within} micro-batch(es) into a step of {saved}; this run "
                             f"accumulates {now} (another data-parallel size): resume from a step boundary")
        logger.info("the checkpoint accumulated %d micro-batch(es) per step, this run %d: %d step(s) of the epoch done",
                    saved, now, steps)
        return steps * now


class RankState:
    """``ranks``: this rank's entry, under `key` (``rank<N>``), so that every rank writes
    and reads its own: its RNG states, its data position (`DataPositionState`) and its own
    callback states (those holding no DTensor), the last two as opaque bytes in the
    restricted format of `dream_trainer.serialization` (their structure may differ between
    the saving run and the template of the resuming one).

    A missing entry for this rank (a checkpoint written by fewer ranks) keeps the seeded
    RNG, replays the data position by skipping batches (or from the run's position) and
    leaves the callbacks to the shared copy, with a warning."""

    def __init__(self, owner: StateOwner, callbacks: CallbacksState, data: DataPositionState) -> None:
        self._owner, self._callbacks, self._data = owner, callbacks, data

    @property
    def key(self) -> str:
        """This rank's key under ``state_dict()["ranks"]``."""
        return f"rank{self._owner.world.rank}"

    def state_dict(self) -> dict[str, Any]:
        own = {name: state for name, state in self._callbacks.state_dict().items() if not _holds_dtensor(state)}
        position = self._data.state_dict()
        entry = {"rng": rng_state(), "data": dumps(position, "data position"), "callbacks": dumps(own, "callback state")}
        return {self.key: entry}

    def own_callbacks(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's own callback states in `state_dict` (``ranks``), decoded; {} without
        an entry for this rank."""
        mine = state_dict.get(self.key)
        return {} if mine is None else loads(mine["callbacks"], f"the callback state of {self.key}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's RNG and data position (after the counters and the
        callbacks, see `TrainerState.load_state_dict`)."""
        mine = state_dict.get(self.key)
        if mine is None:
            owner = self._owner
            data = ("the run's data position restored" if self._data.run_position_restored else
                    f"skipping {owner.local_batches} batches of epoch {owner.current_epoch}")
            logger.warning(
                "the checkpoint has no RNG state, data position or own callback state for %s (written by fewer "
                "ranks?): continuing from the seeded RNG, %s, callbacks restored from the shared copy",
                self.key, data,
            )
            return
        self._data.load_state_dict(loads(mine["data"], f"the data position of {self.key}"), rng=mine["rng"])


_SAVE_ORDER = ("callbacks", "schedulers", "optimizers", "models", "trainer", "ranks", "goodput")
"""The order the parts' states are taken in: what a restricted load would refuse fails at
the save, callback state named first."""


class TrainerState:
    """The trainer's state, held as ``trainer.state``: a registry of named torch
    ``Stateful`` parts (`parts`), composed into one DCP-ready dict by `state_dict` and
    restored by `load_state_dict` (see the module docstring for the layout). Itself a
    ``Stateful``: checkpoints and fault-tolerant heals use it as is, through
    ``trainer.state_dict()`` / ``trainer.load_state_dict()``.

    Attributes:
        progress, models, optimizers, schedulers, callbacks, ranks, goodput: the parts, under
            the keys ``trainer``, ``models``, ``optimizers``, ``schedulers``, ``callbacks``,
            ``ranks`` and ``goodput``.
        data: this rank's data position (inside ``ranks``, and the run's under ``trainer``).
    """

    def __init__(self, owner: StateOwner) -> None:
        self.data = DataPositionState(owner)
        self.callbacks = CallbacksState(owner)
        self.progress = Progress(owner, self.callbacks, self.data)
        self.models = ModelsState(owner)
        self.optimizers = OptimizersState(owner)
        self.schedulers = SchedulersState(owner)
        self.ranks = RankState(owner, self.callbacks, self.data)
        self.goodput = owner.goodput
        self._owner = owner

    @property
    def parts(self) -> dict[str, Stateful]:
        """Each key of `state_dict` and the ``Stateful`` whose state it holds."""
        return {"trainer": self.progress, "models": self.models, "optimizers": self.optimizers,
                "schedulers": self.schedulers, "callbacks": self.callbacks, "ranks": self.ranks,
                "goodput": self.goodput}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly: each part's state under its key
        (DCP-ready: sharded models and optimizers give DTensor shards)."""
        parts = self.parts
        reshard(self._owner.named_models().values())  # before anything reads a model or its parameters
        with self.callbacks.taken_once():  # each callback asked once
            states = {key: parts[key].state_dict() for key in _SAVE_ORDER}
        return {key: states[key] for key in parts}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict` returned, in order: models, optimizers (`strict`:
        every key must match), schedulers, the counters and the run's data position, the
        callbacks (the shared copy, this rank's own states in their place), then this
        rank's data position and RNG. See `RankState` for a checkpoint without an entry for
        this rank and `DataPositionState` for a restore while an epoch is being iterated."""
        self.models.load_state_dict(state_dict["models"], strict)
        self.optimizers.load_state_dict(state_dict["optimizers"], strict)
        self.schedulers.load_state_dict(state_dict["schedulers"])
        self.progress.load_state_dict(state_dict["trainer"])
        ranks = state_dict.get("ranks", {})
        self.callbacks.load_state_dict(state_dict.get("callbacks", {}), own=self.ranks.own_callbacks(ranks),
                                       saved=self.progress.saved_callbacks)
        self.ranks.load_state_dict(ranks)
        if state_dict.get("goodput"):  # optional: older checkpoints have none
            self.goodput.load_state_dict(state_dict["goodput"])
        elif self._owner.resumed:
            self.goodput.mark_resumed_without_ledger()


def _plain(state: Any) -> Any:
    """`state` with every tensor subclass that wraps one plain tensor of its own shape and
    dtype (torchao's float8 weights under FSDP2, as a DTensor's local tensor or alone)
    replaced by that tensor, which shares its storage. Checkpoints then hold plain tensors:
    DCP's async staging does not copy such wrappers (it staged uninitialized memory) and
    loads write through to the wrapped storage."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    def inner(t: torch.Tensor) -> torch.Tensor:
        if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
            return t
        names, _ = t.__tensor_flatten__()
        wrapped = getattr(t, names[0], None) if names else None
        if type(wrapped) is torch.Tensor and wrapped.shape == t.shape and wrapped.dtype == t.dtype:
            return wrapped
        return t

    def plain(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = inner(t._local_tensor)
            if local is t._local_tensor:
                return t
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return inner(t)

    return tree_map_only(torch.Tensor, plain, state)


def _holds_dtensor(state: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, DTensor) for leaf in tree_leaves(state))


def _is_native(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state is ``optimizer.state_dict()``'s (parameters by index), not
    the DCP helpers' (by name)."""
    groups = optimizer_state.get("param_groups") or [{}]
    first = next((p for g in groups for p in g.get("params", ())), None)
    return isinstance(first, int)
