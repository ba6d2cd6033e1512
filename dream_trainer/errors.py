"""Errors shared by modules that must not import each other (`dream_trainer.checkpoint`
depends on `dream_trainer.serialization`, whose errors are checkpoint errors; the
fault-tolerance modules raise theirs below the world that imports them)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not match the run."""


class FaultToleranceError(RuntimeError):
    """A fault-tolerance setting or event the run cannot continue with (an unreachable
    lighthouse, an unresolvable hostname, more replica failures than `max_failures`)."""
