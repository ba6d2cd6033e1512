"""`PreemptionMixin`: decisions that change control flow — a signal (SIGTERM/SIGINT), a
stop requested by a callback (`StopTraining`, `request_stop`), disabling a failing
non-critical callback — taken on any rank and acted on by every rank at the same point.
A mixin of `BaseTrainer` (no ``__init__``; its attributes are set there).

Each rank keeps local flags; the ranks agree on them with one MAX all-reduce of a small CPU
tensor. At step boundaries it is non-blocking: each boundary starts the all-reduce and
reads the one started at the previous boundary (no host wait; a request is acted on one
step later). At rarer points (before the loop, after a validation run, at an epoch's end,
at the end of the loop) the check is blocking, so a request made there is acted on at once.
With one rank the local flags are the decision.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Any

import torch

from dream_trainer.protocol.base import StopTraining
from dream_trainer.launch import EXIT_PREEMPTED
from dream_trainer.trainer.abstract import AbstractTrainer

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
"""`BaseTrainer.exit_code` of a failed run."""

SIGNAL_REPEAT_WINDOW_S = 1.0
"""A repeat of the first SIGTERM/SIGINT within this many seconds is the same delivery."""

_SIGNAL, _STOP, _DISABLE = 0, 1, 2  # positions in the agreed flag tensor


class TrainingInterrupted(BaseException):
    """Stops `fit()` on SIGTERM/SIGINT. At a step boundary (the first signal) the run is
    preempted: `on_interrupt` runs (the checkpoint callback saves), `fit()` returns with
    ``status == "preempted"``. A second signal raises it at once, out of `fit()`.

    Attributes:
        signal: the signal number (None when the signal arrived on another rank).
    """

    def __init__(self, reason: str, at_step_boundary: bool = False, signum: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.at_step_boundary = at_step_boundary
        self.signal = signum


class PreemptionMixin(AbstractTrainer):
    """Signal handling and agreed stop/disable decisions for `fit()`."""

    status: str
    _signal: int | None
    _stop_request: str | None
    _disable_requests: dict[str, str]
    _flag_work: Any

    # ------------------------------------------------------------------ requests
    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask every rank to stop: the run ends at the next agreed point (see
        `StopTraining`) with ``status == "stopped"`` on every rank. Safe to call on one
        rank only, from a hook or from ``training_step``; the first reason wins."""
        if self._stop_request is None:
            self._stop_request = str(reason)
            logger.info("stop requested at step %d: %s", self.global_step, reason)

    def request_disable(self, name: str, why: str) -> None:
        """Disable callback `name` on every rank at the next agreed point (called by the
        callback collection for a non-critical callback that keeps failing)."""
        self._disable_requests.setdefault(name, why)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank has asked to stop (not yet acted on)."""
        return self._stop_request is not None

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> Any:
        """SIGTERM and SIGINT ask for a stop at the next step boundary (checkpointed by the
        checkpoint callback in `on_interrupt`); a second signal raises at once. The same
        signal repeated within `SIGNAL_REPEAT_WINDOW_S` of the first is one delivery, not a
        second signal: a process can get one signal twice (a scheduler signalling the
        process group and a launcher forwarding it; the parent-death signal once per thread
        of a killed launcher)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        self._signal = None
        first: dict[int, float] = {}

        def handler(signum: int, frame: Any) -> None:
            now = time.monotonic()
            if now - first.get(signum, -math.inf) < SIGNAL_REPEAT_WINDOW_S:
                return
            if self._signal is not None or self.status != "running":
                raise TrainingInterrupted(f"received signal {signal.Signals(signum).name} again", signum=signum)
            first[signum] = now
            self._signal = signum
            logger.warning("received %s: stopping at the next step boundary", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(sig, old) for sig, old in previous.items()]

    # ------------------------------------------------------------------ agreement
    def _local_flags(self) -> list[int]:
        return [int(self._signal is not None), int(self._stop_request is not None), int(bool(self._disable_requests))]

    def _agreed_flags(self, blocking: bool) -> list[int]:
        """The flags of every rank, OR-ed. Non-blocking: those sent at the previous call
        (the current ones are sent now); blocking: those and the current ones."""
        if self.world.world_size == 1:
            return self._local_flags()
        import torch.distributed as dist

        agreed = [0, 0, 0]
        if self._flag_work is not None:
            work, flag = self._flag_work
            self._flag_work = None
            work.wait()  # started a step ago: done by now (a CPU tensor, no device sync)
            agreed = flag.tolist()
        flag = torch.tensor(self._local_flags(), dtype=torch.int32)
        if blocking:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return [max(a, b) for a, b in zip(agreed, flag.tolist())]
        self._flag_work = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return agreed

    def _control_point(self, blocking: bool = True) -> None:
        """Act on what the ranks agreed: disable failing callbacks, then raise
        `TrainingInterrupted` (a signal) or `StopTraining` (a stop request)."""
        flags = self._agreed_flags(blocking)
        if not any(flags):
            return
        world = self.world
        if flags[_DISABLE]:
            requests = world.all_gather_object(dict(self._disable_requests))
            self._disable_requests.clear()
            for name, why in sorted({k: v for r in requests for k, v in r.items()}.items()):
                self.callbacks.disable(name, why)
        if flags[_SIGNAL]:
            name = signal.Signals(self._signal).name if self._signal is not None else "a signal on another rank"
            raise TrainingInterrupted(f"received {name}", at_step_boundary=True, signum=self._signal)
        if flags[_STOP]:
            reasons = [r for r in world.all_gather_object(self._stop_request) if r is not None]
            self._stop_request = None
            raise StopTraining(reasons[0] if reasons else "stop requested")

    def _drain_control(self) -> None:
        """Finish the agreement in flight (end of the loop, or before the lifecycle goes
        on after a stop), so no collective is left pending."""
        if self._flag_work is not None:
            self._flag_work[0].wait()
            self._flag_work = None
