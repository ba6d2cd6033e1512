"""Small trainer protocols: what a generic callback needs of a trainer, one piece each.

A callback that works with any trainer declares the pieces it uses, composed into one
``runtime_checkable`` Protocol, instead of ``Callback[AbstractTrainer]`` and a
``type: ignore`` at each use of something `AbstractTrainer` does not have::

    @runtime_checkable
    class Needs(Counters, Logs, Stops, Protocol): ...

    class MyCallback(Callback[Needs]):
        def post_train_step(self, result, batch_idx):
            self.trainer.log_dict({"train/x": 1.0})  # typed: Logs has log_dict

`CallbackCollection` checks such a requirement member by member before ``pre_launch`` and
names the missing ones. A member the trainer's class declares (``run_dir: Path`` and
``world`` on `AbstractTrainer`, set at launch) counts as present. Every `BaseTrainer`
implements all of these pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Accumulates", "Counters", "Displays", "InWorld", "Logs", "Models", "RunDirectory", "Stops", "WorldFacts"]


@runtime_checkable
class Counters(Protocol):
    """The optimizer-step and epoch counters."""

    @property
    def global_step(self) -> int: ...

    @property
    def current_epoch(self) -> int: ...


@runtime_checkable
class Accumulates(Protocol):
    """Whether the current micro-batch accumulates gradients (no optimizer step after it)."""

    @property
    def is_accumulating_gradients(self) -> bool: ...


@runtime_checkable
class RunDirectory(Protocol):
    """The run's directory (this rank's files: logs, traces, reports)."""

    @property
    def run_dir(self) -> Path: ...


@runtime_checkable
class Logs(Protocol):
    """The metric log: what was logged last, and logging more."""

    @property
    def logged_metrics(self) -> Mapping[str, float]: ...

    def log_dict(self, metrics: dict[str, Any]) -> None: ...


@runtime_checkable
class Displays(Protocol):
    """Short fields for a progress display (``{"loss": "0.123"}``)."""

    @property
    def display_fields(self) -> Mapping[str, str]: ...


@runtime_checkable
class Stops(Protocol):
    """Asking the run to stop (every rank at the same agreed point)."""

    def request_stop(self, reason: str = ...) -> None: ...


@runtime_checkable
class Models(Protocol):
    """The trainer's models by attribute name."""

    def named_models(self) -> dict[str, nn.Module]: ...


class WorldFacts(Protocol):
    """What a generic callback reads of the world: this rank and its device."""

    @property
    def rank(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


@runtime_checkable
class InWorld(Protocol):
    """The trainer's world (its rank and device)."""

    @property
    def world(self) -> WorldFacts: ...
