"""`ControlPlane`: decisions that change control flow — a signal (`exits.STOP_SIGNALS`), a stop
requested by a callback (`StopTraining`, ``trainer.request_stop``), disabling a failing
non-critical callback — taken on any rank and acted on by every rank at the same point.

It owns the requests of this rank and the agreement in flight, and nothing else: the world
and the callbacks are passed to `decide` by the trainer. The ranks agree with one MAX
all-reduce of a small CPU tensor. At step boundaries it is non-blocking: each boundary
starts the all-reduce and reads the one started at the previous boundary (no host wait; a
request is acted on one step later). At rarer points (before the loop, after a validation
run, at an epoch's end, at the end of the loop) the check is blocking, so a request made
there is acted on at once. With one rank the local requests are the decision.

Requests are transient (nothing here goes into a checkpoint): a run resumed after a
preemption starts with none.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from dream_trainer.exits import STOP_SIGNALS
from dream_trainer.protocol.base import StopTraining

logger = logging.getLogger(__name__)

SIGNAL_REPEAT_WINDOW_S = 1.0
"""A repeat of the first SIGTERM/SIGINT within this many seconds is the same delivery."""

_SIGNAL, _STOP, _DISABLE = 0, 1, 2  # positions in the agreed flag tensor


class TrainingInterrupted(BaseException):
    """Stops `fit()` on SIGTERM/SIGINT. At a step boundary (the first signal) the run is
    preempted: `on_interrupt` runs (the checkpoint callback saves), `fit()` returns with
    ``status == "preempted"``. A second signal raises it at once, out of `fit()`.

    Attributes:
        signal: the signal number (None when the signal arrived on another rank).
        agreed_signal: at a step boundary, the signal every rank acts on, the same on every
            rank (the highest-numbered one when ranks got different ones: SIGTERM over
            SIGUSR1); else `signal`. The requeue decision reads it (`dream_trainer.launch`).
    """

    def __init__(self, reason: str, at_step_boundary: bool = False, signum: int | None = None,
                 agreed_signal: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.at_step_boundary = at_step_boundary
        self.signal = signum
        self.agreed_signal = signum if agreed_signal is None else agreed_signal


class _Tracker(Protocol):
    """What the control plane needs of the world's `CollectiveTracker` (the hang watchdog reads it)."""

    def region(self, name: str) -> AbstractContextManager[Any]: ...

    def between_steps(self) -> None: ...


class _World(Protocol):
    """What the control plane needs of the world."""

    world_size: int
    collectives: _Tracker

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class _Disabler(Protocol):
    """What the control plane needs of the callbacks."""

    def disable(self, name: str, why: str) -> None: ...


