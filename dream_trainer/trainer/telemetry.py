"""`StepStats`: what the trainer measured in the optimizer step that just ended
(``trainer.step_stats``), for monitors, progress displays and reports to read.

Nothing here synchronizes with the device: losses, gradient norms and clip flags stay
device tensors until a reader converts them (do it on log steps, ``trainer.is_log_step``);
times are host clocks; sample and token counts come from the batches' shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepStats:
    """Per-step telemetry. Filled during the step, complete from `post_train_step` on (the
    counts and times also cover a skipped step; the gradient fields only a step that reached
    ``trainer.step(optimizer)``).

    Attributes:
        step: the global step these stats belong to (unchanged by a skipped step).
        micro_batches: micro-batches of this step (gradient accumulation).
        loss_sum: the sum of the micro-batches' ``loss`` results (a device tensor), or None
            when ``training_step`` returned no scalar ``loss``. See `loss`.
        grad_norm: per optimizer name, the total gradient norm before clipping (a device
            tensor). Computed when clipping, on log steps with ``log_grad_norm``, or on every
            step once something called ``trainer.request_grad_norm()`` — once per step,
            shared by every reader.
        clipped: per optimizer name, whether clipping scaled the gradients (a device bool,
            made when read: a step pays for it only where something reads it).
        clip_limit: per optimizer name, the norm gradients were clipped to (a clipped step).
        lr: per optimizer name, the learning rate this step used (its first param group's,
            read before the schedulers stepped).
        samples: samples in this step on this rank (``trainer.count_batch``). Counted once
            something called ``trainer.request_batch_counts()`` (`ThroughputMonitor`,
            `StepWindowCallback` and `PerformanceReportCallback` do); None until then:
            the loop does not look at a batch nobody counts.
        tokens: tokens in this step on this rank, None when the batches have no token count
            (or nothing asked for counts).
        total_samples: samples since `fit()` started, this rank (since counts were first
            requested; None before).
        total_tokens: tokens since `fit()` started, this rank (None: not counted).
        world_samples: `total_samples` summed over data-parallel ranks, as of the last log
            step of the trainer (refreshed there, inside the all-reduce the trainer makes
            anyway to average the logged metrics); None unless every rank counts.
        world_tokens: the same for tokens.
        step_time_s: wall time from the end of the previous step to the end of this one.
        data_wait_s: the part of it spent waiting for the dataloader.
        compute_s: the part inside ``training_step`` (forward, backward and the optimizer
            step it calls), host time: on CUDA it is device time only where something
            synchronized (`PerformanceReportCallback` does on the steps it measures).
            Measured once something called ``trainer.request_step_times()``, else NaN.
        optimizer_s: the part inside ``trainer.step(optimizer)``: clipping, the optimizer
            hooks, the update, ``zero_grad`` and the schedulers. Measured as `compute_s`.
        skipped: why this step was skipped (a veto, a skipped batch), else None.
        backward_loss: the mean of the losses passed to ``trainer.backward`` in this step so
            far (unscaled, a device tensor): complete in `pre_optimizer_step`, where a
            policy deciding on this step's loss (a spike, a NaN) reads it.
    """

    step: int = 0
    micro_batches: int = 0
    loss_sum: torch.Tensor | None = None
    grad_norm: dict[str, torch.Tensor] = field(default_factory=dict)
    clip_limit: dict[str, float] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=dict)
    samples: int | None = None
    tokens: int | None = None
    total_samples: int | None = None
    total_tokens: int | None = None
    world_samples: int | None = None
    world_tokens: int | None = None
    step_time_s: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = math.nan
    optimizer_s: float = math.nan
    skipped: str | None = None
    backward_sum: torch.Tensor | None = None
    backward_count: int = 0

    @property
    def clipped(self) -> dict[str, torch.Tensor]:
        return {name: self.grad_norm[name] > limit for name, limit in self.clip_limit.items()}

    @property
    def backward_loss(self) -> torch.Tensor | None:
        if self.backward_sum is None:
            return None
        return self.backward_sum if self.backward_count == 1 else self.backward_sum / self.backward_count

    @property
    def loss(self) -> torch.Tensor | None:
        """The step's loss: the mean over its micro-batches (what the update minimized), a
        device tensor."""
        if self.loss_sum is None or not self.micro_batches:
            return None
        return self.loss_sum if self.micro_batches == 1 else self.loss_sum / self.micro_batches  # no op for one

    def begin(self, timed: bool = False) -> None:
        """Reset the per-step fields (the running totals stay); `timed`: the step's
        `compute_s` and `optimizer_s` are measured (else NaN)."""
        self.micro_batches = self.backward_count = 0
        self.loss_sum = self.samples = self.tokens = self.skipped = self.backward_sum = None
        self.grad_norm, self.clip_limit, self.lr = {}, {}, {}
        self.data_wait_s = 0.0
        self.compute_s = self.optimizer_s = 0.0 if timed else math.nan

    def add_backward(self, loss: torch.Tensor) -> None:
        value = loss.detach()
        if value.ndim or value.dtype != torch.float32:
            value = value.float().mean()
        self.backward_sum = value if self.backward_sum is None else self.backward_sum + value
        self.backward_count += 1

    def add_loss(self, loss: Any) -> torch.Tensor | None:
        """Count a micro-batch and add its ``loss`` result; returns that loss as a float32
        scalar tensor (None: not a one-element tensor)."""
        self.micro_batches += 1
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        if loss.ndim or loss.requires_grad or loss.dtype != torch.float32:  # else: use it as it is
            loss = loss.detach().float().reshape(())
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        return loss


class RunningMean:
    """The mean of scalar device tensors without a device operation per value: values wait
    in a list, folded into the running sum every `fold` values (one stack and sum), so a
    step costs a list append and an epoch's memory stays bounded."""

    def __init__(self, fold: int = 256):
        self.fold, self.count = fold, 0
        self._pending: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None

    def add(self, value: torch.Tensor) -> None:
        self._pending.append(value)
        self.count += 1
        if len(self._pending) >= self.fold:
            self._fold()

    def _fold(self) -> None:
        if self._pending:
            folded = torch.stack(self._pending).sum()
            self._sum = folded if self._sum is None else self._sum + folded
            self._pending = []

    def mean(self) -> torch.Tensor | None:
        """The mean so far (a device tensor; None before any value)."""
        self._fold()
        return None if self._sum is None else self._sum / self.count


def count_batch(batch: Any) -> tuple[int, int | None]:
    """The default of ``trainer.count_batch``: samples = the first dimension of the batch's
    first tensor; tokens = its first two dimensions' product when that tensor holds integer
    ids of shape ``[batch, sequence, ...]``, else None."""
    if isinstance(batch, torch.Tensor):
        first: torch.Tensor | None = batch
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        first = batch[0]  # the common ``(inputs, targets)``: no walk
    else:
        first = _first_tensor(batch)
    if first is None:
        return 0, None
    shape = first.shape
    if not shape:
        return 0, None
    if len(shape) >= 2 and not first.is_floating_point() and not first.is_complex() and first.dtype != torch.bool:
        return shape[0], shape[0] * shape[1]
    return shape[0], None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = item if isinstance(item, torch.Tensor) else _first_tensor(item)
            if found is not None:
                return found
    return None
