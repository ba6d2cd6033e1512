"""A run's identity (experiment name, run name/directory, seed) as every rank reads it from
the environment, and the default run name. Used by the trainer (its run name and directory)
and by the launcher (which exports the identity before the ranks start); it imports only the
cluster environment (a leaf) and, when reading names back, the config's name check."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from dream_trainer.cluster import slurm_job_id

logger = logging.getLogger(__name__)

ENV_EXPERIMENT = "DREAM_TRAINER_EXPERIMENT"
ENV_RUN_NAME = "DREAM_TRAINER_RUN_NAME"
ENV_RUN_DIR = "DREAM_TRAINER_RUN_DIR"
ENV_SEED = "DREAM_TRAINER_SEED"


def default_run_name() -> str:
    """A run's name when none is given, the same on every node and again after a restart,
    so a restarted run resumes itself: ``slurm-<job id>`` inside a SLURM job (also after a
    requeue), ``torchrun-<rdzv id>`` under torchrun with a rendezvous id (``--rdzv-id``, or
    ``--standalone``'s own: torchelastic's restarts keep it), else a timestamp — with a
    warning under ``torchrun --max-restarts``, whose restarted ranks would then start a new
    run."""
    job = slurm_job_id()
    if job:
        return f"slurm-{job}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        logger.warning("torchrun --max-restarts without --rdzv-id and without a run name: a restarted group gets a "
                       "new timestamped run name and starts over instead of resuming; pass --rdzv-id or a run name")
    return time.strftime("%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class RunIdentity:
    """What every rank of a run must agree on; read from the environment."""

    experiment: str | None
    run_name: str | None
    run_dir: str | None
    seed: int | None

    @classmethod
    def from_env(cls) -> RunIdentity:
        """Read back from the environment: the names are checked like the config's (they
        become directories under the root)."""
        from dream_trainer.configs import check_name

        seed = os.environ.get(ENV_SEED)
        experiment, run_name = os.environ.get(ENV_EXPERIMENT) or None, os.environ.get(ENV_RUN_NAME) or None
        for env, value in ((ENV_EXPERIMENT, experiment), (ENV_RUN_NAME, run_name)):
            if value is not None:
                check_name(f"${env}", value)
        return cls(
            experiment=experiment,
            run_name=run_name,
            run_dir=os.environ.get(ENV_RUN_DIR) or None,
            seed=int(seed) if seed else None,
        )
