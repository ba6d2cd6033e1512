"""`StateMixin`: the trainer's whole state as one DCP-ready dict, and its restore.

A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there). What it holds:

- ``trainer``: counters (global step, epoch, batches consumed in the epoch, whether the
  epoch had finished, the step of the last validation, the accumulation they count in) and
  the run's data position when the loader keeps one (`TokenLoader`: the same on every rank,
  so it loads into any world size; a changed accumulation converts the batch counter);
- ``models`` / ``optimizers``: DCP state-dict helpers, so FSDP2/TP shards are DTensors and
  load into any layout;
- ``schedulers`` and ``callbacks`` (by name; ``callbacks`` holds one copy for all ranks,
  the fallback of a rank that the checkpoint has no entry for);
- ``ranks.rank<N>``: this rank's own RNG states, data position (see
  `dream_trainer.trainer.data`) and callback states (a callback's state may differ per
  rank; a state holding DTensors is restored from the shared copy), under a per-rank key
  so every rank writes and reads its own.
"""

from __future__ import annotations

import logging
from typing import Any

from dream_trainer.protocol.collection import warn_absent_callbacks
from dream_trainer.serialization import check_storable, dumps, loads
from dream_trainer.trainer.abstract import AbstractTrainer, reshard
from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.trainer.step_path import StepPath
from dream_trainer.utils import rng_state, set_rng_state

logger = logging.getLogger(__name__)


