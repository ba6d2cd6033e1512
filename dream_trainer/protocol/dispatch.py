"""The typed dispatch methods of `CallbackCollection`: one per entry of `HOOKS`.

A mixin of `CallbackCollection` (no ``__init__``): the per-hook tuples ``_h_<hook>`` of
bound methods are rebuilt there when callbacks are added or removed, and the call loops
(``_call0``/``_call1``/``_call2``, which apply the error policy) live there too. Each method
here is a no-op when no callback overrides its hook: one attribute test, nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dream_trainer.protocol.base import StopTraining

logger = logging.getLogger("dream_trainer.protocol.collection")


class DispatchMixin:
    """One explicit, typed dispatch method per hook (checked against `HOOKS` at import)."""

    _call0: Callable[..., None]
    _call1: Callable[..., None]
    _call2: Callable[..., None]
    _on_error: Callable[..., None]
    _name_of: Callable[[Any], str]

    _h_pre_launch: tuple[Callable[[], None], ...]
    _h_pre_configure: tuple[Callable[[], None], ...]
    _h_post_configure_models: tuple[Callable[[dict[str, torch.nn.Module]], None], ...]
    _h_post_init_weights: tuple[Callable[[dict[str, torch.nn.Module]], None], ...]
    _h_post_configure: tuple[Callable[[], None], ...]
    _h_pre_setup: tuple[Callable[[], None], ...]
    _h_post_setup: tuple[Callable[[], None], ...]
    _h_pre_fit: tuple[Callable[[], None], ...]
    _h_post_fit: tuple[Callable[[], None], ...]
    _h_pre_epoch: tuple[Callable[[], None], ...]
    _h_post_epoch: tuple[Callable[[], None], ...]
    _h_pre_train_epoch: tuple[Callable[[], None], ...]
    _h_post_train_epoch: tuple[Callable[[dict[str, Any]], None], ...]
    _h_on_step_begin: tuple[Callable[[int], None], ...]
    _h_pre_train_step: tuple[Callable[[Any, int], Any], ...]
    _h_on_train_step_error: tuple[Callable[[Exception | None, Any, int], bool | None], ...]
    _h_post_train_step: tuple[Callable[[dict[str, Any], int], None], ...]
    _h_on_step_end: tuple[Callable[[int], None], ...]
    _h_pre_optimizer_step: tuple[Callable[..., bool | None], ...]
    _h_post_optimizer_step: tuple[Callable[..., None], ...]
    _h_pre_optimizer_zero_grad: tuple[Callable[..., None], ...]
    _h_post_optimizer_zero_grad: tuple[Callable[..., None], ...]
    _h_pre_validation_epoch: tuple[Callable[[], None], ...]
    _h_post_validation_epoch: tuple[Callable[[dict[str, Any]], None], ...]
    _h_pre_validation_step: tuple[Callable[[Any, int], None], ...]
    _h_post_validation_step: tuple[Callable[[dict[str, Any], int], None], ...]
    _h_on_log: tuple[Callable[[dict[str, float], int], None], ...]
    _h_on_checkpoint_saved: tuple[Callable[[Path, int], None], ...]
    _h_on_checkpoint_loaded: tuple[Callable[[Path, int], None], ...]
    _h_on_callback_error: tuple[Callable[[str, str, Exception], None], ...]
    _h_on_callback_disabled: tuple[Callable[[str, str], None], ...]
    _h_on_interrupt: tuple[Callable[[BaseException], None], ...]
    _h_on_teardown: tuple[Callable[[str], None], ...]
    _h_post_teardown: tuple[Callable[[str], None], ...]

    def pre_launch(self) -> None:
        if self._h_pre_launch:
            self._call0(self._h_pre_launch, "pre_launch")

    def pre_configure(self) -> None:
        if self._h_pre_configure:
            self._call0(self._h_pre_configure, "pre_configure")

    def post_configure_models(self, models: dict[str, torch.nn.Module]) -> None:
        if self._h_post_configure_models:
            self._call1(self._h_post_configure_models, "post_configure_models", models)

    def post_init_weights(self, models: dict[str, torch.nn.Module]) -> None:
        if self._h_post_init_weights:
            self._call1(self._h_post_init_weights, "post_init_weights", models)

    def post_configure(self) -> None:
        if self._h_post_configure:
            self._call0(self._h_post_configure, "post_configure")

    def pre_setup(self) -> None:
        if self._h_pre_setup:
            self._call0(self._h_pre_setup, "pre_setup")

    def post_setup(self) -> None:
        if self._h_post_setup:
            self._call0(self._h_post_setup, "post_setup")

    def pre_fit(self) -> None:
        if self._h_pre_fit:
            self._call0(self._h_pre_fit, "pre_fit")

    def post_fit(self) -> None:
        if self._h_post_fit:
            self._call0(self._h_post_fit, "post_fit")

    def pre_epoch(self) -> None:
        if self._h_pre_epoch:
            self._call0(self._h_pre_epoch, "pre_epoch")

    def post_epoch(self) -> None:
        if self._h_post_epoch:
            self._call0(self._h_post_epoch, "post_epoch")

    def pre_train_epoch(self) -> None:
        if self._h_pre_train_epoch:
            self._call0(self._h_pre_train_epoch, "pre_train_epoch")

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        if self._h_post_train_epoch:
            self._call1(self._h_post_train_epoch, "post_train_epoch", result)

    def on_step_begin(self, step: int) -> None:
        if self._h_on_step_begin:
            self._call1(self._h_on_step_begin, "on_step_begin", step)

    def pre_train_step(self, batch: Any, batch_idx: int) -> Any:
        """Returns the batch: the last replacement a callback returned, else `batch`."""
        if not self._h_pre_train_step:
            return batch
        for fn in self._h_pre_train_step:
            try:
                replaced = fn(batch, batch_idx)
            except Exception as exc:  # noqa: BLE001 - the error policy decides
                self._on_error(fn, "pre_train_step", exc)
                continue
            if replaced is not None:
                batch = replaced
        return batch

    def on_train_step_error(self, error: Exception | None, batch: Any, batch_idx: int) -> bool:
        """Whether a callback asked for a retry (returned True)."""
        retry = False
        for fn in self._h_on_train_step_error:
            try:
                retry = fn(error, batch, batch_idx) is True or retry
            except Exception as exc:  # noqa: BLE001
                self._on_error(fn, "on_train_step_error", exc)
        return retry

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if self._h_post_train_step:
            self._call2(self._h_post_train_step, "post_train_step", result, batch_idx)

    def on_step_end(self, step: int) -> None:
        if self._h_on_step_end:
            self._call1(self._h_on_step_end, "on_step_end", step)

    def pre_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Returns the names of the callbacks that vetoed the step (returned False)."""
        vetoes: list[str] = []
        if not self._h_pre_optimizer_step:
            return vetoes
        for fn in self._h_pre_optimizer_step:
            try:
                if fn(model, optimizer) is False:
                    vetoes.append(self._name_of(fn.__self__))  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - the error policy decides
                self._on_error(fn, "pre_optimizer_step", exc)
        return vetoes

    def post_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._h_post_optimizer_step:
            self._call2(self._h_post_optimizer_step, "post_optimizer_step", model, optimizer)

    def pre_optimizer_zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._h_pre_optimizer_zero_grad:
            self._call2(self._h_pre_optimizer_zero_grad, "pre_optimizer_zero_grad", model, optimizer)

    def post_optimizer_zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._h_post_optimizer_zero_grad:
            self._call2(self._h_post_optimizer_zero_grad, "post_optimizer_zero_grad", model, optimizer)

    def pre_validation_epoch(self) -> None:
        if self._h_pre_validation_epoch:
            self._call0(self._h_pre_validation_epoch, "pre_validation_epoch")

    def post_validation_epoch(self, result: dict[str, Any]) -> None:
        if self._h_post_validation_epoch:
            self._call1(self._h_post_validation_epoch, "post_validation_epoch", result)

    def pre_validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._h_pre_validation_step:
            self._call2(self._h_pre_validation_step, "pre_validation_step", batch, batch_idx)

    def post_validation_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if self._h_post_validation_step:
            self._call2(self._h_post_validation_step, "post_validation_step", result, batch_idx)

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if self._h_on_log:
            self._call2(self._h_on_log, "on_log", metrics, step)

    def on_checkpoint_saved(self, path: Path, step: int) -> None:
        if self._h_on_checkpoint_saved:
            self._call2(self._h_on_checkpoint_saved, "on_checkpoint_saved", path, step)

    def on_checkpoint_loaded(self, path: Path, step: int) -> None:
        if self._h_on_checkpoint_loaded:
            self._call2(self._h_on_checkpoint_loaded, "on_checkpoint_loaded", path, step)

    def on_callback_error(self, callback: str, hook: str, error: Exception) -> None:
        """Dispatched by the error policy itself (`CallbackCollection._on_error`), which
        leaves out the failing callback; calling it directly tells every callback."""
        for fn in self._h_on_callback_error:
            fn(callback, hook, error)

    def on_callback_disabled(self, name: str, reason: str) -> None:
        if self._h_on_callback_disabled:
            self._call2(self._h_on_callback_disabled, "on_callback_disabled", name, reason)

    def on_interrupt(self, error: BaseException) -> list[BaseException]:
        """Every callback's `on_interrupt` runs. Errors are logged, never raised here (an
        interruption is already being handled); the critical callbacks' errors are
        returned, for the trainer to mark the run failed."""
        return self._call_all(self._h_on_interrupt, "on_interrupt", error)

    def on_teardown(self, status: str) -> list[BaseException]:
        """Every callback's `on_teardown` runs; like `on_interrupt`, errors are logged and
        the critical callbacks' errors returned."""
        return self._call_all(self._h_on_teardown, "on_teardown", status)

    def post_teardown(self, status: str) -> list[BaseException]:
        """Every callback's `post_teardown` runs (the world is gone); like `on_teardown`,
        errors are logged and the critical callbacks' errors returned."""
        return self._call_all(self._h_post_teardown, "post_teardown", status)

    def _call_all(self, fns: tuple[Callable[[Any], None], ...], hook: str, arg: Any) -> list[BaseException]:
        failures: list[BaseException] = []
        for fn in fns:
            try:
                fn(arg)
            except Exception as exc:  # noqa: BLE001
                callback = fn.__self__  # type: ignore[attr-defined]
                logger.exception("%s of %r failed", hook, type(callback).__name__)
                if callback.critical and not isinstance(exc, StopTraining):
                    failures.append(exc)
        return failures
