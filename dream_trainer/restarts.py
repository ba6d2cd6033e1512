"""A restarted run: which attempt of its job this is, where its earlier attempts committed
checkpoints, and what a restart checks before it trains. Read by the checkpoint callback
(on rank 0, which sends its decision to every rank) and by the launcher (its requeue rules).

- `restart_count`: ``SLURM_RESTART_COUNT`` (a requeued SLURM job) and
  ``TORCHELASTIC_RESTART_COUNT`` (a torchelastic restart), set for the whole job.
- The resume record, ``<run_dir>/resume.json``: where the run's checkpoints go, the newest
  committed step and the host that committed it. Rank 0 writes it when the run starts and
  after each commit (`note_checkpoints`).
- `missing_checkpoint`: why a run that finds no checkpoint must not start from step 0.
- `node_local_reason`: why a checkpoint root looks node-local (`NODE_LOCAL_DIRS`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from dream_trainer.cluster import slurm_job_id
from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

RESUME_RECORD = "resume.json"
RESTART_VARS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/scratch/local")
"""A checkpoint root under one of these, or under ``$TMPDIR`` or ``$SLURM_TMPDIR``, looks
node-local (`node_local_reason`)."""
NODE_LOCAL_VARS = ("TMPDIR", "SLURM_TMPDIR")

_warned_roots: set[str] = set()


def restart_count() -> dict[str, int]:
    """How many times this job was restarted, by the variable that says so: ``{var: n}``
    for each of `RESTART_VARS` above 0 (empty: a first attempt). The scheduler sets them for
    the whole job, so every rank reads the same."""
    counts = {}
    for var in RESTART_VARS:
        try:
            count = int(os.environ.get(var) or 0)
        except ValueError:
            count = 0
        if count > 0:
            counts[var] = count
    return counts


def read_resume_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run directory's resume record, or None (none, or unreadable: a warning)."""
    path = Path(run_dir) / RESUME_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("resume record %s cannot be read (%s): ignored", path, exc)
        return None
    return record if isinstance(record, dict) else None


def note_checkpoints(run_dir: str | Path, root: str | Path, step: int | None) -> None:
    """Record in the run directory that this run's checkpoints go to `root` and, with
    `step`, that the checkpoint of that step was committed there by this host. Without
    `step` (the run starts) an existing record is kept. Rank 0 only; atomic; never raises
    (a failure is a warning: it must not make rank 0 differ from the others)."""
    path = Path(run_dir) / RESUME_RECORD
    try:
        if step is None and path.exists():
            return
        record = {"checkpoint_root": os.path.abspath(root), "step": step, "host": socket.gethostname(),
                  "time": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RESUME_RECORD}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write the resume record %s: %s", path, exc)


def missing_checkpoint(run_dir: str | Path, roots: list[Path], host: str) -> str | None:
    """Why a run that found no checkpoint under `roots` must not start from step 0, or None
    (nothing says an earlier attempt committed one there). It must not when:

    - the run directory's resume record says that a checkpoint was committed under one of
      `roots` (a record naming another root is of a run pointed elsewhere since), or
    - the job is a restart (`restart_count`) and the run directory has no resume record
      (it went too: a node-local run directory on another node). A restart whose record
      says that no checkpoint was committed yet starts from step 0.
    """
    record = read_resume_record(run_dir)
    here = {os.path.abspath(root) for root in roots}
    if record is not None and record.get("step") is not None and record.get("checkpoint_root") in here:
        why = (f"its earlier attempt committed the checkpoint of step {record['step']} under "
               f"{record.get('checkpoint_root')} on host {record.get('host')} ({Path(run_dir) / RESUME_RECORD})")
    elif record is None and (restarts := restart_count()):
        counts = ", ".join(f"{var}={count}" for var, count in restarts.items())
        why = (f"this job is a restart ({counts}) and the run directory {run_dir} has no resume record "
               f"({RESUME_RECORD}) of its earlier attempt either")
    else:
        return None
    where = ", ".join(str(root) for root in roots) or "(no root)"
    return (f"no checkpoint to resume from under {where} on host {host}, but {why}. The checkpoints are gone or not "
            "visible from this node (a node-local checkpoint root or run directory, such as /tmp?); starting from "
            "step 0 would silently drop the run's progress. Put the run on storage every node shares "
            "(TrainerConfig(root_dir=...) or CheckpointParameters(root_dir=...)), or set "
            "CheckpointParameters(allow_fresh_restart=True) to start over")


def fresh_start_refusal(run_dir: str | Path, roots: list[Path], allow_fresh_restart: bool) -> CheckpointError | None:
    """For the rank that found no checkpoint under `roots` (rank 0, which sends its choice to
    every rank): the `CheckpointError` of `missing_checkpoint`, naming this host, or None (a
    warning instead with `allow_fresh_restart`)."""
    why = missing_checkpoint(run_dir, roots, socket.gethostname())
    if why is not None and allow_fresh_restart:
        logger.warning("%s. allow_fresh_restart=True: starting from step 0", why)
        return None
    return None if why is None else CheckpointError(why)


def node_local_reason(root: str | Path) -> str | None:
    """Why `root` looks node-local (None: it does not): it lies under one of
    `NODE_LOCAL_DIRS` or under ``$TMPDIR`` / ``$SLURM_TMPDIR`` (symbolic links resolved)."""
    path = Path(root).resolve()
    bases = [(Path(os.environ[var]), f"${var}") for var in NODE_LOCAL_VARS if os.environ.get(var)]
    bases += [(Path(d), d) for d in NODE_LOCAL_DIRS]
    for base, name in bases:
        base = base.resolve()
        if base != Path(base.anchor) and (path == base or base in path.parents):
            return f"it is under {name} ({base})" if name.startswith("$") else f"it is under {name}"
    return None


def warn_if_node_local(root: str | Path, num_nodes: int) -> bool:
    """Warn (once per root in this process) when a SLURM job of one node (a requeue may move
    it to another node) checkpoints to a root that looks node-local (`node_local_reason`).
    Several nodes are checked by `dream_trainer.checkpoint.check_shared_root` instead.
    Returns whether it warned."""
    reason = node_local_reason(root) if num_nodes == 1 and slurm_job_id() is not None else None
    if reason is None or str(root) in _warned_roots:
        return False
    _warned_roots.add(str(root))
    logger.warning("the checkpoint root %s looks node-local (%s): a requeued or restarted job that lands on another "
                   "node will not find its checkpoints there. Put checkpoints on storage every node shares "
                   "(TrainerConfig(root_dir=...) or CheckpointParameters(root_dir=...))", root, reason)
    return True