class StateMixin(AbstractTrainer):
    """`state_dict` / `load_state_dict` of the whole trainer: the composition of its parts'
    states (one composition for checkpoints and for torchft heals alike)."""

    resumed: bool
    _last_val_step: int | None
    step_path: StepPath
    data_position: DataPosition
    _mid_epoch: bool

    flat_optimizer_state: bool = True
    """Optimizer state keyed per parameter name, param-group settings included
    (``param_groups.<name>.lr``): what pipeline stages, each holding some parameters, can
    save side by side and resume on another layout. False: DCP's grouped form
    (``param_groups.0.params``), which checkpoints of dream_trainer before pipeline
    parallelism hold; `CheckpointCallback` switches to it to load one."""

    @property
    def rank_key(self) -> str:
        """This rank's key under ``state_dict()["ranks"]``."""
        return f"rank{self.world.rank}"

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (DCP-ready: sharded models and
        optimizers give DTensor shards, optimizer state keyed by parameter name). See the
        module docstring for the parts."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        reshard(self.named_models().values())  # optimizer state by parameter name needs the sharded parameters
        callbacks = self.callbacks.state_dict()
        schedulers = {name: s.state_dict() for name, s in self.named_schedulers().items()}
        optimizers = self._optimizer_states()
        # What a restricted load would refuse fails here, at the save (see dream_trainer.serialization).
        check_storable(callbacks, "callback state")
        check_storable(schedulers, "scheduler state")
        check_storable(optimizers, "optimizer state")
        return {
            "trainer": {**self._counters(), "callbacks": dumps(sorted(callbacks), "saved callback names")},
            "models": _plain({name: get_model_state_dict(m) for name, m in self.named_models().items()}),
            "optimizers": _plain(optimizers),
            "schedulers": schedulers,
            "callbacks": callbacks,
            # Opaque per-rank entries (bytes in a restricted format, see
            # dream_trainer.serialization): their structure may differ between the saving
            # run and the template of the resuming one.
            "ranks": {self.rank_key: self._rank_state(callbacks)},
        }

    def _counters(self) -> dict[str, Any]:
        run_position = self.data_position.run_state(self.train_dataloader)
        return {
            **({} if run_position is None else {"data": dumps(run_position, "run data position")}),
            "accumulation": self.gradient_accumulation_steps,
            "global_step": self.global_step,
            "current_epoch": self.current_epoch,
            "local_batches": self.local_batches,
            "epoch_complete": self.data_position.epoch_complete,
            "last_val_step": -1 if self._last_val_step is None else self._last_val_step,
            **self.step_path.state_dict(),  # skipped steps and batches
        }

    def _optimizer_states(self) -> dict[str, Any]:
        """Each optimizer's state in DCP's form (keyed by parameter name, reshardable); an
        optimizer no model owns in its own form."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=self.flat_optimizer_state)
        states = {}
        for name, opt in self.named_optimizers().items():
            model = self.model_for(opt)
            states[name] = opt.state_dict() if model is None else get_optimizer_state_dict(model, opt, options=options)
        return states

    def _rank_state(self, callbacks: dict[str, Any]) -> dict[str, Any]:
        own = {name: state for name, state in callbacks.items() if not _holds_dtensor(state)}
        position = self.data_position.state_dict(self.train_dataloader, self._mid_epoch)
        return {"rng": rng_state(), "data": dumps(position, "data position"), "callbacks": dumps(own, "callback state")}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict` returned. A missing ``ranks`` entry for this rank (a
        checkpoint written by fewer ranks) keeps the seeded RNG, replays the data position
        by skipping batches and restores the callbacks from the shared copy, with a warning.

        Called while an epoch runs (a torchft heal, between two steps, before a step's data
        is fetched), the RNG is set at once and the data position is restored only where the
        loader (or its batch sampler) restores its own; the loop goes on from the restored
        counters."""
        self._load_modules(state, strict)
        counters = state["trainer"]
        self._load_counters(counters)
        run_position = loads(counters["data"], "the run data position") if "data" in counters else None
        self.data_position.load_run_state(run_position, self.train_dataloader)
        mine = state.get("ranks", {}).get(self.rank_key)
        callbacks = dict(state.get("callbacks", {}))
        if mine is not None:
            callbacks.update(loads(mine["callbacks"], f"the callback state of {self.rank_key}"))
        # Warned here, once: the shared copy of a callback absent from this run is not in the
        # resuming template, so DCP never loads it.
        saved = loads(counters["callbacks"], "the list of saved callbacks") if "callbacks" in counters else list(callbacks)
        absent = [name for name in saved if name not in self.callbacks]
        if absent:
            warn_absent_callbacks(absent, self.callbacks.names())
        self.callbacks.load_state_dict({name: value for name, value in callbacks.items() if name in self.callbacks})
        if mine is None:
            data = ("the run's data position restored" if run_position is not None else
                    f"skipping {self.local_batches} batches of epoch {self.current_epoch}")
            logger.warning(
                "the checkpoint has no RNG state, data position or own callback state for %s (written by fewer "
                "ranks?): continuing from the seeded RNG, %s, callbacks restored from the shared copy",
                self.rank_key, data,
            )
            return
        self._load_rank_state(mine)

    def _load_modules(self, state: dict[str, Any], strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=self.flat_optimizer_state)
        reshard(self.named_models().values())
        for name, model in self.named_models().items():
            set_model_state_dict(model, state["models"][name], options=options)
        for name, opt in self.named_optimizers().items():
            model, saved = self.model_for(opt), state["optimizers"][name]
            if model is not None and not _is_native(saved):
                set_optimizer_state_dict(model, opt, saved, options=options)
            else:
                opt.load_state_dict(saved)
        for name, scheduler in self.named_schedulers().items():
            scheduler.load_state_dict(state["schedulers"][name])

    def _load_counters(self, counters: dict[str, Any]) -> None:
        self.global_step = int(counters["global_step"])
        self.current_epoch = int(counters["current_epoch"])
        self.local_batches = self._converted_batches(int(counters["local_batches"]), counters)
        last_val = int(counters.get("last_val_step", -1))
        self._last_val_step = None if last_val < 0 else last_val
        self.step_path.load_state_dict(counters)
        if counters.get("epoch_complete", False):  # saved after the epoch's last hooks ran
            self.current_epoch += 1
            self.local_batches = 0
        self.resumed = self.global_step > 0 or self.current_epoch > 0

    def _converted_batches(self, batches: int, counters: dict[str, Any]) -> int:
        """The epoch's consumed micro-batches in this run's accumulation (the saved run's may
        differ: another data-parallel size under one ``global_batch_size``)."""
        saved, now = int(counters.get("accumulation", self.gradient_accumulation_steps)), self.gradient_accumulation_steps
        if saved == now:
            return batches
        steps, within = divmod(batches, saved)
        if within:
            raise ValueError(f"the checkpoint was taken {within} micro-batch(es) into a step of {saved}; this run "
                             f"accumulates {now} (another data-parallel size): resume from a step boundary")
        logger.info("the checkpoint accumulated %d micro-batch(es) per step, this run %d: %d step(s) of the epoch done",
                    saved, now, steps)
        return steps * now

    def _load_rank_state(self, mine: dict[str, Any]) -> None:
        position = loads(mine["data"], f"the data position of {self.rank_key}")
        mid_epoch = self.local_batches > 0  # the counters just restored
        if self.data_position.iterating:  # between two steps of a running epoch: the RNG now
            if position.get("loader") is not None:  # only a loader that restores itself moves
                self.data_position.load_state_dict(position, self.train_dataloader, mid_epoch)
            set_rng_state(mine["rng"])
            return
        # Mid-epoch, the epoch's iterator is made again (which may draw from the RNG): the
        # data position sets the saved RNG after that, where the saved run stood.
        self.data_position.load_state_dict(position, self.train_dataloader, mid_epoch, rng=mine["rng"])


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
