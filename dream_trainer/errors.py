"""Errors shared by modules that must not import each other (`dream_trainer.checkpoint`
depends on `dream_trainer.serialization`, whose errors are checkpoint errors)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not match the run."""
