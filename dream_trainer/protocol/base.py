"""The callback protocol: `Callback[TrainerT]`, `RankZeroCallback`, `StopTraining` and `HOOKS`.

Every hook is a no-op here. A subclass overrides the hooks it needs; the
`CallbackCollection` dispatches only those, so a hook that is not overridden costs
nothing per step.
"""

from __future__ import annotations

import inspect
import typing
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch

TrainerT = TypeVar("TrainerT")

HOOKS: tuple[str, ...] = (
    "pre_launch",
    "pre_configure",
    "post_configure_models",
    "post_init_weights",
    "post_configure",
    "pre_setup",
    "post_setup",
    "pre_fit",
    "post_fit",
    "pre_epoch",
    "post_epoch",
    "pre_train_epoch",
    "post_train_epoch",
    "on_step_begin",
    "pre_train_step",
    "on_train_step_error",
    "post_train_step",
    "on_step_end",
    "pre_optimizer_step",
    "post_optimizer_step",
    "pre_optimizer_zero_grad",
    "post_optimizer_zero_grad",
    "pre_validation_epoch",
    "post_validation_epoch",
    "pre_validation_step",
    "post_validation_step",
    "on_log",
    "on_checkpoint_saved",
    "on_checkpoint_loaded",
    "on_callback_error",
    "on_callback_disabled",
    "on_interrupt",
    "on_teardown",
    "post_teardown",
)
"""Every hook a callback can override, in lifecycle order. `CallbackCollection` has one
dispatch method of the same name for each of them (checked when the module loads)."""

CONTEXT_HOOKS: tuple[str, ...] = ("train_context", "validation_context")
"""Hooks that return a context manager (or None) instead of being called for effect."""


class StopTraining(Exception):
    """Raise from a callback hook to end `fit()` cleanly, on every rank.

    Raised from a hook, it is a request (`BaseTrainer.request_stop`): the hook's other
    callbacks still run, the current step finishes, and every rank stops at the same agreed
    point — the next step boundary (on several ranks, the one after: the ranks agree
    without a host wait), after a validation run, at an epoch's end, or before the next
    lifecycle phase when raised before the loop (the rest of the lifecycle is then skipped).
    `post_fit` runs when the loop had started. The world is torn down, `fit()` returns
    normally with ``status == "stopped"`` and `trainer.stop_reason` holds the message.

    Raised from ``training_step``/``validation_step`` itself, it stops that rank at once:
    on several ranks, every rank must raise it at the same step — call
    ``self.request_stop(reason)`` instead and return from the step normally.
    """

    def __init__(self, reason: str = "stopped by a callback"):
        super().__init__(reason)
        self.reason = reason


class SkipBatch(Exception):
    """Raise from `pre_train_step` to skip the batch before its forward pass, on every rank.

    Like `StopTraining`, a request: the hook's other callbacks still run, then the ranks
    agree (one small all-reduce on the CPU, made only when some callback declares
    ``skips_batches = True``, which the raising callback must) and every rank skips the
    batch: no ``training_step``, no ``post_train_step``, no optimizer step. If the batch
    would have ended an accumulation group, the group's gradients are dropped.
    """

    def __init__(self, reason: str = "batch skipped by a callback"):
        super().__init__(reason)
        self.reason = reason


