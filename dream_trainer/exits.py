"""Exit codes and stop signals: what a run's process exits with, and the signals that stop
it. A leaf (it imports nothing of the house), read by the trainer (its `exit_code`, its
signal handlers) and by the launcher (`dream_trainer.launch`: the status it exits with, the
signals it forwards), so neither imports the other for them."""

from __future__ import annotations

import signal
from dataclasses import dataclass

EXIT_PREEMPTED = 75
"""The exit status of a preempted run (``EX_TEMPFAIL``: stopped early, checkpointed, resumable)."""

EXIT_FAILED = 1
"""The exit status of a failed run."""

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that stop a run at the next step boundary (a checkpoint, then exit status 75):
a scheduler's preemption (SIGTERM), Ctrl-C (SIGINT), SLURM's warning before the time limit
(``#SBATCH --signal=USR1@90``) and submitit's (SIGUSR2: while a run trains, the trainer's
handler replaces submitit's and restores it afterwards; see examples/submitit). The trainer
handles them; the ``--nproc`` launcher forwards them."""

_fit_statuses: list[int] = []  # exit codes of the fit() calls of this process, in order
_preemptions: list[Preemption] = []  # the preempted fit() calls of this process, in order


@dataclass(frozen=True)
class Preemption:
    """A ``fit()`` that stopped as preempted, as the requeue decision reads it.

    Attributes:
        signal: the stop signal every rank acted on (the same on every rank; None: unknown).
        progressed: whether an optimizer step completed in that ``fit()`` (after its resume).
    """

    signal: int | None
    progressed: bool

    @property
    def signal_name(self) -> str:
        """``"SIGUSR1"``, ... (``"an unknown signal"`` when None)."""
        return signal_name(self.signal) if self.signal else "an unknown signal"


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; the number itself for a signal Python has no name for."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def exit_code_for(status: str) -> int:
    """The process exit status a run's final status asks for: `EXIT_PREEMPTED` (75) for
    ``"preempted"``, `EXIT_FAILED` (1) for ``"failed"``, else 0 (completed, stopped)."""
    return {"preempted": EXIT_PREEMPTED, "failed": EXIT_FAILED}.get(status, 0)


def record_exit_code(code: int) -> None:
    """Record the exit code a finished ``fit()`` asks for (`BaseTrainer.fit` calls it on
    every path), so `dream_trainer.entrypoint` exits with it even when the script drops it."""
    _fit_statuses.append(int(code))


def recorded_exit_codes() -> tuple[int, ...]:
    """The exit codes recorded by `record_exit_code` in this process so far, in order."""
    return tuple(_fit_statuses)


def combined_exit_code(codes: list[int] | tuple[int, ...]) -> int:
    """One status for several: the first failure (not 0, not `EXIT_PREEMPTED`), else
    `EXIT_PREEMPTED` when any was preempted, else 0."""
    failed = [code for code in codes if code not in (0, EXIT_PREEMPTED)]
    if failed:
        return failed[0]
    return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0


def record_preemption(signum: int | None, progressed: bool) -> None:
    """Record a ``fit()`` that stopped as preempted (`BaseTrainer` calls it once its
    preemption checkpoint is saved): `dream_trainer.entrypoint` reads it to decide, on rank
    0, whether to requeue the job."""
    _preemptions.append(Preemption(int(signum) if signum else None, bool(progressed)))


def recorded_preemptions() -> tuple[Preemption, ...]:
    """The preemptions recorded by `record_preemption` in this process so far, in order."""
    return tuple(_preemptions)
