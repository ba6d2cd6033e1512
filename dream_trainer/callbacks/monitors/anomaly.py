"""`AnomalyDetectorCallback`: NaN/Inf in the loss or the gradients, with a policy."""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch

from dream_trainer.callbacks.monitors._base import Monitor, check_int

logger = logging.getLogger(__name__)

_POLICIES = ("skip", "halt", "warn")
_REASON = "non-finite loss or gradients"


class AnomalyError(RuntimeError):
    """A non-finite loss or gradient under the ``halt`` policy, or too many skipped steps."""


class AnomalyDetectorCallback(Monitor):
    """Catch a NaN or Inf in the step's loss or in any gradient, before the update.

    The check is one fused device computation per optimizer step (on an accelerator): the loss passed to
    ``trainer.backward`` (``step_stats.backward_loss``) and the total gradient norm the trainer
    computes anyway (``step_stats.grad_norm``: it is non-finite exactly when some gradient
    element is). What happens then is the `policy`:

    - ``"skip"`` (default): the update is not applied on any rank — the flag goes to
      ``trainer.skip_step_if`` and the ranks agree through the trainer's one all-reduce; the
      gradients are dropped. The skip is counted (``train/skipped_steps``) and logged with the
      batch index; after `max_consecutive` skips in a row the run halts with `AnomalyError`.
    - ``"halt"``: the flag is read (once per step) and a non-finite step raises `AnomalyError`
      naming the parameters whose gradients are non-finite, with suggestions (with
      ``gradient_clip_val`` too: clipping by a non-finite norm leaves the finite gradients
      finite, see `DistributedWorld.clip_grad_norm_`).
    - ``"warn"``: nothing is read on ordinary steps; on its log steps it logs
      ``train/nonfinite_steps`` and warns when it grew.

    On the CPU (loss and norm CPU tensors) there is no device to sync with and a read costs
    less than a device op: the two values are read directly and a non-finite step is vetoed
    with ``trainer.skip_step`` (the ranks agree on it the same way). `reads_cpu_values` False
    keeps the device flag there too (what the tests of the accelerator's read budget use).

    Critical under ``skip`` and ``halt`` (it enforces the policy you chose), not under
    ``warn``. Its counters are saved in checkpoints.
    """

    reads_cpu_values: ClassVar[bool] = True

    def __init__(self, policy: str = "skip", max_consecutive: int = 10, log_interval: int = 100):
        super().__init__(log_interval)
        if policy not in _POLICIES:
            raise ValueError(f"AnomalyDetectorCallback(policy={policy!r}) is invalid: expected one of {list(_POLICIES)}")
        check_int("AnomalyDetectorCallback", "max_consecutive", max_consecutive, 1)
        self.policy, self.max_consecutive = policy, max_consecutive
        self.critical = policy != "warn"
        self.vetoes_steps = policy == "skip"
        self.skipped_steps = 0
        self.consecutive = 0
        self.events: list[tuple[int, int]] = []  # (step, batch index) of skipped steps
        self._nonfinite: torch.Tensor | None = None  # "warn": a device count
        self._reported = 0.0
        self._names: dict[int, str] = {}
        self._zero: torch.Tensor | None = None

    def post_setup(self) -> None:
        self.trainer.request_grad_norm()
        self.trainer.request_backward_loss()

    def _inputs(self, optimizer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This step's ``(gradient norm of `optimizer`'s parameters, loss)``, each None when
        not recorded."""
        stats = self.trainer.step_stats
        name = self._names.get(id(optimizer))
        if name is None:
            name = self._names[id(optimizer)] = next(
                (n for n, opt in self.trainer.named_optimizers().items() if opt is optimizer), "")
        return stats.grad_norm.get(name), stats.backward_loss

    def _flag(self, norm: torch.Tensor | None, loss: torch.Tensor | None) -> torch.Tensor | None:
        """A device scalar that is true (NaN) when this step's loss or gradient norm is NaN
        or Inf and false (0) otherwise: one small device op, no sync."""
        if norm is None or loss is None:
            value = norm if loss is None else loss
            return None if value is None else value - value  # NaN where `value` is NaN or +-Inf, else 0
        if self._zero is None:
            self._zero = torch.zeros((), device=norm.device)
        # One op: 0 + 0 * loss * norm is 0 when both are finite and NaN when either is NaN or
        # +-Inf (0 * Inf = NaN; evaluated left to right, so two huge finite values give 0).
        return torch.addcmul(self._zero, loss, norm, value=0.0)

    def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
        norm, loss = self._inputs(optimizer)
        if norm is None and loss is None:
            return
        if self.reads_cpu_values and (norm is None or norm.is_cpu) and (loss is None or loss.is_cpu):  # no sync
            if (norm is None or math.isfinite(norm.item())) and (loss is None or math.isfinite(loss.item())):
                return
            if self.policy == "skip":
                self.trainer.skip_step(_REASON)  # agreed by every rank at the step, as the flag is
            elif self.policy == "halt":
                raise AnomalyError(self._diagnosis(model))
            else:
                self._count_nonfinite(torch.ones(()))
            return
        flag = self._flag(norm, loss)
        assert flag is not None
        if self.policy == "skip":
            self.trainer.skip_step_if(flag, _REASON)  # read once per step by the trainer's agreement
        elif self.policy == "halt":
            if bool(flag):  # deliberate, once per step: halting is a decision made before this update (NaN: true)
                raise AnomalyError(self._diagnosis(model))
        else:
            self._count_nonfinite(flag.isnan())

    def _count_nonfinite(self, count: torch.Tensor) -> None:
        if self._nonfinite is None:
            self._nonfinite = torch.zeros((), device=count.device)
        self._nonfinite.add_(count)  # counted on the device: read on log steps

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        if trainer.step_skipped and trainer.step_stats.skipped == _REASON:
            self.skipped_steps += 1
            self.consecutive += 1
            self.events.append((trainer.global_step + 1, batch_idx))
            logger.warning("non-finite loss or gradients in step %d (batch %d of epoch %d): the update was skipped on "
                           "every rank (%d in a row)", trainer.global_step + 1, batch_idx, trainer.current_epoch, self.consecutive)
            trainer.log_scalar("train/skipped_steps", float(self.skipped_steps))
            if self.consecutive >= self.max_consecutive:
                raise AnomalyError(
                    f"{self.consecutive} optimizer steps in a row had a non-finite loss or gradients (last: step "
                    f"{trainer.global_step + 1}); halting. {_SUGGESTIONS}"
                )
            return
        if not trainer.step_skipped:
            self.consecutive = 0
        if self.policy == "warn" and self.due() and self._nonfinite is not None:
            count = float(self._nonfinite)  # the one read of this log step
            if count > self._reported:
                logger.warning("%d step(s) with a non-finite loss or gradients so far (policy 'warn': applied anyway)",
                               count)
                self._reported = count
            trainer.log_scalar("train/nonfinite_steps", count)

    def _diagnosis(self, model: Any) -> str:
        loss = self.trainer.step_stats.backward_loss
        named = [(n, p.grad) for n, p in (model.named_parameters() if model is not None else []) if p.grad is not None]
        checks = [torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all().float() for _, g in named]
        checks.append(loss.float().reshape(()) if loss is not None else torch.zeros(()))
        device = checks[0].device
        values = torch.stack([c.to(device) for c in checks]).tolist()  # halting: one read for the report
        bad = [name for (name, _), finite in zip(named, values) if not finite]
        where = f"gradients of {len(bad)} parameter(s): {', '.join(bad[:12])}{' ...' if len(bad) > 12 else ''}" if bad else \
            "the gradients are finite on this rank"
        loss_text = f"loss {values[-1]:.4g}" if loss is not None else "no loss recorded"
        return (f"non-finite values at step {self.trainer.global_step + 1} (policy 'halt'): {loss_text}; {where}. "
                f"{_SUGGESTIONS}")

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive, "events": list(self.events),
                "nonfinite": float(self._nonfinite) if self._nonfinite is not None else 0.0}  # a read: checkpoints only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps, self.consecutive = int(state["skipped_steps"]), int(state["consecutive"])
        self.events = [tuple(e) for e in state["events"]]  # type: ignore[misc]
        self._nonfinite = torch.tensor(float(state["nonfinite"]), device=self.trainer.world.device)


_SUGGESTIONS = ("Try: a lower learning rate or a longer warm-up, gradient clipping (gradient_clip_val), "
                "bfloat16 instead of float16, checking the inputs for NaN/Inf, or a loss that cannot overflow "
                "(log-softmax, eps in divisions and logs).")