class Callback(Generic[TrainerT]):
    """Base class of every callback. Parametrize it with what the callback needs.

    ``class MyCallback(Callback[DreamTrainer])`` declares that the callback needs a
    `DreamTrainer` (or a subclass, a mixin, or a ``runtime_checkable`` Protocol, e.g. one
    composed of the pieces in `dream_trainer.protocol.trainers`);
    `CallbackCollection.initialize` checks it (``isinstance``; a Protocol member by member)
    and fails with a clear message otherwise.

    Attributes:
        critical: when False, an exception raised by a hook is logged (with traceback,
            once) and training goes on; after `max_consecutive_failures` failures on
            consecutive steps the callback is disabled — on every rank at the same step
            boundary (the ranks agree). A non-critical callback must not run collectives
            (one rank failing before a collective would leave the others waiting in it):
            a callback that communicates is critical. Its `state_dict`/`load_state_dict`
            errors are warned about and its state skipped. Critical callbacks propagate.
        order: callbacks run in ascending `order`, then insertion order.
        max_consecutive_failures: see `critical`.
        vetoes_steps: the callback may veto optimizer steps (`pre_optimizer_step` returning
            False, or ``trainer.skip_step``). The ranks then agree on every optimizer step
            (one small all-reduce on the CPU per step); a veto from a callback that does not
            declare it is an error.
        skips_batches: the callback may raise `SkipBatch` from `pre_train_step`. The ranks
            then agree on every batch (one small all-reduce on the CPU per batch).
        log_every_n_steps: an interval of the callback's own (an instance attribute; None:
            the trainer's). Steps that are multiples of it are log steps too:
            ``trainer.is_log_step`` is True and `log_dict` values are sent to `on_log` at
            once, under that step.
        recovers_errors: the callback may ask for a failed (micro-)batch to be retried
            (`on_train_step_error`). The ranks then agree on every backward whether a
            rank's ``training_step`` failed (one small all-reduce on the CPU per backward).
        safe_types: classes (plain data: dataclasses, enums, named tuples) that this
            callback's `state_dict` holds besides tensors, numbers, strings, bytes, None and
            lists/tuples/dicts/sets of them. Checkpoints and heals load with a restricted
            deserializer that refuses any other type (see `dream_trainer.serialization`);
            listing a class here allows it (``dream_trainer.allow_types`` does the same).
    """

    trainer: TrainerT
    critical: ClassVar[bool] = True
    order: ClassVar[int] = 0
    max_consecutive_failures: ClassVar[int] = 3
    vetoes_steps: bool = False  # a class attribute; an instance may set its own in __init__
    skips_batches: bool = False
    log_every_n_steps: int | None = None
    safe_types: ClassVar[tuple[type, ...]] = ()
    recovers_errors: bool = False

    # -- lifecycle -------------------------------------------------------------------
    def pre_launch(self) -> None:
        """Before the process group exists. ``trainer.set_world(world)`` may replace the
        world here (a fault-tolerant world, a fallback)."""

    def pre_configure(self) -> None: ...

    def post_configure_models(self, models: dict[str, torch.nn.Module]) -> None:
        """`DreamTrainer` only: right after ``configure_models()``, on the meta device,
        before tensor parallel, activation checkpointing, compile, ``fully_shard`` and the
        optimizers. Replace modules here (FP8 conversion, LoRA, QAT): swap submodules in
        place, or set ``trainer.<name>`` to a new model."""

    def post_init_weights(self, models: dict[str, torch.nn.Module]) -> None:
        """`DreamTrainer` only: after materialization and ``init_weights()`` (parallelized,
        on the device, under ``torch.no_grad()``), before the optimizers: initialize what
        a callback added in `post_configure_models`."""

    def post_configure(self) -> None: ...
    def pre_setup(self) -> None: ...
    def post_setup(self) -> None: ...
    def pre_fit(self) -> None: ...
    def post_fit(self) -> None: ...
    def pre_epoch(self) -> None: ...
    def post_epoch(self) -> None: ...

    # -- training --------------------------------------------------------------------
    def pre_train_epoch(self) -> None: ...
    def post_train_epoch(self, result: dict[str, Any]) -> None: ...
    def on_step_begin(self, step: int) -> None:
        """An optimizer step begins: its first micro-batch has arrived (before its
        `pre_train_step`). `step` is the step's number (``global_step + 1``). Once per
        optimizer step, whatever the gradient accumulation."""

    def pre_train_step(self, batch: Any, batch_idx: int) -> Any:
        """Before ``training_step`` on this (micro-)batch, on the device. Return a batch to
        replace it (masking, augmentation): later callbacks and ``training_step`` get the
        replacement. None (the default) keeps the batch."""

    def on_train_step_error(self, error: Exception, batch: Any, batch_idx: int) -> bool | None:
        """``training_step`` raised `error` on some rank (e.g. a CUDA out-of-memory), before
        its backward's collectives. Needs ``recovers_errors = True`` (the ranks then agree
        on every backward). Every rank is told (`error` is None on a rank where the step
        went through, whose work is dropped). Return True to retry the (micro-)batch: it is
        retried on every rank when a callback returned True on every rank — after a change
        that makes it pass (e.g. a `pre_train_step` that now splits or shrinks the batch);
        else the error ends the run."""

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        """After ``training_step`` on this (micro-)batch (not for a skipped batch). The
        counters have already advanced: ``trainer.local_batches`` is ``batch_idx + 1``, and
        on the last micro-batch of an optimizer step ``trainer.global_step`` counts that step
        (not after a skipped step)."""

    def on_step_end(self, step: int) -> None:
        """An optimizer step ended: after its last micro-batch's `post_train_step`, before
        the step's logging, validation and checkpoint. `step` is the number `on_step_begin`
        got; ``trainer.step_skipped`` tells whether the update was skipped."""

    def pre_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool | None:
        """Before ``optimizer.step()`` (gradients final, clipped). Return False to veto the
        step (needs ``vetoes_steps = True``): on every rank, no update, no scheduler step,
        no ``global_step`` increment; the gradients are dropped."""
    def post_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None: ...
    def pre_optimizer_zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None: ...
    def post_optimizer_zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None: ...

    # -- validation ------------------------------------------------------------------
    def pre_validation_epoch(self) -> None: ...
    def post_validation_epoch(self, result: dict[str, Any]) -> None: ...
    def pre_validation_step(self, batch: Any, batch_idx: int) -> None: ...
    def post_validation_step(self, result: dict[str, Any], batch_idx: int) -> None: ...

    # -- other -----------------------------------------------------------------------
    def on_log(self, metrics: dict[str, float], step: int) -> None: ...

    def on_checkpoint_saved(self, path: Path, step: int) -> None:
        """A checkpoint of `step` is complete at `path` (on rank 0: committed; on the other
        ranks: their part written). After an async save, at the first step after it ends."""

    def on_checkpoint_loaded(self, path: Path, step: int) -> None:
        """The trainer was restored from the checkpoint at `path` (at `step`)."""

    def on_callback_error(self, callback: str, hook: str, error: Exception) -> None:
        """The non-critical callback named `callback` raised `error` in `hook` (each
        failure; training goes on, and after repeated failures it is disabled). Not called
        on the failing callback itself; an error raised here is logged, never dispatched
        again. Runs on the rank where it failed."""

    def on_callback_disabled(self, name: str, reason: str) -> None:
        """The non-critical callback `name` was disabled (on every rank, at the same point)."""

    def on_interrupt(self, error: BaseException) -> None:
        """The run is ending on an exception: `error` is it — a `TrainingInterrupted` for a
        signal (``error.signal``; ``trainer.status == "preempted"`` when handled at a step
        boundary) or any exception that failed the run (``status == "failed"``). A critical
        callback that raises here turns a preempted run into a failed one."""

    def on_teardown(self, status: str) -> None:
        """Always the last hook, on every path (also after a `StopTraining` raised before
        `pre_fit`, or a failure), with the final ``trainer.status``; before the process
        group is destroyed, but it must not run collectives (a peer may be gone). Stop
        profilers, dashboards and background threads here."""

    def post_teardown(self, status: str) -> None:
        """After the world is torn down (no process group, no collectives), on every path,
        with the final ``trainer.status``: what must outlive the run's communication, such
        as an upload of the final checkpoint or a notification. Errors are logged; a
        critical callback's error fails the run (its exit code follows)."""

    def train_context(self) -> AbstractContextManager[Any] | None:
        """A context entered around every ``training_step`` (None: nothing to enter)."""
        return None

    def validation_context(self) -> AbstractContextManager[Any] | None:
        """A context entered around every ``validation_step`` (None: nothing to enter)."""
        return None

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State saved in every checkpoint under this callback's name."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    # -- introspection ---------------------------------------------------------------
    @classmethod
    def overridden_hooks(cls) -> tuple[str, ...]:
        """The hooks (and context hooks) this class overrides, in `HOOKS` order."""
        return tuple(
            name
            for name in HOOKS + CONTEXT_HOOKS
            if getattr(cls, name) is not getattr(Callback, name)
        )

    @classmethod
    def check_hook_signatures(cls) -> None:
        """Raise `TypeError` when an overridden hook cannot take the hook's arguments (a
        callback written for another signature, e.g. ``on_interrupt(self)`` from before it
        received the error): checked when the callback is added, not when the hook first
        runs — an `on_interrupt` that cannot be called would fail only at the worst moment."""
        for name in cls.overridden_hooks():
            expected = inspect.signature(getattr(Callback, name))
            n_args = len(expected.parameters) - 1  # without self
            try:
                actual = inspect.signature(getattr(cls, name))
            except (TypeError, ValueError):  # a builtin or C callable: nothing to check
                continue
            try:
                actual.bind(None, *range(n_args))
            except TypeError:
                raise TypeError(
                    f"{cls.__name__}.{name}{actual} does not take the hook's arguments: expected "
                    f"{name}{expected}"
                ) from None

    @classmethod
    def trainer_requirement(cls) -> Any:
        """What `TrainerT` was bound to in the class hierarchy (None when unbound/Any)."""
        for klass in cls.__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                origin = typing.get_origin(base)
                if not (isinstance(origin, type) and issubclass(origin, Callback)):
                    continue
                args = typing.get_args(base)
                if not args or isinstance(args[0], TypeVar) or args[0] is Any:
                    continue
                return args[0]
        return None


class RankZeroCallback(Callback[TrainerT]):
    """A callback whose hooks run on global rank 0 only (decided once, at initialization).

    `state_dict`/`load_state_dict` still run on every rank.
    """

    rank_zero_only: ClassVar[bool] = True
