"""What a fault-tolerant run's files say: the groups' event logs (`run_history`), their
checkpoint roots (`group_roots`), the check of a group's first quorum against them
(`check_progress`), and the rule that a group reads only its own run's files (`confined`).
Re-exported by `dream_trainer.fault_tolerance`."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from dream_trainer.errors import FaultToleranceError

logger = logging.getLogger("dream_trainer.fault_tolerance")

__all__ = ["check_progress", "confined", "group_roots", "run_history"]


def confined(path: Path, base: Path, what: str) -> Path:
    """`path`, found on disk below `base`, when it resolves inside `base` (the directory the
    run is configured with); `FaultToleranceError` when it leads out of it (a symlink, a
    ``..``): a group reads only its run's own files."""
    resolved, inside = Path(path).resolve(), Path(base).resolve()
    if resolved != inside and inside not in resolved.parents:
        raise FaultToleranceError(
            f"{what} {path} resolves to {resolved}, outside {inside}, the directory this run is configured with: "
            "refused (a replica group reads only its own run's files). Remove the link, or give the run a root_dir "
            "that holds its files"
        )
    return Path(path)


def group_roots(root: Path, group_id: int) -> list[Path]:
    """The checkpoint roots of every replica group of the run that this machine sees:
    `root` with its ``replica_group_<group_id>`` part replaced by each group's (only
    `root` when it has no such part). A group directory or root that leads out of the
    directory holding them is refused (`confined`)."""
    name, parts = f"replica_group_{group_id}", Path(root).parts
    if name not in parts:
        return [Path(root)]
    i = len(parts) - 1 - parts[::-1].index(name)
    base = Path(*parts[:i])
    groups = [confined(d, base, "replica group directory") for d in base.glob("replica_group_*")
              if re.fullmatch(r"replica_group_\d+", d.name)]
    roots = [Path(d, *parts[i + 1:]) for d in sorted(groups)]
    return [confined(r, base, "checkpoint root") if r.exists() else r for r in roots]


def run_history(run_dir: Path) -> tuple[int, int | None, str]:
    """What the groups' ``fault_tolerance.jsonl`` under `run_dir` say about the run:
    ``(committed, finished, where)``: the most steps committed in any of them, the step
    at which a group finished the run (an ``end`` event with status ``completed``; None:
    none did), and the file that says so. Only JSON is read, and only files inside
    `run_dir` (`confined`: a group directory or event file linked elsewhere is refused)."""
    committed, finished, seen, done = 0, None, "", ""
    for path in sorted(Path(run_dir).glob("replica_group_*/fault_tolerance.jsonl")):
        confined(path, run_dir, "event file")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            step = event.get("step") if isinstance(event, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            if step > committed:
                committed, seen = step, str(path)
            if event.get("event") == "end" and event.get("status") == "completed" and step > (finished or -1):
                finished, done = step, str(path)
    return committed, finished, done if finished is not None else seen


def check_progress(progress: tuple[int, int | None, str], step: int, participants: int, group: int) -> None:
    """At a group's first quorum, where it stands (`step`, the committed steps after any heal,
    with `participants` groups) against the run's history (`run_history`): never train on
    from an older state than the files show, except for steps that every group lost."""
    committed, finished, where = progress
    if finished is not None and step < finished:
        raise FaultToleranceError(
            f"replica group {group} stands at step {step} after its first quorum ({participants} group(s)), but this "
            f"run was finished at step {finished} ({where}) and no checkpoint of that step is visible to this group: "
            "training on would end with a model different from the finished groups'. Give the groups' "
            "CheckpointCallback a root every group can read (their final checkpoints let a late group resume), or "
            "start a new run (another run_name)"
        )
    if step == 0 and committed > 0:
        raise FaultToleranceError(
            f"replica group {group} would train this run again from step 0: {committed} step(s) were committed before "
            f"({where}), but no live group and no checkpoint visible to this group has them. Restore the checkpoints "
            "(FaultToleranceParameters.checkpoint_interval saves them while training) or start a new run (another "
            "run_name)"
        )
    if step < committed:
        logger.warning("replica group %d resumes at step %d: steps %d-%d of this run were committed before (%s), but "
                       "no live group and no checkpoint visible to this group has them: they are lost", group, step,
                       step + 1, committed, where)
