"""`RunRecordCallback` (the run directory's record of config, code and versions, compared
on resume) and `InitFromCheckpointCallback` (start from another run's weights)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dream_trainer.checkpoint import list_checkpoints
from dream_trainer.weights_io import load_weights
from dream_trainer.errors import CheckpointError
from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.base import BaseTrainer

logger = logging.getLogger(__name__)


class RunRecordCallback(Callback[BaseTrainer]):
    """Write ``<run_dir>/run.json`` when the run starts: the resolved config
    (``trainer.config`` as data), the git commit (and whether the tree was dirty), the
    versions of python, torch, torchao, torchft and dream_trainer, the command line.

    When the run will resume (its `CheckpointCallback` has a checkpoint to resume from) and
    a record exists, the record is compared with this start first: a changed config value,
    version or commit is warned; a changed field marked `FIXED_ON_RESUME` (a model's shape)
    is refused with `CheckpointError` naming it, on every rank (rank 0 decides), before any
    model is built. The previous records are kept in the file's ``history``.
    `dream_trainer.cli` adds this callback to every run it starts.
    """

    critical = True

    def __init__(self, argv: list[str] | None = None):
        self.argv = argv
        self.warnings: list[str] = []
        self.path: Path | None = None

    def pre_configure(self) -> None:
        from dream_trainer.run_records import compare, make_record, read_record, write_record

        trainer, world = self.trainer, self.trainer.world
        decision: Any = None
        if world.is_rank_zero:
            try:
                record = make_record(trainer.config, self.argv)
                previous = read_record(trainer.run_dir) if _will_resume(trainer) else None
                refusal, warnings = compare(previous, record, type(trainer.config)) if previous else (None, [])
                if refusal is None:
                    self.path = write_record(trainer.run_dir, record)
                decision = (refusal, warnings)
            except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
                decision = (f"run record: {exc}", [])
        refusal, self.warnings = world.broadcast_object(decision)
        if refusal is not None:
            raise CheckpointError(f"run {trainer.run_dir}: {refusal}")
        for warning in self.warnings:
            logger.warning("resuming %s: %s", trainer.run_dir, warning)


def _will_resume(trainer: Any) -> bool:
    """Whether the run's `CheckpointCallback` will resume: from a checkpoint path it was
    given, or from a checkpoint under the roots it resumes from (its ``resume_roots()``)."""
    from dream_trainer.callbacks.checkpoint import CheckpointCallback

    for callback in trainer.callbacks:
        if isinstance(callback, CheckpointCallback) and callback.params.resume_mode is not None:
            if callback.params.resume_mode not in ("last", "best"):
                return True
            return any(root.is_dir() and bool(list_checkpoints(root)) for root in callback.resume_roots())
    return False


class InitFromCheckpointCallback(Callback[BaseTrainer]):
    """Start from the model weights of a checkpoint (``--init-from``: fine-tuning), and
    nothing else of it: the optimizer, the schedule, the step and the data start fresh.
    Loaded in `post_configure`, before a `CheckpointCallback` resumes: a run that resumes
    its own checkpoint continues from that one. `strict=False` loads the weights whose
    names and shapes match and warns about the rest (a model with added adapters)."""

    critical = True
    order = 900  # before CheckpointCallback (1000): resuming the run's own checkpoint wins

    def __init__(self, path: str | Path, strict: bool = True):
        self.path, self.strict = Path(path), strict

    def pre_launch(self) -> None:
        if not self.path.is_dir():
            raise CheckpointError(f"--init-from {self.path}: no checkpoint directory there")

    def post_configure(self) -> None:
        load_weights(self.path, self.trainer.named_models(), strict=self.strict)
        logger.info("initialized the weights of %s from %s", ", ".join(self.trainer.named_models()), self.path)
