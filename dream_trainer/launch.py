"""`entrypoint`: run a training `main()` in a plain process, under torchrun, or spawn N
local ranks with ``torch.distributed.run``.

The run's identity (experiment name, run name/directory, seed) is put in the environment
before the ranks start, so every rank agrees on it::

    from dream_trainer import entrypoint

    def main():
        DemoTrainer(config).fit()

    if __name__ == "__main__":
        entrypoint(main)          # python train.py --nproc 2   or   torchrun ... train.py

The process exits with the run's status however the script is written: 75 when preempted,
the failure's status when a rank failed (see `LaunchExit`). With requeue on, a preempted
SLURM job is requeued by its rank 0 under the rules of `RequeuePolicy`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dream_trainer.cluster import global_rank, in_slurm_step, slurm_job_id
from dream_trainer.exits import (
    EXIT_PREEMPTED,
    STOP_SIGNALS,
    Preemption,
    combined_exit_code,
    recorded_exit_codes,
    recorded_preemptions,
    signal_name,
)
from dream_trainer.restarts import restart_count
from dream_trainer.run_identity import ENV_EXPERIMENT, ENV_RUN_NAME, ENV_SEED, default_run_name

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_NPROC = "DREAM_TRAINER_NPROC"
ENV_LAUNCHER_PID = "DREAM_TRAINER_LAUNCHER_PID"
ENV_REQUEUE = "DREAM_TRAINER_REQUEUE"
ENV_REQUEUE_SIGNAL = "DREAM_TRAINER_REQUEUE_SIGNAL"
ENV_MAX_REQUEUES = "DREAM_TRAINER_MAX_REQUEUES"


@dataclass(frozen=True)
class RequeuePolicy:
    """When the rank 0 of a preempted run requeues its SLURM job (``scontrol requeue``).

    It requeues only when all of these hold; otherwise it logs why not, and the process
    still exits 75 (preempted):

    - the run stopped on `signal` (SIGUSR1 by default: ``#SBATCH --signal=USR1@90``). Any
      other stop signal stops and saves without a requeue: SIGTERM is what ``scancel``
      sends, so a cancelled job stays cancelled;
    - an optimizer step completed since this start (a run signalled before its first
      step would come back to the same point, requeued forever);
    - the job was requeued fewer than `max_requeues` times (``SLURM_RESTART_COUNT``;
      None: no cap).

    The decision is rank 0's alone, taken after ``fit()`` returned, from what it already
    holds: the signal the ranks agreed on (the same on every rank), whether a step was
    taken (the same on every rank) and the job's environment. No rank waits on it.

    Attributes:
        signal: the signal number that requeues.
        max_requeues: the most requeues of one job (None: no cap).
    """

    signal: int = int(signal.SIGUSR1)
    max_requeues: int | None = None

    @classmethod
    def resolve(cls, requeue_signal: str | int | None = None, max_requeues: int | None = None) -> RequeuePolicy:
        """From the arguments, else ``DREAM_TRAINER_REQUEUE_SIGNAL`` (``USR1``, ``SIGUSR1``
        or a number; one of `STOP_SIGNALS`) and ``DREAM_TRAINER_MAX_REQUEUES``."""
        raw = requeue_signal if requeue_signal is not None else os.environ.get(ENV_REQUEUE_SIGNAL) or "SIGUSR1"
        cap = max_requeues if max_requeues is not None else os.environ.get(ENV_MAX_REQUEUES) or None
        if cap is not None and (isinstance(cap, bool) or not str(cap).strip().isdigit()):
            raise ValueError(f"max_requeues (or ${ENV_MAX_REQUEUES})={cap!r} is invalid: expected an integer >= 0")
        return cls(_parse_signal(raw), None if cap is None else int(cap))

    def refusal(self, preemption: Preemption | None, requeues: int) -> str | None:
        """Why a preempted run is not requeued (None: requeue it), given how it stopped
        (None: no trainer recorded its preemption) and how many times its job was requeued."""
        if preemption is None:
            return "no preempted fit() was recorded in this process, so the stop signal is unknown"
        if preemption.signal != self.signal:
            why = f"it was stopped by {preemption.signal_name}, not by the requeue signal {signal_name(self.signal)}"
            return why + (" (scancel sends SIGTERM: a cancelled job is not requeued)"
                          if preemption.signal == signal.SIGTERM else "")
        if not preemption.progressed:
            return ("no optimizer step completed since this start (signalled before its first step): a requeued job "
                    "would come back to the same point")
        if self.max_requeues is not None and requeues >= self.max_requeues:
            return (f"the job was already requeued {requeues} time(s) (SLURM_RESTART_COUNT), max_requeues="
                    f"{self.max_requeues}")
        return None


def _parse_signal(raw: str | int) -> int:
    text = str(raw).strip().upper()
    try:
        signum = int(text) if text.isdigit() else int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except KeyError:
        signum = -1
    if signum not in STOP_SIGNALS:
        names = ", ".join(sig.name for sig in STOP_SIGNALS)
        raise ValueError(f"requeue signal (or ${ENV_REQUEUE_SIGNAL})={raw!r} is invalid: expected one of the stop "
                         f"signals {names}")
    return signum


def requeue_slurm_job() -> bool:
    """``scontrol requeue <job id>`` for the SLURM job this process runs in, from global
    rank 0 only: the requeued job starts again and resumes from the newest checkpoint.
    Returns whether a requeue was asked for (False, with a warning, outside SLURM or when
    ``scontrol`` fails)."""
    job = slurm_job_id()
    if global_rank() != 0:
        return False
    if not job:
        logger.warning("requeue on preemption was asked for, but this is not a SLURM job (no SLURM_JOB_ID): not requeued")
        return False
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("`scontrol requeue %s` failed: %s", job, detail)
        return False
    logger.warning("preempted: SLURM job %s requeued (it resumes from the newest checkpoint)", job)
    return True


class LaunchExit(SystemExit):
    """Raised by `entrypoint` when the run did not succeed: a rank failed or was preempted
    (in the process that spawned the ranks), or the ``fit()`` run by ``main`` did (in a
    rank, or a plain process). It is a ``SystemExit`` with the run's status as its code, so
    the process exits with 75 (preempted) or the failure's status even if the script ignores
    what `entrypoint` returns — torchrun, a job scheduler or the `--nproc` launcher never
    read a failed run as a success. Catch it to look at `result` before exiting.

    Attributes:
        result: the `LaunchResult` (per-rank exit codes) in the launcher; else None.
    """

    def __init__(self, code: int, result: LaunchResult | None = None):
        super().__init__(code)
        self.result = result


def is_launched() -> bool:
    """True inside a rank started by torchrun (or by `entrypoint`): torchrun's full set of
    variables (`dream_trainer.cluster.launch_source`); a partial set raises `ClusterError`
    here, before ``main()`` runs, naming what is missing."""
    from dream_trainer.cluster import launch_source

    return launch_source() == "torchrun"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc":
            if i + 1 >= len(argv):
                raise ValueError("--nproc needs a value (the number of local ranks)")
            nproc, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--nproc="):
            nproc, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    if nproc is None:
        return None, rest
    try:
        value = int(nproc)
    except ValueError:
        raise ValueError(f"--nproc={nproc!r} is invalid: expected a positive integer") from None
    if value < 1:
        raise ValueError(f"--nproc={value} is invalid: expected a positive integer")
    return value, rest


def entrypoint(
    main: Callable[[], T],
    *,
    nproc: int | None = None,
    experiment: str | None = None,
    seed: int | None = None,
    argv: list[str] | None = None,
    requeue: bool | None = None,
    requeue_signal: str | int | None = None,
    max_requeues: int | None = None,
) -> T | LaunchResult:
    """Run `main` once per rank.

    - Under torchrun (or in a rank this function spawned): call ``main()``.
    - With ``--nproc N`` on the command line, the ``DREAM_TRAINER_NPROC`` variable or
      `nproc` (in that order of precedence), N > 1: start N local ranks of this same script
      on 127.0.0.1 and a free port, wait for them and return a `LaunchResult` (see
      `_spawn`: signals are forwarded, a preempted rank never gets its peers killed).
    - Otherwise: call ``main()`` in this process and return its result.

    A run that did not succeed raises `LaunchExit` (a ``SystemExit`` with its status: 75
    when preempted, the failure's status when failed) in every process, the launcher too,
    however the script is written. ``raise SystemExit(entrypoint(main).exit_code)`` works as
    well: on success `entrypoint` returns ``main()``'s value (or the `LaunchResult`).

    ``--nproc`` is removed from ``sys.argv`` before ``main`` parses it. A run name
    (`default_run_name`), and `experiment`/`seed` when given, are exported so every rank
    agrees.

    Under ``srun`` (a SLURM step; see `dream_trainer.cluster` for the precedence) each task
    is a rank: ``main()`` runs at once. `requeue` (or ``DREAM_TRAINER_REQUEUE=1``): when
    the run was preempted by `requeue_signal` (``DREAM_TRAINER_REQUEUE_SIGNAL``; SIGUSR1,
    SLURM's ``--signal=USR1@90`` warning, by default) after at least one optimizer step,
    and its job was requeued fewer than `max_requeues` times (``DREAM_TRAINER_MAX_REQUEUES``;
    no cap by default), rank 0 requeues the SLURM job (`requeue_slurm_job`) before exiting
    with status 75; otherwise it says why not (`RequeuePolicy`). Invalid values fail here.
    """
    if requeue is None:
        requeue = os.environ.get(ENV_REQUEUE, "") not in ("", "0")
    policy = RequeuePolicy.resolve(requeue_signal, max_requeues) if requeue else None
    if is_launched() or in_slurm_step():
        _die_with_launcher()
        return _run_main(main, policy)
    args = list(sys.argv[1:] if argv is None else argv)
    cli_nproc, rest = _pop_nproc(args)
    env_nproc = os.environ.get(ENV_NPROC)
    if cli_nproc is not None:
        nproc = cli_nproc
    elif env_nproc:
        nproc, _ = _pop_nproc(["--nproc", env_nproc])
    if argv is None:
        sys.argv[1:] = rest
    os.environ.setdefault(ENV_RUN_NAME, default_run_name())
    if experiment is not None:
        os.environ.setdefault(ENV_EXPERIMENT, experiment)
    if seed is not None:
        os.environ.setdefault(ENV_SEED, str(seed))
    if nproc is None or nproc == 1:
        return _run_main(main, policy)
    if policy is not None:  # the ranks' rank 0 requeues (once: not this launcher too)
        os.environ.update({ENV_REQUEUE: "1", ENV_REQUEUE_SIGNAL: str(policy.signal)})
        if policy.max_requeues is not None:
            os.environ[ENV_MAX_REQUEUES] = str(policy.max_requeues)
    result = _spawn(nproc, rest)
    if result.exit_code != 0:
        raise LaunchExit(result.exit_code, result)
    return result


def _run_main(main: Callable[[], T], requeue: RequeuePolicy | None = None) -> T:
    """``main()``, then `LaunchExit` when a ``fit()`` it ran (or the trainer it returned)
    did not succeed: a preempted run exits 75 and a failed one non-zero, even when the
    script drops the status (a failure that ``main`` caught included). A preempted run
    with a `requeue` policy requeues its SLURM job first when the policy allows (rank 0)."""
    first, first_preemption = len(recorded_exit_codes()), len(recorded_preemptions())
    value = main()
    codes = list(recorded_exit_codes()[first:])
    returned = getattr(value, "exit_code", None)
    if isinstance(returned, int) and not isinstance(returned, bool):
        codes = [*codes, returned]
    code = combined_exit_code(codes)
    if code == EXIT_PREEMPTED and requeue is not None:
        requeue_if_due(requeue, recorded_preemptions()[first_preemption:])
    if code != 0:
        raise LaunchExit(code)
    return value


def requeue_if_due(policy: RequeuePolicy, preemptions: tuple[Preemption, ...]) -> bool:
    """On global rank 0 only (the other ranks return False at once): requeue the SLURM job
    (`requeue_slurm_job`) when `policy` allows it for the last of `preemptions` (those of
    this ``main()``), else log why not. A local decision after the run stopped: nothing here
    talks to the other ranks. Returns whether a requeue was asked for."""
    if global_rank() != 0:
        return False
    why = policy.refusal(preemptions[-1] if preemptions else None, restart_count().get("SLURM_RESTART_COUNT", 0))
    if why is not None:
        logger.warning("preempted: not requeued: %s; the process exits %d (preempted)", why, EXIT_PREEMPTED)
        return False
    return requeue_slurm_job()


@dataclass(frozen=True)
class LaunchResult:
    """What `entrypoint` returns in the process that spawned the ranks (``--nproc N``).

    Attributes:
        exit_codes: each rank's exit status, by rank (a rank killed by signal S: ``128 + S``).
    """

    exit_codes: tuple[int, ...]

    @property
    def exit_code(self) -> int:
        """The status for the launcher to exit with: 0 when every rank succeeded, the
        first failed rank's status when one failed, else `EXIT_PREEMPTED` (75: a rank was
        preempted and every rank checkpointed or succeeded). `entrypoint` raises
        `LaunchExit` with it when it is not 0."""
        return combined_exit_code(self.exit_codes)


def _spawn(nproc: int, script_args: list[str], grace_s: float = 30.0) -> LaunchResult:
    """Start `nproc` ranks of this script on 127.0.0.1 and wait for all of them.

    - SIGTERM/SIGINT/SIGUSR1/SIGUSR2 to this process is forwarded to every rank, once per signal (the
      ranks run in their own session, so a terminal's Ctrl-C reaches them only this way;
      on Linux a rank also gets SIGTERM if this process dies).
    - A rank exiting with `EXIT_PREEMPTED` (75) does not disturb the others: they finish
      committing their checkpoint. A rank that fails (any other non-zero status) gives the
      others `grace_s` to end by themselves (they normally fail at once: a failed rank
      releases its peers), then they get SIGTERM, then SIGKILL after another `grace_s`.
    """
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["-m", spec.name.removesuffix(".__main__")]
    else:
        target = [os.path.abspath(sys.argv[0])]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", **{ENV_LAUNCHER_PID: str(os.getpid())})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, *target, *script_args], env=rank_env, start_new_session=True))
        codes = _wait_all(procs, grace_s)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for proc in procs:  # this process is being interrupted: end every rank
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = LaunchResult(tuple(codes))
    for rank, code in enumerate(codes):
        if code not in (0, EXIT_PREEMPTED):
            logger.error("rank %d exited with status %d", rank, code)
    return result


def _wait_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> list[int]:
    codes: list[int | None] = [None] * len(procs)
    failed_at: float | None = None
    signalled = 0  # 0: none sent, 1: SIGTERM sent, 2: SIGKILL sent
    while None in codes:
        for rank, proc in enumerate(procs):
            if codes[rank] is None and (code := proc.poll()) is not None:
                codes[rank] = 128 - code if code < 0 else code
                if codes[rank] not in (0, EXIT_PREEMPTED) and failed_at is None:
                    failed_at = time.monotonic()
        if failed_at is not None and signalled < 2 and time.monotonic() - failed_at > grace_s * (signalled + 1):
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM if signalled == 0 else signal.SIGKILL)
            signalled += 1
        time.sleep(0.05)
    return [int(code) for code in codes]  # type: ignore[arg-type]


def _die_with_launcher() -> None:
    """In a rank started by `_spawn` (Linux): get SIGTERM when the launcher dies, so no rank
    is orphaned (it checkpoints and exits like a preempted run)."""
    launcher = os.environ.pop(ENV_LAUNCHER_PID, None)  # not for this rank's own children
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGTERM)
