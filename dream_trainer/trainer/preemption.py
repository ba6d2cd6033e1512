"""`PreemptionMixin`: SIGTERM/SIGINT become a clean stop at the next step boundary, agreed
on by every rank. A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch

from dream_trainer.trainer.abstract import AbstractTrainer

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""`BaseTrainer.exit_code` of a preempted run (``EX_TEMPFAIL``: stopped early, resumable)."""


class TrainingInterrupted(BaseException):
    """Stops `fit()` on SIGTERM/SIGINT. At a step boundary (the first signal) the run is
    preempted: `on_interrupt` runs (the checkpoint callback saves), `fit()` returns with
    ``status == "preempted"``. A second signal raises it at once, out of `fit()`."""

    def __init__(self, reason: str, at_step_boundary: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.at_step_boundary = at_step_boundary


class PreemptionMixin(AbstractTrainer):
    """Signal handling for `fit()`."""

    status: str
    _signal: int | None
    _signal_work: Any

    def _install_signal_handlers(self) -> Any:
        """SIGTERM and SIGINT ask for a stop at the next step boundary (checkpointed by the
        checkpoint callback in `on_interrupt`); a second signal raises at once."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        self._signal = None

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None or self.status != "running":
                raise TrainingInterrupted(f"received signal {signal.Signals(signum).name} again")
            self._signal = signum
            logger.warning("received %s: stopping at the next step boundary", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(sig, old) for sig, old in previous.items()]

    def _signal_name(self) -> str:
        return signal.Signals(self._signal).name if self._signal is not None else "on another rank"

    def _signal_agreed(self) -> bool:
        """Whether every rank stops at this step boundary. One rank: the local flag. Several:
        each boundary starts an async MAX all-reduce of the local flag on the CPU and reads
        the one started at the previous boundary, so all ranks stop at the same step without
        blocking on a collective (a signal is acted on one step later)."""
        if self.world.world_size == 1:
            return self._signal is not None
        import torch.distributed as dist

        agreed = False
        if self._signal_work is not None:
            work, flag = self._signal_work
            work.wait()  # started a step ago: done by now (CPU tensor, no device sync)
            agreed = bool(flag.item())
        flag = torch.tensor([0 if self._signal is None else 1], dtype=torch.int32)
        self._signal_work = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return agreed

    def _drain_signal_check(self) -> None:
        if self._signal_work is not None:
            self._signal_work[0].wait()
            self._signal_work = None