class ControlPlane:
    """This rank's control requests and their agreement with the other ranks.

    Attributes:
        signal: the SIGTERM/SIGINT received and not yet acted on (None: none).
        stop_request: the first reason this rank asked to stop for (None: none).
        disable_requests: ``{callback name: why}`` to disable at the next agreed point.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.stop_request: str | None = None
        self.disable_requests: dict[str, str] = {}
        self._work: tuple[Any, torch.Tensor] | None = None  # the agreement in flight

    def reset(self) -> None:
        """Forget every request and the agreement in flight (a new `fit()`)."""
        self.signal = self.stop_request = self._work = None
        self.disable_requests = {}

    # ------------------------------------------------------------------ requests
    def request_stop(self, reason: str) -> bool:
        """Ask every rank to stop at the next agreed point; the first reason wins. Returns
        whether this request is the first."""
        if self.stop_request is not None:
            return False
        self.stop_request = str(reason)
        return True

    def request_disable(self, name: str, why: str) -> None:
        """Disable callback `name` on every rank at the next agreed point."""
        self.disable_requests.setdefault(name, why)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank has asked to stop (not yet acted on)."""
        return self.stop_request is not None

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self, running: Callable[[], bool]) -> Callable[[], None]:
        """The stop signals (`exits.STOP_SIGNALS`) ask for a stop at the next step boundary; a second signal (or
        one while not `running`) raises `TrainingInterrupted` at once. The same signal
        repeated within `SIGNAL_REPEAT_WINDOW_S` of the first is one delivery, not a second
        signal: a process can get one signal twice (a scheduler signalling the process group
        and a launcher forwarding it; the parent-death signal once per thread of a killed
        launcher). Returns the function that restores the previous handlers (a no-op off
        the main thread, where handlers cannot be installed)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        self.signal = None
        first: dict[int, float] = {}

        def handler(signum: int, frame: Any) -> None:
            now = time.monotonic()
            if now - first.get(signum, -math.inf) < SIGNAL_REPEAT_WINDOW_S:
                return
            if self.signal is not None or not running():
                raise TrainingInterrupted(f"received signal {signal.Signals(signum).name} again", signum=signum)
            first[signum] = now
            self.signal = signum
            logger.warning("received %s: stopping at the next step boundary", signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore

    # ------------------------------------------------------------------ agreement
    def local_flags(self) -> list[int]:
        """This rank's requests as ``[signal, stop, disable]`` flags (signal: its number, 0: none)."""
        return [int(self.signal or 0), int(self.stop_request is not None), int(bool(self.disable_requests))]

    def agreed_flags(self, world: _World, blocking: bool) -> list[int]:
        """The flags of every rank, OR-ed. Non-blocking: those sent at the previous call
        (the current ones are sent now); blocking: those and the current ones."""
        if world.world_size == 1:
            return self.local_flags()
        import torch.distributed as dist

        agreed = [0, 0, 0]
        with world.collectives.region("control point: the ranks' agreement on stop requests and signals"):
            if self._work is not None:
                work, flag = self._work
                self._work = None
                work.wait()  # started a step ago: done by now (a CPU tensor, no device sync)
                agreed = flag.tolist()
            flag = torch.tensor(self.local_flags(), dtype=torch.int32)
            if blocking:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                agreed = [max(a, b) for a, b in zip(agreed, flag.tolist())]
            else:
                self._work = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        world.collectives.between_steps()
        return agreed

    def decide(self, world: _World, callbacks: _Disabler, blocking: bool = True) -> None:
        """Act on what the ranks agreed: disable failing callbacks, then raise
        `TrainingInterrupted` (a signal) or `StopTraining` (a stop request)."""
        if world.world_size == 1:  # nothing to agree on: act on this rank's requests, if any
            if self.signal is None and self.stop_request is None and not self.disable_requests:
                return
            flags = self.local_flags()
        else:
            flags = self.agreed_flags(world, blocking)
        if not any(flags):
            return
        if flags[_DISABLE]:
            requests = world.all_gather_object(dict(self.disable_requests))
            self.disable_requests.clear()
            for name, why in sorted({k: v for r in requests for k, v in r.items()}.items()):
                callbacks.disable(name, why)
        if flags[_SIGNAL]:
            agreed = int(flags[_SIGNAL])  # the same number on every rank (MAX of the ranks' signals)
            name = signal.Signals(self.signal).name if self.signal is not None else "a signal on another rank"
            raise TrainingInterrupted(f"received {name}", at_step_boundary=True, signum=self.signal,
                                      agreed_signal=agreed)
        if flags[_STOP]:
            reasons = [r for r in world.all_gather_object(self.stop_request) if r is not None]
            self.stop_request = None
            raise StopTraining(reasons[0] if reasons else "stop requested")

    def drain(self) -> None:
        """Finish the agreement in flight (end of the loop, or before the lifecycle goes
        on after a stop), so no collective is left pending."""
        if self._work is not None:
            self._work[0].wait()
            self._work = None

    def drop(self) -> None:
        """Forget the agreement in flight without waiting (a failed run: a peer may be gone)."""
        self._work = None
