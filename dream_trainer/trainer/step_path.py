"""`StepPath`: the state of the optimizer-step path, owned by the trainer as
``trainer.step_path``.

What it owns (and nothing else writes):

- the step's telemetry (`StepStats`, ``trainer.step_stats``);
- the step's vetoes and the batch's skip request, until the trainer's agreement takes them;
- what readers asked the step path to compute (the pre-clip gradient norm, the losses passed
  to ``backward``);
- each optimizer's route, worked out on its first step: its parameters, the model that owns
  them, its name and the schedulers stepped after it;
- the step cycle: whether a step is open, whether its update was applied, its clocks;
- the counters a checkpoint keeps: skipped steps and skipped batches.

It makes no collective and reads nothing from the device but the one flag of a device-side
veto (`take_veto`): the `Stepper` holding it agrees on what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from dream_trainer.trainer.telemetry import StepStats


@dataclass(frozen=True)
class OptimizerRoute:
    """What one optimizer's step needs, worked out once (its first step).

    Attributes:
        name: the optimizer's attribute name on the trainer (the key of
            ``step_stats.grad_norm``, ``clipped`` and ``lr``).
        params: every parameter of its param groups (one list object: the world keys its
            gradient grouping by it).
        model: the model that owns those parameters (None: no model does).
        schedulers: the schedulers that step after it (not ``ReduceLROnPlateau``: it steps
            on a metric, after validation).
    """

    name: str
    params: list[nn.Parameter]
    model: nn.Module | None
    schedulers: list[Any]


class StepPath:
    """The optimizer-step path's state (see the module docstring). Needs no trainer."""

    def __init__(self) -> None:
        self.stats = StepStats()
        self.skipped_steps = 0
        self.skipped_batches = 0
        self.grad_norm_wanted = False  # `request_grad_norm`: every step, not only when clipping or logging
        self.backward_loss_wanted = False  # `request_backward_loss`
        self.times_wanted = False  # `request_step_times`: compute_s and optimizer_s measured
        self.counts_wanted = False  # `request_batch_counts`: each batch's samples and tokens counted
        self.open = False  # a step began (its first micro-batch arrived) and has not ended
        self.stepped = False  # the open step's update was applied
        self.agreed = False  # the ranks agreed that no rank's training_step failed (recovers_errors)
        self.timeout_relaxed = False  # the first step of this fit() relaxed the world's timeout
        self.step_end = 0.0  # perf_counter at the end of the last step
        self.fetch_start = 0.0  # perf_counter when the next batch was asked for (the loop sets it)
        self.arrived_at = 0.0  # perf_counter when the last batch arrived (< fetch_start: fetching)
        self.data_total = 0.0  # seconds the loop waited for batches (the goodput ledger's clock)
        self.ended_at = 0.0  # perf_counter at the end of the last optimizer step (validation does not move it)
        self.data_at_end = 0.0  # `data_total` then
        self._veto: str | None = None
        self._veto_flag: tuple[torch.Tensor, str] | None = None
        self._batch_skip: str | None = None
        self.routes: dict[int, OptimizerRoute] = {}  # id(optimizer) -> its route (`route` makes them)

    # ------------------------------------------------------------------ vetoes
    def veto(self, reason: str) -> None:
        """Skip the coming optimizer step (the first reason wins)."""
        if self._veto is None:
            self._veto = str(reason)

    def veto_if(self, flag: torch.Tensor, reason: str) -> None:
        """Skip the coming step when `flag` (a one-element device tensor) is true; several
        flags are OR-ed on the device (no sync), the first reason is kept."""
        if flag.ndim or flag.requires_grad:  # else: kept as it is (no device op)
            flag = flag.detach().reshape(())
        if self._veto_flag is None:
            self._veto_flag = (flag, reason)
        else:
            self._veto_flag = (self._veto_flag[0].bool() | flag.bool(), self._veto_flag[1])

    @property
    def veto_pending(self) -> bool:
        """A veto (or a device flag) waits for a step that has not come."""
        return self._veto is not None or self._veto_flag is not None

    def take_veto(self) -> str | None:
        """This rank's decision for the step now (None: step), and the slate cleared. A
        device flag is read here, once per step (the host read a device-side veto costs)."""
        reason, flag = self._veto, self._veto_flag
        self._veto = self._veto_flag = None
        if flag is not None and reason is None and bool(flag[0]):  # deliberate: the step's one read
            reason = flag[1]
        return reason

    def clear_vetoes(self) -> None:
        self._veto = self._veto_flag = None

    def request_batch_skip(self, reason: str) -> None:
        """Skip the current batch (the first reason wins)."""
        if self._batch_skip is None:
            self._batch_skip = str(reason)

    def take_batch_skip(self) -> str | None:
        reason, self._batch_skip = self._batch_skip, None
        return reason

    # ------------------------------------------------------------------ optimizers
    def route(self, optimizer: Optimizer, make: Callable[[Optimizer], OptimizerRoute]) -> OptimizerRoute:
        """`optimizer`'s route: made by `make` on its first step, then kept."""
        key = id(optimizer)
        found = self.routes.get(key)
        if found is None:
            found = self.routes[key] = make(optimizer)
        return found

    def forget_routes(self) -> None:
        """Work the routes out again at the next step (optimizers or models changed)."""
        self.routes.clear()

    # ------------------------------------------------------------------ the cycle
    def arrive(self, now: float) -> bool:
        """A micro-batch arrived at `now`: open a step unless one is open, then add its data
        wait (since `fetch_start`). True when it opened a step (its per-step telemetry reset
        first)."""
        stats, opened = self.stats, not self.open
        if opened:
            stats.begin(self.times_wanted)
            self.open, self.stepped = True, False
        wait = now - self.fetch_start
        stats.data_wait_s += wait
        self.data_total += wait
        self.arrived_at = now
        return opened

    def count(self, samples: int, tokens: int | None) -> None:
        """The arrived micro-batch's `samples` (`tokens`, None: not counted) in the step's
        counts and the totals (`counts_wanted`: what the loop calls when asked)."""
        stats = self.stats
        stats.samples = (stats.samples or 0) + samples
        stats.total_samples = (stats.total_samples or 0) + samples
        if tokens is not None:
            stats.tokens = (stats.tokens or 0) + tokens
            stats.total_tokens = (stats.total_tokens or 0) + tokens

    @property
    def skipped(self) -> bool:
        """The step that just ended was skipped (a veto or a skipped batch)."""
        return self.stats.skipped is not None and not self.stepped

    def end(self, step: int, now: float) -> bool:
        """The open step, global step `step` when applied, ended at `now`. Whether it was
        skipped (then the global step stays `step` - 1). A veto still waiting (`skip_step`
        with no ``trainer.step`` after it) is an error, and is cleared."""
        if self._veto is not None or self._veto_flag is not None:
            self.clear_vetoes()
            raise RuntimeError(
                "skip_step() was called but no trainer.step(optimizer) followed in this step: call it in "
                "training_step or pre_optimizer_step, before self.step(optimizer)"
            )
        stats = self.stats
        skipped = stats.skipped is not None and not self.stepped
        if skipped:
            self.skipped_steps += 1
            step -= 1
        stats.step, stats.step_time_s, self.step_end = step, now - self.step_end, now
        self.ended_at, self.data_at_end = now, self.data_total
        self.open = False
        return skipped

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "skipped_batches": self.skipped_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters (absent ones, from an older checkpoint: 0)."""
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skipped_batches = int(state.get("skipped_batches", 0))
