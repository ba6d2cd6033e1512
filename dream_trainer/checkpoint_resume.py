"""Which checkpoint a run resumes from: the newest (or best, or the named) checkpoint that
verifies, chosen alike on every rank.

Rank 0 lists the candidates (``resume_mode="last"``: every ``step_*`` directory under the
resume roots, newest first, damaged ones included, so that a damaged newest checkpoint is
named rather than skipped in silence) and sends the list to every rank. For each candidate in
turn every rank verifies its share (`dream_trainer.checkpoint_manifest.verify_checkpoint`)
and the ranks gather their findings: every rank sees the same verdict, also when only one
rank saw the damage (the checksums are dealt out among the ranks, or storage differs per
node). A damaged candidate is named at WARNING with why, and the one before it is tried; when
none is intact the resume is refused, naming each checkpoint and why.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

from dream_trainer.checkpoint import best_of, list_checkpoints, read_info
from dream_trainer.checkpoint_manifest import REFUSED, has_manifest, unsafe, verify_checkpoint, warn_unverifiable
from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step_(\d+)$")


class ResumeWorld(Protocol):
    """What `choose_resume` needs of the world."""

    rank: int
    world_size: int

    @property
    def is_rank_zero(self) -> bool: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...


class ResumeSettings(Protocol):
    """What `choose_resume` reads of `CheckpointParameters`."""

    resume_mode: str | os.PathLike[str] | None
    mode: str
    verify: str


def step_directories(roots: list[Path], own: Path) -> list[Path]:
    """Every ``step_*`` directory under `roots` (inside its root), newest first; on a tie,
    the one under `own` first."""
    found = []
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            if not (_STEP.match(child.name) and child.is_dir()):
                continue
            if child.resolve().is_relative_to(root.resolve()):
                found.append(child)
            else:
                logger.warning("skipping %s: it resolves to %s, outside the checkpoint root %s", child,
                               child.resolve(), root)
    own = own.resolve()
    return sorted(found, key=lambda p: (int(p.name[5:]), p.parent.resolve() == own), reverse=True)


def _candidates(settings: ResumeSettings, root: Path, roots: list[Path]) -> list[Path] | Exception:
    """Rank 0: the checkpoints to try, best first (an error to raise on every rank)."""
    mode = settings.resume_mode
    try:
        if mode == "last":
            if settings.verify == "off":  # the listing alone: complete checkpoints only
                infos = [info for r in roots for info in list_checkpoints(r)]
                return [p for p in step_directories(roots, root) if any(p == i.path for i in infos)]
            return step_directories(roots, root)
        if mode == "best":
            infos = list_checkpoints(root)
            best = [info.path for info in best_of(infos, settings.mode)]
            if infos and not best:
                return CheckpointError(f"resume_mode='best': no checkpoint under {root} has a score")
            return best
        return [Path(str(mode))]
    except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
        return exc


def _verdict(world: ResumeWorld, path: Path, mode: str, named: bool) -> list[str]:
    """What the ranks found wrong with `path`, every rank the same (a collective). A
    ``.metadata`` asking to run code raises `UnsafeStateError` on every rank when it is the
    checkpoint named, or when its checksum says it was written so (not damaged)."""
    from dream_trainer.serialization import UnsafeStateError

    try:  # whatever goes wrong here is this rank's finding: the others wait for it
        mine = verify_checkpoint(path, mode, world.rank, world.world_size)
    except Exception as exc:  # noqa: BLE001 - e.g. a file this rank cannot read
        mine = [f"{path.name}: cannot be verified ({type(exc).__name__}: {exc})"]
    if not named and world.is_rank_zero and not mine and read_info(path) is None:
        mine = ["dream_trainer.json: damaged, or it does not name this directory's step"]
    found: list[list[str]] = world.all_gather_object(mine)
    every = [problem for problems in found for problem in problems]
    refusals = [problem[len(REFUSED):] for problem in every if problem.startswith(REFUSED)]
    refused = unsafe(every) or (refusals[0] if named and refusals else None)
    if refused:
        raise UnsafeStateError(f"checkpoint {path}: {refused}")
    tag = (lambda r: f" (found by rank {r})") if world.world_size > 1 else (lambda r: "")
    return sorted({f"{problem}{tag(rank)}" for rank, problems in enumerate(found) for problem in problems})


def choose_resume(world: ResumeWorld, settings: ResumeSettings, root: Path, roots: list[Path],
                  refusal: Any = None) -> Path | None:
    """The checkpoint every rank resumes from (None: start fresh); a collective.

    `roots`: where ``resume_mode="last"`` looks (`root` first on a tie); `refusal`: called on
    rank 0 when no checkpoint was found, returns the error that refuses a fresh start (or
    None). Raises `CheckpointError` when every candidate is damaged, or the one named is."""
    mode = settings.resume_mode
    if mode is None:
        return None
    plan = _candidates(settings, root, roots) if world.is_rank_zero else None
    if world.is_rank_zero and plan == [] and refusal is not None:
        plan = refusal() or []
    plan = world.broadcast_object(plan)
    if isinstance(plan, Exception):
        raise plan
    named = mode not in ("last", "best")
    rejected: list[tuple[Path, list[str]]] = []
    for path in plan:
        if settings.verify != "off" and world.is_rank_zero and path.is_dir() and not has_manifest(path):
            warn_unverifiable(path)
        problems = [] if settings.verify == "off" else _verdict(world, path, settings.verify, named)
        if not problems:
            if rejected and world.is_rank_zero:
                logger.warning("resuming from %s, the next intact checkpoint (%d damaged one(s) skipped)", path,
                               len(rejected))
            if path.parent.resolve() != root.resolve() and mode == "last" and world.is_rank_zero:
                logger.warning("resumes from %s: newer than the checkpoints under %s", path, root)
            return path
        rejected.append((path, problems))
        if world.is_rank_zero and not named:
            logger.warning("checkpoint %s is damaged, not resuming from it: %s", path, "; ".join(problems))
    if named and rejected:
        raise CheckpointError(f"cannot load checkpoint {plan[0]}: it is damaged: {'; '.join(rejected[0][1])}. "
                              f"`python -m dream_trainer.checkpoint verify {plan[0]}` checks it again")
    if rejected:
        each = " | ".join(f"{path}: {'; '.join(problems)}" for path, problems in rejected)
        raise CheckpointError(
            f"no intact checkpoint to resume from: all {len(rejected)} checkpoint(s) are damaged: {each}. Restore "
            "one, or move them away to start fresh (python -m dream_trainer.checkpoint verify DIR checks a root)"
        )
    if world.is_rank_zero:
        logger.info("no checkpoint to resume from under %s: starting fresh", root)
    return None
