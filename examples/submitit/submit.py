"""Submit the GPT demo with submitit: to SLURM on a cluster, or to submitit's local executor
(processes on this machine) anywhere else.

    # 2 nodes x 8 GPUs on SLURM, HSDP; the demo's own flags after `--`
    python examples/submitit/submit.py --nodes 2 --tasks-per-node 8 --gpus-per-node 8 \\
        --partition gpu --timeout-min 240 -- --parallel hsdp --steps 5000
    # 2 processes on this machine (submitit's local executor)
    python examples/submitit/submit.py --executor local --tasks-per-node 2 -- --steps 50

Each task is one rank: submitit's ``TorchDistributedEnvironment`` exports the rank, the world
and the first host for torch's ``env://``, and dream_trainer reads them like torchrun's.

**Preemption** follows submitit's checkpoint protocol with dream_trainer's agreed save.
submitit asks SLURM for a warning signal (SIGUSR2, ``signal_delay_s`` before the time limit)
and, on it, calls the job's ``checkpoint()`` and requeues the job. While the demo trains, the
trainer's handler holds SIGUSR2 instead: every rank stops at the same step boundary and saves.
Once the run has stopped as preempted, the job hands over to submitit's handler (rank 0
calls ``checkpoint()``, which resubmits this same job, and requeues; the other ranks return).
The requeued job runs again under the same run name (the job id), so it resumes from that
checkpoint. The submission itself is a pickle submitit writes and reads back for you, from
your own job folder; the checkpoints hold no pickles (see docs/checkpointing.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import submitit

GPT_DIR = Path(__file__).resolve().parents[1] / "gpt"


class DemoJob(submitit.helpers.Checkpointable):
    """The GPT demo as a submitit job (``checkpoint()``, from `Checkpointable`, resubmits it
    with the same arguments)."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __call__(self) -> int:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        job = submitit.JobEnvironment()
        sys.path.insert(0, str(GPT_DIR))
        from train import main  # examples/gpt/train.py

        argv = self.argv if "--run-name" in self.argv else [*self.argv, "--run-name", f"submitit-{job.job_id}"]
        trainer = main(argv)
        if trainer.status == "preempted":
            submitit_handler: Any = signal.getsignal(signal.SIGUSR2)  # restored by the trainer after fit
            if callable(submitit_handler):
                submitit_handler(signal.SIGUSR2, None)  # rank 0: checkpoint() and requeue (it exits)
        if trainer.status == "failed":
            raise RuntimeError(f"rank {job.global_rank}: the run failed (see the log above)")
        return trainer.exit_code


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    demo = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executor", choices=["auto", "local"], default="auto",
                   help="auto: SLURM when sbatch is available, else local processes; local: always local")
    p.add_argument("--folder", default="submitit_logs", help="submitit's job folder (logs, the submission)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node (one per GPU)")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--partition", default=None)
    p.add_argument("--timeout-min", type=float, default=60)
    p.add_argument("--signal-delay-s", type=int, default=90, help="the warning before the time limit")
    p.add_argument("--no-wait", action="store_true", help="submit and return (print the job id)")
    return p.parse_args(own), demo


def submit(args: argparse.Namespace, demo_argv: list[str]) -> submitit.Job[int]:
    folder = Path(args.folder) / "%j"
    executor: Any = (submitit.LocalExecutor(folder=folder) if args.executor == "local"
                     else submitit.AutoExecutor(folder=folder))
    executor.update_parameters(timeout_min=args.timeout_min, tasks_per_node=args.tasks_per_node, nodes=args.nodes)
    if args.executor == "local":
        executor.update_parameters(signal_delay_s=args.signal_delay_s)
        if args.nodes != 1:
            raise ValueError(f"--nodes {args.nodes}: submitit's local executor runs one node; use --nodes 1")
    else:
        executor.update_parameters(slurm_signal_delay_s=args.signal_delay_s, gpus_per_node=args.gpus_per_node,
                                   **({"slurm_partition": args.partition} if args.partition else {}))
    return executor.submit(DemoJob(demo_argv))


def main(argv: list[str] | None = None) -> int:
    args, demo_argv = parse_args(argv)
    job = submit(args, demo_argv)
    print(f"submitted job {job.job_id} (logs under {args.folder}/{job.job_id})", flush=True)
    if args.no_wait:
        return 0
    results = job.results()  # every task's; raises when a task failed
    print(f"job {job.job_id} done: exit codes {results}")
    return max(results, default=0)


if __name__ == "__main__":
    raise SystemExit(main())
