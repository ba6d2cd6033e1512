"""`StateMixin`: the trainer's whole state as one DCP-ready dict, and its restore.

A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there). What it holds:

- ``trainer``: counters (global step, epoch, batches consumed in the epoch, whether the
  epoch had finished, the step of the last validation);
- ``models`` / ``optimizers``: DCP state-dict helpers, so FSDP2/TP shards are DTensors and
  load into any layout;
- ``schedulers`` and ``callbacks`` (by name);
- ``ranks.rank<N>``: the RNG states (python, numpy, torch, CUDA) and the dataloader position
  of this rank, under a per-rank key so every rank writes and reads its own.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from dream_trainer.trainer.abstract import AbstractTrainer

logger = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process (python, numpy, torch CPU and CUDA)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_stateful(loader: Any) -> bool:
    """Whether a dataloader saves its own position (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class StateMixin(AbstractTrainer):
    """`state_dict` / `load_state_dict` of the whole trainer."""

    resumed: bool
    _epoch_complete: bool
    _last_val_step: int | None
    _data_snapshot: Any
    _loader_restored: bool
    _resume_rng: dict[str, Any] | None

    @property
    def rank_key(self) -> str:
        """This rank's key under ``state_dict()["ranks"]``."""
        return f"rank{self.world.rank}"

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (DCP-ready: sharded models and
        optimizers give DTensor shards)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        optimizers = {}
        for name, opt in self.named_optimizers().items():
            model = self.model_for(opt)
            optimizers[name] = get_optimizer_state_dict(model, opt) if model is not None else opt.state_dict()
        loader = self.train_dataloader
        data = None
        if is_stateful(loader):
            data = self._data_snapshot if self._data_snapshot is not None else loader.state_dict()  # type: ignore[union-attr]
        return {
            "trainer": {
                "global_step": self.global_step,
                "current_epoch": self.current_epoch,
                "local_batches": self.local_batches,
                "epoch_complete": self._epoch_complete,
                "last_val_step": -1 if self._last_val_step is None else self._last_val_step,
            },
            "models": {name: get_model_state_dict(m) for name, m in self.named_models().items()},
            "optimizers": optimizers,
            "schedulers": {name: s.state_dict() for name, s in self.named_schedulers().items()},
            "callbacks": self.callbacks.state_dict(),
            "ranks": {self.rank_key: {"rng": rng_state(), "data": data}},
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict` returned. A missing ``ranks`` entry for this rank (a
        checkpoint written by fewer ranks) keeps the seeded RNG and replays the data
        position by skipping batches, with a warning."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(strict=strict)
        for name, model in self.named_models().items():
            set_model_state_dict(model, state["models"][name], options=options)
        for name, opt in self.named_optimizers().items():
            model = self.model_for(opt)
            if model is not None:
                set_optimizer_state_dict(model, opt, state["optimizers"][name], options=options)
            else:
                opt.load_state_dict(state["optimizers"][name])
        for name, scheduler in self.named_schedulers().items():
            scheduler.load_state_dict(state["schedulers"][name])
        self.callbacks.load_state_dict(state.get("callbacks", {}))

        counters = state["trainer"]
        self.global_step = int(counters["global_step"])
        self.current_epoch = int(counters["current_epoch"])
        self.local_batches = int(counters["local_batches"])
        last_val = int(counters.get("last_val_step", -1))
        self._last_val_step = None if last_val < 0 else last_val
        if counters.get("epoch_complete", False):  # saved after the epoch's last hooks ran
            self.current_epoch += 1
            self.local_batches = 0
        self.resumed = self.global_step > 0 or self.current_epoch > 0

        mine = state.get("ranks", {}).get(self.rank_key)
        if mine is None:
            logger.warning(
                "the checkpoint has no RNG state or data position for %s (written by fewer ranks?): "
                "continuing from the seeded RNG and skipping %d batches of epoch %d",
                self.rank_key,
                self.local_batches,
                self.current_epoch,
            )
            return
        if mine.get("data") is not None and is_stateful(self.train_dataloader):
            self.train_dataloader.load_state_dict(mine["data"])  # type: ignore[union-attr]
            self._loader_restored = True
        if self.local_batches:
            # Mid-epoch: the epoch's iterator is created again on resume (which may draw from
            # the RNG), so the RNG is restored after that, where the saved run stood.
            self._resume_rng = mine["rng"]
        else:
            set_rng_state(mine["rng"])

    def _restore_resume_rng(self) -> None:
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None
